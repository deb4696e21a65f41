"""Model shapes as data: each model gives its KV specs, weight bytes and FLOPs per token.

Every number comes from the model's published config (HF `config.json`, or
Mistral's `params.json`), linked next to it. `params` is the published
total parameter count (what the checkpoint weighs, vision tower included);
the per-layer shapes give the KV specs and the FLOPs. `derived_params()`
recomputes the language model's parameters from the shapes, which the tests
compare with `params` as a check on the transcription.

Precision: bf16 weights and KV unless FP8 is asked for. `fp8_gpus` lists
the GPUs where the Jenga paper's Table 1 marks the model with * ("with FP8
quantization"); vLLM's `--quantization fp8` quantizes the linear layers'
weights only (embeddings and lm_head stay bf16) and keeps the KV cache in
bf16, so that is what "auto" means here; FP8 KV is a separate choice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.memory import KVSpec, LayerKind

BF16 = 2
FP8 = 1


@dataclass(frozen=True)
class Group:
    """Layers that share a token mixer and a KV rule."""

    name: str
    kind: LayerKind  # FULL, SLIDING, CHUNKED, CROSS (attention) or MAMBA
    layers: int
    window: int = 0
    chunk: int = 0


@dataclass(frozen=True)
class MoE:
    layers: int  # decoder layers whose FFN is a mixture of experts
    experts: int
    top_k: int
    intermediate: int  # per expert
    shared: int = 0  # always-active shared experts of the same size


@dataclass(frozen=True)
class Mamba:
    d_state: int
    d_conv: int
    expand: int
    dt_rank: int  # Mamba-1 only
    heads: int = 0  # Mamba-2 (SSD) when > 0: heads x head_dim = expand x hidden
    groups: int = 0  # Mamba-2: B and C groups (n_groups)

    @property
    def v2(self) -> bool:
        return self.heads > 0


@dataclass(frozen=True)
class Model:
    name: str
    source: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense FFN width
    vocab: int
    max_len: int
    params: float  # published total, sets the weight bytes
    groups: tuple[Group, ...]
    dense_ffn_layers: int  # decoder layers with a dense (gated) FFN
    moe: MoE | None = None
    mamba: Mamba | None = None
    tied_embeddings: bool = False
    fp8_gpus: frozenset[str] = frozenset()  # Table 1 marks * on these GPUs
    image_tokens_per_tile: int = 0  # vision models: tokens one image tile yields

    # ------------------------------------------------------------ layers

    @property
    def num_layers(self) -> int:
        return sum(g.layers for g in self.groups)

    def attention_groups(self) -> list[Group]:
        return [g for g in self.groups if g.kind is not LayerKind.MAMBA]

    def attn_layer_params(self) -> int:
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v

    def mamba_layer_params(self) -> int:
        m = self.mamba
        if m is None:
            return 0
        d_inner = m.expand * self.hidden
        if m.v2:
            conv_dim = d_inner + 2 * m.groups * m.d_state
            return (
                self.hidden * (d_inner + conv_dim + m.heads)  # in_proj (gate, x B C, dt)
                + conv_dim * m.d_conv  # depthwise conv over x, B and C
                + 3 * m.heads  # dt_bias, A_log, D
                + d_inner  # gated RMSNorm
                + d_inner * self.hidden  # out_proj
            )
        return (
            self.hidden * 2 * d_inner  # in_proj (x and gate)
            + d_inner * m.d_conv  # depthwise conv
            + d_inner * (m.dt_rank + 2 * m.d_state)  # x_proj
            + m.dt_rank * d_inner  # dt_proj
            + d_inner * self.hidden  # out_proj
        )

    def mamba_state_bytes(self, dtype_bytes: int = BF16) -> int:
        """One Mamba layer's state: conv (d_conv - 1 columns, as vLLM keeps it) + SSM.

        Mamba-2 convolves x, B and C (d_inner + 2 x groups x d_state channels) and
        keeps a heads x head_dim x d_state SSM state (vLLM's mamba2 state shapes).
        """
        m = self.mamba
        if m is None:
            return 0
        d_inner = m.expand * self.hidden
        if m.v2:
            conv = (d_inner + 2 * m.groups * m.d_state) * (m.d_conv - 1)
            return (conv + d_inner * m.d_state) * dtype_bytes
        return d_inner * (m.d_conv - 1 + m.d_state) * dtype_bytes

    def ffn_params(self, active: bool) -> int:
        dense = 3 * self.hidden * self.intermediate * self.dense_ffn_layers
        if self.moe is None:
            return dense
        e = self.moe
        per_expert = 3 * self.hidden * e.intermediate
        n = (e.top_k if active else e.experts) + e.shared
        router = self.hidden * e.experts
        return dense + e.layers * (n * per_expert + router)

    def mixer_params(self) -> int:
        attn, mamba = self.attn_layer_params(), self.mamba_layer_params()
        return sum(g.layers * (mamba if g.kind is LayerKind.MAMBA else attn) for g in self.groups)

    def linear_params(self, active: bool = False) -> int:
        """Matmul weights of the decoder layers (all experts, or the active ones)."""
        return self.mixer_params() + self.ffn_params(active)

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def derived_params(self) -> int:
        """The language model's parameters from the shapes (norms and biases left out)."""
        return self.linear_params() + self.embedding_params()

    def extra_params(self) -> float:
        """Published minus derived: the vision tower and projector of a VLM, else ~0."""
        return max(0.0, self.params - self.derived_params())

    # --------------------------------------------------------------- bytes

    def weight_bytes(self, fp8_weights: bool) -> float:
        if not fp8_weights:
            return self.params * BF16
        linear = self.linear_params()
        return linear * FP8 + (self.params - linear) * BF16

    def kv_bytes_per_token(self, kv_dtype_bytes: int = BF16) -> int:
        """K and V of one token in one attention layer."""
        return 2 * self.kv_heads * self.head_dim * kv_dtype_bytes

    def kv_specs(self, kv_dtype_bytes: int = BF16, checkpoint_every: int = 512,
                 state_page_multiple: int = 0) -> list[KVSpec]:
        """One KVSpec per group, as the memory core takes them (Mamba states cached every
        `checkpoint_every` tokens).

        `state_page_multiple` > 0 pads a Mamba group's page (one state of each of its
        layers) up to a multiple of that many bytes, given as one layer of that size:
        for layouts that refuse the natural LCM (a Mamba-2 state of 2,147,840 B per
        layer, 2^9 x 5 x 839, shares almost no factor with an attention page).
        """
        specs = []
        for g in self.groups:
            if g.kind is LayerKind.MAMBA:
                # The recurrent state stays in the model dtype even with FP8 KV.
                layers, state = g.layers, self.mamba_state_bytes()
                if state_page_multiple:
                    step = state_page_multiple
                    layers, state = 1, -(-layers * state // step) * step
                specs.append(KVSpec(g.name, g.kind, layers, state,
                                    checkpoint_every=checkpoint_every))
            else:
                specs.append(KVSpec(g.name, g.kind, g.layers,
                                    self.kv_bytes_per_token(kv_dtype_bytes),
                                    window=g.window, chunk=g.chunk))
        return specs

    # --------------------------------------------------------------- FLOPs

    def linear_flops_per_token(self) -> float:
        """Matmul FLOPs of one token through every layer (active experts only)."""
        return 2.0 * self.linear_params(active=True)

    def lm_head_flops(self) -> float:
        """Logits of one sampled token."""
        return 2.0 * self.hidden * self.vocab

    def mamba_scan_flops_per_token(self) -> float:
        """Selective scan + conv of one token in one Mamba layer (elementwise work).

        h = exp(dt*A) h + dt*B x, y = C h: about 7 FLOPs per (channel, state);
        the causal conv is 2 FLOPs per (channel, tap).
        """
        m = self.mamba
        if m is None:
            return 0.0
        d_inner = m.expand * self.hidden
        return 7.0 * d_inner * m.d_state + 2.0 * d_inner * m.d_conv

    def encoder_flops_per_image_token(self) -> float:
        """Vision tower: ~2 FLOPs per parameter per patch token."""
        return 2.0 * self.extra_params() if self.image_tokens_per_tile else 0.0


# ---------------------------------------------------------------- registry


def _interleave(pattern_len: int, layers: int) -> tuple[int, int]:
    """(full, local) layer counts when every `pattern_len`-th layer is full."""
    full = layers // pattern_len
    return full, layers - full


def _llama(name: str, source: str, hidden: int, layers: int, heads: int, inter: int,
           params: float, fp8_gpus: Iterable[str] = ()) -> Model:
    return Model(
        name, source, hidden=hidden, heads=heads, kv_heads=8, head_dim=128,
        intermediate=inter, vocab=128256, max_len=131072, params=params,
        groups=(Group("full", LayerKind.FULL, layers),), dense_ffn_layers=layers,
        fp8_gpus=frozenset(fp8_gpus),
    )


def _build() -> dict[str, Model]:
    models: list[Model] = []
    models.append(_llama(
        "llama-3.1-8b", "https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
        hidden=4096, layers=32, heads=32, inter=14336, params=8.03e9,
    ))
    models.append(_llama(
        "llama-3.1-70b", "https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json",
        hidden=8192, layers=80, heads=64, inter=28672, params=70.55e9, fp8_gpus=("h100",),
    ))
    # Ministral-8B-Instruct-2410: config.json gives the shapes and window 32768;
    # params.json (Mistral format, 128k context) gives the interleaved pattern
    # sliding_window = [131072, 32768, 32768, 32768] * 9: one full layer, then
    # three sliding ones (also stated in transformers' Ministral docs).
    full, local = _interleave(4, 36)
    models.append(Model(
        "ministral-8b",
        "https://huggingface.co/mistralai/Ministral-8B-Instruct-2410 (config.json, params.json)",
        hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=12288, vocab=131072,
        max_len=131072, params=8.02e9,
        groups=(Group("full", LayerKind.FULL, full),
                Group("sliding", LayerKind.SLIDING, local, window=32768)),
        dense_ffn_layers=36, fp8_gpus=frozenset({"l4"}),
    ))
    # Gemma 2 alternates sliding (window 4096) and global layers 1:1.
    models.append(Model(
        "gemma-2-27b", "https://huggingface.co/google/gemma-2-27b/blob/main/config.json",
        hidden=4608, heads=32, kv_heads=16, head_dim=128, intermediate=36864, vocab=256000,
        max_len=8192, params=27.2e9,
        groups=(Group("full", LayerKind.FULL, 23),
                Group("sliding", LayerKind.SLIDING, 23, window=4096)),
        dense_ffn_layers=46, tied_embeddings=True,
    ))
    models.append(Model(
        "gemma-2-9b", "https://huggingface.co/google/gemma-2-9b/blob/main/config.json",
        hidden=3584, heads=16, kv_heads=8, head_dim=256, intermediate=14336, vocab=256000,
        max_len=8192, params=9.24e9,
        groups=(Group("full", LayerKind.FULL, 21),
                Group("sliding", LayerKind.SLIDING, 21, window=4096)),
        dense_ffn_layers=42, tied_embeddings=True,
    ))
    # Gemma 3: sliding_window_pattern 6 = five local layers (window 1024), one global.
    full, local = _interleave(6, 48)
    models.append(Model(
        "gemma-3-12b", "https://huggingface.co/google/gemma-3-12b-it/blob/main/config.json",
        hidden=3840, heads=16, kv_heads=8, head_dim=256, intermediate=15360, vocab=262208,
        max_len=131072, params=12.19e9,  # includes the 0.42B SigLIP vision tower
        groups=(Group("full", LayerKind.FULL, full),
                Group("sliding", LayerKind.SLIDING, local, window=1024)),
        dense_ffn_layers=48, tied_embeddings=True,
    ))
    full, local = _interleave(6, 34)
    models.append(Model(
        "gemma-3-4b", "https://huggingface.co/google/gemma-3-4b-it/blob/main/config.json",
        hidden=2560, heads=8, kv_heads=4, head_dim=256, intermediate=10240, vocab=262208,
        max_len=131072, params=4.30e9,
        groups=(Group("full", LayerKind.FULL, full),
                Group("sliding", LayerKind.SLIDING, local, window=1024)),
        dense_ffn_layers=34, tied_embeddings=True,
    ))
    # Llama 3.2 11B Vision: 40 text layers, cross-attention at
    # cross_attention_layers = [3, 8, 13, 18, 23, 28, 33, 38]; the vision tower
    # (image_size 560, patch 14) yields 40*40 + 1 = 1601 tokens per tile, <= 4 tiles.
    models.append(Model(
        "llama-3.2-11b-vision",
        "https://huggingface.co/meta-llama/Llama-3.2-11B-Vision/blob/main/config.json",
        hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256,
        max_len=131072, params=10.67e9,
        groups=(Group("self", LayerKind.FULL, 32), Group("cross", LayerKind.CROSS, 8)),
        dense_ffn_layers=40, fp8_gpus=frozenset({"l4"}), image_tokens_per_tile=1601,
    ))
    # Jamba 1.5 Mini: attn_layer_period 8 / offset 4 -> 4 attention + 28 Mamba
    # layers; expert_layer_period 2 / offset 1 -> 16 MoE layers (16 experts, top 2).
    models.append(Model(
        "jamba-1.5-mini", "https://huggingface.co/ai21labs/AI21-Jamba-1.5-Mini/blob/main/config.json",
        hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=65536,
        max_len=262144, params=51.6e9,
        groups=(Group("full", LayerKind.FULL, 4), Group("mamba", LayerKind.MAMBA, 28)),
        dense_ffn_layers=16, moe=MoE(layers=16, experts=16, top_k=2, intermediate=14336),
        mamba=Mamba(d_state=16, d_conv=4, expand=2, dt_rank=math.ceil(4096 / 16)),
        fp8_gpus=frozenset({"h100"}),
    ))
    # Bamba 9B: attn_layer_indices [9, 18, 27] -> 3 attention + 29 Mamba-2 layers
    # (mamba_n_heads 128 x mamba_d_head 64 = expand 2 x hidden, d_state 128, n_groups 1,
    # d_conv 4). The config sets no max_position_embeddings, so transformers' default
    # 262144 applies (the model card's table says it was trained at 4096).
    models.append(Model(
        "bamba-9b", "https://huggingface.co/ibm-fms/Bamba-9B/blob/main/config.json",
        hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256,
        max_len=262144, params=9.78e9,
        groups=(Group("full", LayerKind.FULL, 3), Group("mamba", LayerKind.MAMBA, 29)),
        dense_ffn_layers=32,
        mamba=Mamba(d_state=128, d_conv=4, expand=2, dt_rank=0, heads=128, groups=1),
    ))
    # Llama 4 Scout: attention_chunk_size 8192 on 3 of 4 layers, every 4th
    # layer global with NoPE (no_rope_layer_interval 4); every layer MoE
    # (interleave_moe_layer_step 1): 16 experts, top 1, plus one shared expert.
    full, local = _interleave(4, 48)
    models.append(Model(
        "llama-4-scout",
        "https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E/blob/main/config.json",
        hidden=5120, heads=40, kv_heads=8, head_dim=128, intermediate=16384, vocab=202048,
        max_len=10485760, params=108.6e9,
        groups=(Group("full", LayerKind.FULL, full),
                Group("chunked", LayerKind.CHUNKED, local, chunk=8192)),
        dense_ffn_layers=0, moe=MoE(layers=48, experts=16, top_k=1, intermediate=8192, shared=1),
    ))
    return {m.name: m for m in models}


MODELS: dict[str, Model] = _build()


def get_model(name: str) -> Model:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}") from None
