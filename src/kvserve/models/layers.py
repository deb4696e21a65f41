"""Layers the model families share: linears, RMSNorm, RoPE, gated MLPs.

CPU inference runs the small ops through the compiled kernels (kernels/cpu.py) where
they fit; elsewhere torch ops with the same rounding points. Numerics follow HF
transformers so greedy outputs match it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.cpu_features import bf16_native
from kvserve.kernels.cpu import QMatmul, kernels_for
from kvserve.models.quant import Bf16Gemm, QuantLinear


class Derived:
    """A tensor computed from weights, made on first use and remade when a weight's storage,
    shape, dtype or device changes (``model.to``, reloading); weights edited in place must be
    reloaded instead. Weights load after ``__init__`` (meta device, then assigned), so what is
    derived from them cannot be made there."""

    def __init__(self, make: Callable[..., Any]) -> None:
        self._make = make
        self._key: tuple | None = None
        self._value: Any = None

    def get(self, *weights: torch.Tensor) -> Any:
        key = tuple((w.data_ptr(), w.shape, w.dtype, w.device) for w in weights)
        if key != self._key or self._value is None:
            self._value = self._make(*(w.detach() for w in weights))
            self._key = key
        return self._value


def linear(x: torch.Tensor, weight: torch.Tensor, packed: Derived,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); bf16 inference on CPU goes through the packed weight
    (``packed``: a Derived Bf16Gemm).

    oneDNN's prepacked copy is bitwise equal to F.linear on Gemma 3 270M's shapes and
    measured faster on a 2-core AVX-512 CPU: ~1.5x for the 262k-row head, 2.3x for the
    layers' projections at one token and ~1.2x at 32 tokens (one thread); our kernel
    (kernels/bf16gemm.c: AMX's tiles, or AVX-512 BF16 vectors) gives the same sums to a
    rounding in a thousand outputs, faster still from a few rows (Bf16Gemm). Both need
    bf16 computed natively;
    elsewhere (AVX2-only) F.linear's emulated bf16 is the correct path. A few float32 rows
    go as ``weight @ rows.T`` (``_few_rows_transposed``: up to 16 times a head, 4 times a
    layer's projection). Other dtypes, devices and autograd take F.linear.
    """
    if x.device.type == "cpu" and not torch.is_grad_enabled():
        rows = x.reshape(-1, x.shape[-1])
        if _packs(weight, x.dtype):
            out = packed.get(weight)(rows.contiguous(), bias)
            return out.view(*x.shape[:-1], weight.shape[0])
        if _transposed_faster(weight, x.dtype, rows.shape[0]):
            return _few_rows_transposed(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


TALL_ROWS = 1 << 15  # a vocabulary's head; the layers' projections have a few thousand rows
SMALL_WEIGHT = 1 << 19  # below this, F.linear's fewer calls win (a tiny test model: ~15 us)


def _transposed_faster(weight: torch.Tensor, dtype: torch.dtype, num_rows: int) -> bool:
    """Whether ``_few_rows_transposed`` beats F.linear: float32 rows and weight, at most 16
    rows times a head, at most 4 times a layer's projection (measured, weights from DRAM as
    in a decode step: 1-2 rows 1.4-2.8x faster, 4 rows 1.0-1.4x, 8 rows 0.8-1.0x)."""
    if not weight.dtype == dtype == torch.float32 or weight.numel() < SMALL_WEIGHT:
        return False
    return 0 < num_rows <= (16 if weight.shape[0] >= TALL_ROWS else 4)


def _few_rows_transposed(rows: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for a few float32 rows, as ``weight @ rows.T``: torch's CPU BLAS runs
    F.linear's layout 2-6x slower there, and one row alone as a matrix-vector product at a
    third of the bandwidth, so it goes as two.

    Measured on the 262144 x 640 head, 2 cores (AVX-512 and held to AVX2 alike): 1 row
    66 -> 39 ms, 2 rows 147 -> 43 ms, 8 rows 139 -> 56 ms, 16 rows 142 -> 102 ms; from ~24
    rows on F.linear's own path is as fast (``benchmarks/cpu_linears.py --only "f32
    kvserve" --cold 96``). The sums are the same dot products in another order: equal to
    F.linear's to float32 rounding, not bitwise.
    """
    n = rows.shape[0]
    both = rows.expand(2, -1).contiguous() if n == 1 else rows
    out = (weight @ both.T)[:, :n].T.contiguous()
    return out if bias is None else out + bias


def _packs(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether rows of `dtype` times this weight go through its packed bf16 copy."""
    return weight.dtype == torch.bfloat16 == dtype and bf16_native()


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) that runs bf16 CPU inference through a
    packed copy of its weight (see ``linear``), or its quantized copy once quantized."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed = Derived(Bf16Gemm)
        self.quant: QuantLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            out = self.quant(x)
            return out if self.bias is None else out + self.bias
        return linear(x, self.weight, self.packed, self.bias)

    def kernel(self, rows: int, dtype: torch.dtype) -> QMatmul | None:
        """The kernel call forward makes for `rows` rows of `dtype` (kernels/decoder.c runs
        it), or None where forward takes another path."""
        if self.bias is not None:
            return None
        if self.quant is not None:
            return self.quant.kernel(rows, dtype)
        if _packs(self.weight, dtype):
            return self.packed.get(self.weight).kernel(rows, dtype)
        return None


def _scale(offset: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def make(weight: torch.Tensor) -> torch.Tensor:
        return weight.float() + offset if offset else weight.float()
    return make


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. `offset` 1.0 is Gemma's zero-centred weight, applied as
    (1 + w); 0.0 is Llama's and most others'.

    The scale multiplies before casting back (Gemma's order; Llama casts first): equal in
    float32, a rounding apart in bf16.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.scale = Derived(_scale(offset))

    def factor(self) -> torch.Tensor:
        """The float32 factor the norm applies per channel."""
        return self.scale.get(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm_rope(x, self.factor(), self.eps)


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * scale in float32, cast back to x's dtype.

    Textbook ops, not torch.rms_norm: bitwise equal, but a composite op on CPU that measured
    slower inside the engine.
    """
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).type_as(x)


def norm_rope(x: torch.Tensor, scale: torch.Tensor | None, eps: float,
              cos_sin: tuple[torch.Tensor, ...] | None = None, *,
              in_place: bool = False) -> torch.Tensor:
    """rms_norm over the last dim (none where scale is None), then RoPE if cos_sin is given.

    On CPU one compiled pass per row does it (about 10 ops fewer per call, which is most of a
    decode step's small-op time): same rounding points, float32 sums in another order.
    in_place lets that pass write over x (the q/k heads of the fresh qkv projection).
    """
    k = kernels_for(x)
    D = x.shape[-1]
    if k is not None and x.stride(-1) == 1 and D % 2 == 0 and D <= k.MAX_ROW:
        rows = x.view(-1, 1, D) if x.dim() == 2 else x
        factors = None if scale is None else scale.expand(rows.shape[1:]).contiguous()
        out = k.norm_rope(rows, factors, eps, cos_sin, rows if in_place else None)
        return out.view(x.shape)
    y = x if scale is None else rms_norm(x, scale, eps)
    return apply_rope(y, *cos_sin) if cos_sin is not None else y


def add_norm(x: torch.Tensor, h: torch.Tensor, norm: RMSNorm,
             next_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sandwich-norm residual step: x + norm(h), and next_norm of that sum (the next
    sub-block's input).

    On CPU one compiled pass per row, adding into x in place (the residual stream owns it).
    """
    k = kernels_for(x)
    w_next = next_norm.factor() if next_norm is not None else None
    if k is not None and x.is_contiguous() and h.is_contiguous() and x.shape[-1] <= k.MAX_ROW:
        return x, k.add_norm(x, h, norm.factor(), norm.eps, w_next)
    x = x + norm(h)
    return x, next_norm(x) if next_norm is not None else None


def add_then_norm(x: torch.Tensor, h: torch.Tensor,
                  next_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pre-norm residual step (Llama and most): x + h, and next_norm of that sum."""
    x = x.add_(h) if not torch.is_grad_enabled() else x + h
    return x, next_norm(x) if next_norm is not None else None


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(dim: int, base: float, scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies of `dim` rotated channels: default, linear or llama3 scaling
    (the rules of transformers' ROPE_INIT_FUNCTIONS for those types)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, mid, scaled)
    raise NotImplementedError(f"rope scaling {kind!r} is not supported")


class RotaryEmbedding:
    """Neox-style (rotate-half) RoPE over the first `dim` channels of a head.

    Kept out of the module's buffers on purpose: ``model.to(bfloat16)`` must not round the
    inverse frequencies, and building the model on the meta device must not lose them.
    """

    def __init__(self, head_dim: int, base: float,
                 scaling: Mapping[str, Any] | None = None) -> None:
        self.head_dim, self.base, self.scaling = head_dim, base, scaling
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        # Made on first use: a model is built under torch.device("meta").
        if device not in self._inv_freq:
            with torch.device("cpu"):
                inv = rope_inv_freq(self.head_dim, self.base, self.scaling)
            self._inv_freq[device] = inv.to(device)
        return self._inv_freq[device]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = self.head_dim // 2
        sin = emb.sin()
        sin[:, :half].neg_()  # folds rotate-half's sign in: see apply_rope
        # [num_tokens, 1, head_dim]: broadcasts over heads.
        return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (or bias entries) of a q or k projection whose heads rotate adjacent channel pairs
    (2i, 2i + 1), as a complex multiplication (HF Llama 4, llama.cpp's Llama), reordered so
    each head rotates halves (i, D/2 + i) instead: `RotaryEmbedding`'s rotate-half RoPE then
    computes the same rotation. q and k reordered alike leave every q.k unchanged, and the
    RMS of a head ignores channel order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1] = roll(x) * [-1, 1].

    The sign lives in signed_sin (made once per step), so the rotation is one roll instead of
    a chunk, a negation and a cat per call; bitwise equal (a sign flip is exact).
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# ------------------------------------------------------------------------ attention


def _qk_factors(n_heads: int, n_kv_heads: int, offset: float) -> Callable[..., torch.Tensor]:
    """Derived maker: [q heads + kv heads, head_dim] factors of q_norm, then of k_norm."""
    make = _scale(offset)
    return lambda wq, wk: torch.cat((make(wq).expand(n_heads, -1),
                                     make(wk).expand(n_kv_heads, -1)))


class SelfAttention(nn.Module):
    """Grouped-query self-attention with RoPE over the backend's KV, as Gemma 2/3, the
    Llama family and Bamba have it: q/k/v in one matmul (the families' adapt_state_dict
    fuses the checkpoint's projections), optional per-head q/k RMSNorm (`qk_norm`: its
    weight offset, Gemma's 1.0 or Qwen3's 0.0; None: none), RoPE on all of a head or, where
    cos/sin are narrower (Bamba), on its first channels."""

    def __init__(self, layer_idx: int, hidden: int, n_heads: int, n_kv_heads: int,
                 head_dim: int, eps: float, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: float | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.qkv_proj = Linear(hidden, (n_heads + 2 * n_kv_heads) * head_dim, bias=qkv_bias)
        self.o_proj = Linear(n_heads * head_dim, hidden, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = RMSNorm(head_dim, eps, offset=qk_norm)
            self.k_norm = RMSNorm(head_dim, eps, offset=qk_norm)
            self.qk_scale = Derived(_qk_factors(n_heads, n_kv_heads, qk_norm))

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...],
                attn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """`attn`: the model's AttentionBackend (models/base.py)."""
        n, D = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        # q and k heads sit side by side: norm and rotate them in one pass each (the same
        # per-head arithmetic as two passes, ~15 small ops fewer per layer).
        qk = qkv[:, : (self.n_heads + self.n_kv_heads) * D].view(n, -1, D)
        rot = cos_sin[0].shape[-1]
        if hasattr(self, "q_norm"):
            scale = self.qk_scale.get(self.q_norm.weight, self.k_norm.weight)
            qk = norm_rope(qk, scale, self.q_norm.eps, cos_sin, in_place=True)
        elif rot == D:
            qk = norm_rope(qk, None, 0.0, cos_sin, in_place=True)
        else:
            qk = torch.cat((apply_rope(qk[..., :rot], *cos_sin), qk[..., rot:]), dim=-1)
        q, k = qk.split((self.n_heads, self.n_kv_heads), dim=1)
        v = qkv[:, (self.n_heads + self.n_kv_heads) * D:].view(n, self.n_kv_heads, D)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(n, self.n_heads * D))


# ------------------------------------------------------------------------------ MLP


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up of the fused projection [gate | up].

    On CPU one compiled pass (2.4x faster than torch's bf16 gelu alone at prefill size);
    elsewhere in place, one [tokens, intermediate] buffer fewer per layer.
    """
    k = kernels_for(gate_up)
    if k is not None and gate_up.is_contiguous():
        return k.gelu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused projection [gate | up] (Llama's SwiGLU); on CPU one
    compiled pass, as gelu_mul."""
    k = kernels_for(gate_up)
    if k is not None and gate_up.dim() == 2 and gate_up.is_contiguous():
        return k.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": gelu_mul, "gelu_tanh": gelu_mul, "silu": silu_mul,
}


def act_mul(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise NotImplementedError(f"activation {name!r} is not supported "
                                  f"(have {', '.join(sorted(ACTIVATIONS))})")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused in one matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = act_mul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


# ------------------------------------------------------------------------ weights

FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(state_dict: Mapping[str, torch.Tensor],
                     fused: Mapping[str, Sequence[str]] = FUSED) -> dict[str, torch.Tensor]:
    """HF-named weights -> fused ones: q/k/v and gate/up concatenated per layer (weights and
    biases alike), where a layer has them all."""
    out = dict(state_dict)
    layers = {k.split(".")[2] for k in state_dict if k.startswith("model.layers.")}
    for i in layers:
        prefix = f"model.layers.{i}."
        for target, parts in fused.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{p}.{kind}" for p in parts]
                if all(n in out for n in names):
                    out[f"{prefix}{target}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out
