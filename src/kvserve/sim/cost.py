"""Roofline cost of one engine step, and the KV memory budget of a GPU.

Step time = max(bytes moved / HBM bandwidth, FLOPs / peak FLOP/s): the
weights are read once per step (for MoE only the experts the step's tokens
can reach), every request's attended KV is read once and its new KV written
once; matmuls run at the weights' precision (FP8 when the weights are FP8),
attention at bf16. There is no kernel-efficiency factor and no CPU or
launch overhead, so the times are a lower bound: absolute throughput is
optimistic, but policies compared on the same model and GPU see the same
optimism.

KV budget = GPU memory x utilization - weights - activation reserve, with
the reserve modelled on vLLM's start-up profiling: a fixed 1 GiB per GPU
(CUDA context, cuBLAS workspaces, CUDA graphs) plus the peak activations of
one forward pass over `max_num_batched_tokens` tokens and fp32 logits for
`max_num_seqs` sequences.

Tensor parallelism (`tp` GPUs) is modelled as one GPU with tp times the
memory, bandwidth and FLOP/s, with no communication cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.memory import LayerKind
from kvserve.sim.gpus import GPU
from kvserve.sim.models import BF16, Group, Model

GiB = 1 << 30
FIXED_RESERVE_PER_GPU = 1 * GiB


@dataclass(frozen=True)
class Chunk:
    """What one request computes in a step."""

    start: int  # tokens already in its KV cache
    num_tokens: int  # tokens computed this step
    sampled: bool = False  # the chunk ends the known tokens: a token is sampled
    image_tokens: int = 0  # cross-attention: image tokens its text attends to
    new_image_tokens: int = 0  # image tokens encoded this step (tower + cross KV)


@dataclass(frozen=True)
class StepCost:
    seconds: float
    flops: float
    bytes: float
    memory_bound: bool  # bandwidth, not compute, set the time


@dataclass(frozen=True)
class Budget:
    """Where the GPU memory goes, in bytes."""

    usable: float  # memory x utilization
    weights: float
    reserve: float
    kv: int

    def as_dict(self) -> dict[str, float]:
        return {"usable": self.usable, "weights": self.weights, "reserve": self.reserve,
                "kv": self.kv}


def kv_budget(
    model: Model, gpu: GPU, *, fp8_weights: bool, max_num_batched_tokens: int,
    max_num_seqs: int, utilization: float = 0.9, tp: int = 1,
) -> Budget:
    """KV pool bytes left after weights and the activation reserve (may be <= 0: OOM)."""
    usable = gpu.memory_bytes * tp * utilization
    weights = model.weight_bytes(fp8_weights)
    reserve = FIXED_RESERVE_PER_GPU * tp + activation_bytes(
        model, max_num_batched_tokens, max_num_seqs, tp)
    return Budget(usable, weights, reserve, int(usable - weights - reserve))


def activation_bytes(model: Model, tokens: int, seqs: int, tp: int = 1) -> float:
    """Peak activations of one forward over `tokens` tokens, plus the sampler's logits.

    Per token, live at once in the widest layer: the residual stream and its
    normed copy (replicated on every TP rank), the mixer's input projection
    (q, k, v, or Mamba's x and gate) and the FFN's gate, up and activation.
    """
    attn = (model.heads + 2 * model.kv_heads) * model.head_dim
    mamba = 2 * model.mamba.expand * model.hidden if model.mamba else 0
    if model.moe is not None:
        ffn = (model.moe.top_k + model.moe.shared) * model.moe.intermediate
        ffn = max(ffn, model.intermediate if model.dense_ffn_layers else 0)
    else:
        ffn = model.intermediate
    width = 2 * model.hidden * tp + max(attn, mamba) + 3 * ffn
    logits = seqs * model.vocab * 4
    return tokens * width * BF16 + logits


class CostModel:
    """Step time of a batch on one model and GPU."""

    def __init__(self, model: Model, gpu: GPU, *, fp8_weights: bool = False,
                 kv_dtype_bytes: int = BF16, tp: int = 1) -> None:
        self.model = model
        self.bandwidth = gpu.hbm_bandwidth * tp
        self.matmul_flops = gpu.matmul_flops(fp8_weights) * tp
        self.attn_flops = gpu.bf16_flops * tp
        self.kv_token_bytes = model.kv_bytes_per_token(kv_dtype_bytes)
        self.weight_bytes_per_param = 1 if fp8_weights else BF16
        self._dense_weight_bytes = self._dense_weights(model, fp8_weights)

    @staticmethod
    def _dense_weights(model: Model, fp8_weights: bool) -> float:
        """Weights every step reads: everything but routed experts, embeddings and vision."""
        per = 1 if fp8_weights else BF16
        routed = 0
        if model.moe is not None:
            e = model.moe
            routed = e.layers * e.experts * 3 * model.hidden * e.intermediate
        lm_head = model.vocab * model.hidden * BF16
        return (model.linear_params() - routed) * per + lm_head

    # ------------------------------------------------------------------ step

    def step(self, chunks: Sequence[Chunk]) -> StepCost:
        if not chunks:
            return StepCost(0.0, 0.0, 0.0, False)
        tokens = sum(c.num_tokens for c in chunks)
        m = self.model
        mm_flops = tokens * m.linear_flops_per_token()
        mm_flops += sum(c.sampled for c in chunks) * m.lm_head_flops()
        attn_flops = 0.0
        nbytes = self._dense_weight_bytes + self._expert_bytes(tokens)
        for c in chunks:
            f, b = self._chunk(c)
            attn_flops += f
            nbytes += b
            if c.new_image_tokens:
                mm_flops += c.new_image_tokens * m.encoder_flops_per_image_token()
                nbytes += m.extra_params() * BF16  # the vision tower's weights
        mem_s = nbytes / self.bandwidth
        compute_s = mm_flops / self.matmul_flops + attn_flops / self.attn_flops
        return StepCost(max(mem_s, compute_s), mm_flops + attn_flops, nbytes, mem_s >= compute_s)

    def _expert_bytes(self, tokens: int) -> float:
        """Routed experts the step touches: expected distinct experts under uniform routing."""
        e = self.model.moe
        if e is None:
            return 0.0
        touched = e.experts * (1.0 - (1.0 - e.top_k / e.experts) ** tokens)
        per_expert = 3 * self.model.hidden * e.intermediate * self.weight_bytes_per_param
        return e.layers * touched * per_expert

    def _chunk(self, c: Chunk) -> tuple[float, float]:
        """(attention-like FLOPs, KV/state bytes) of one request's chunk."""
        flops = nbytes = 0.0
        m = self.model
        qk_pv = 4.0 * m.heads * m.head_dim  # QK^T and PV per (query, key) pair per layer
        for g in m.groups:
            if g.kind is LayerKind.MAMBA:
                flops += g.layers * c.num_tokens * m.mamba_scan_flops_per_token()
                nbytes += g.layers * 2 * m.mamba_state_bytes()  # read and write the state
            elif g.kind is LayerKind.CROSS:
                flops += g.layers * qk_pv * c.num_tokens * c.image_tokens
                nbytes += g.layers * self.kv_token_bytes * (c.image_tokens + c.new_image_tokens)
                kv_proj = 2 * m.hidden * 2 * m.kv_heads * m.head_dim
                flops += g.layers * kv_proj * c.new_image_tokens
            else:
                pairs = attended_pairs(g, c.start, c.num_tokens)
                flops += g.layers * qk_pv * pairs
                old = c.start - window_start(g, c.start)
                nbytes += g.layers * self.kv_token_bytes * (old + c.num_tokens)
        return flops, nbytes


# ---------------------------------------------------------------- attention


def window_start(g: Group, pos: int) -> int:
    """First key a query at `pos` attends to (the memory core's rule)."""
    if g.kind is LayerKind.SLIDING:
        return max(0, pos - g.window)
    if g.kind is LayerKind.CHUNKED:
        return pos - pos % g.chunk
    return 0


def attended_pairs(g: Group, start: int, n: int) -> int:
    """Sum over queries p in [start, start + n) of the keys p attends to (itself included)."""
    end = start + n
    if g.kind is LayerKind.SLIDING:
        return n + _sum_min(start, end, g.window)
    if g.kind is LayerKind.CHUNKED:
        total, p = 0, start
        while p < end:  # one aligned chunk at a time
            stop = min(end, p - p % g.chunk + g.chunk)
            total += _arith(p % g.chunk, stop - p) + (stop - p)
            p = stop
        return total
    return _arith(start, n) + n


def _arith(first: int, count: int) -> int:
    """first + (first + 1) + ... (count terms)."""
    return count * first + count * (count - 1) // 2


def _sum_min(a: int, b: int, w: int) -> int:
    """Sum of min(p, w) for p in [a, b)."""
    if b <= w:
        return _arith(a, b - a)
    if a >= w:
        return (b - a) * w
    return _arith(a, w - a) + (b - w) * w
