"""Gemma 3 text decoder (the packaged default model), and the pieces Gemma 2 shares.

Interleaves sliding-window layers (local RoPE base) with global ones; RMSNorms are
zero-centred (1 + w) and sandwich both sub-blocks; q and k are RMS-normed per head.
Gemma 2 (models/gemma2.py) is this decoder without the q/k norms, with one RoPE base
and with attention-logit softcapping: the config's `qk_norm`, `local_rope_scaling`
and `attn_logit_softcapping` say which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvserve.memory.spec import LayerKind
from kvserve.models.base import AttentionBackend, CausalLM, DecoderStack, KVLayer, ModelConfig
from kvserve.models.chat_template import GEMMA_CHAT_TEMPLATE
from kvserve.models.checkpoint import gguf_common, gguf_rope_scaling, hf_common, hf_rope_scaling
from kvserve.models.fused_layers import FusedLayers
from kvserve.models.layers import (
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    add_norm,
    fuse_projections,
)

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass
class Gemma3Config(ModelConfig):
    """Architecture of a Gemma 3 text model, independent of the checkpoint format."""

    rope_theta: float = 1_000_000.0  # full-attention layers
    rope_local_base_freq: float = 10_000.0  # sliding-window layers
    # Scaling of the full-attention RoPE only, as Gemma 3 does; None or {"rope_type": "linear",
    # "factor": f}.
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int = 512
    layer_types: list[str] = field(default_factory=list)
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    qk_norm: bool = True  # per-head RMSNorm of q and k before RoPE (Gemma 2 has none)
    attention_bias: bool = False
    family: str = "gemma3"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.eos_token_ids:
            self.eos_token_ids = [1]
        if not self.layer_types:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types must have one entry per layer")
        if any(t not in (SLIDING, FULL) for t in self.layer_types):
            raise ValueError(f"unknown layer type in {self.layer_types}")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise NotImplementedError(f"activation {self.hidden_activation!r} is not supported")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "linear"):
            raise NotImplementedError(f"rope scaling {rope_type!r} is not supported")

    def is_sliding(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == SLIDING

    @property
    def attn_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    @property
    def local_rope_scaling(self) -> dict[str, Any] | None:
        """The sliding layers' RoPE scaling: none in Gemma 3 (it scales the global RoPE)."""
        return None

    def kv_layers(self) -> list[KVLayer]:
        kv = (self.num_key_value_heads, self.head_dim, self.attn_scale)
        cap = self.attn_logit_softcapping
        full = KVLayer(LayerKind.FULL, *kv, softcap=cap)
        sliding = KVLayer(LayerKind.SLIDING, *kv, window=self.sliding_window, softcap=cap)
        return [sliding if self.is_sliding(i) else full for i in range(self.num_hidden_layers)]


def default_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    """Gemma 3 interleaves (pattern - 1) sliding-window layers with one global layer."""
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, layer_idx: int) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = SelfAttention(
            layer_idx, hidden, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, eps, config.attention_bias, config.attention_bias,
            qk_norm=1.0 if config.qk_norm else None)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_activation)
        self.input_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset=1.0)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, ...], attn: AttentionBackend
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos_sin, attn)
        x, h = add_norm(x, h, self.post_attention_layernorm, self.pre_feedforward_layernorm)
        x, _ = add_norm(x, self.mlp(h), self.post_feedforward_layernorm, None)
        return x


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text model over a flattened varlen batch."""

    config: Gemma3Config

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__(config)
        self.model = DecoderStack(config, Gemma3DecoderLayer, norm_offset=1.0)
        self.final_logit_softcapping = config.final_logit_softcapping
        self.rope_local = RotaryEmbedding(config.head_dim, config.rope_local_base_freq,
                                          config.local_rope_scaling)
        same = (config.rope_local_base_freq, config.local_rope_scaling) == \
            (config.rope_theta, config.rope_scaling)
        self.rope_global = self.rope_local if same else RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling)
        self.embed_scale = math.sqrt(config.hidden_size)
        self.fused_layers = FusedLayers()  # a step's layers in one kernel call, where it can

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # Scale in the weight dtype, as HF does (sqrt(640) rounds differently in bf16).
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)
        local = self.rope_local.cos_sin(positions, x.dtype)
        glob = (local if self.rope_global is self.rope_local
                else self.rope_global.cos_sin(positions, x.dtype))
        out = self.fused_layers(self, x, attn, local, glob)
        if out is not None:
            return out
        for i, layer in enumerate(self.model.layers):
            x = layer(x, local if self.config.is_sliding(i) else glob, attn)
        return self.model.norm(x)

    def adapt_state_dict(self, state_dict):  # noqa: ANN001, ANN201 - see CausalLM
        return fuse_projections(state_dict)


# --------------------------------------------------------------------------- checkpoints

CHAT_TEMPLATE = GEMMA_CHAT_TEMPLATE
GGUF_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def gguf_tensor(name: str, tensor: torch.Tensor, config: Gemma3Config,
                arch: str) -> torch.Tensor:
    """llama.cpp's Gemma converter stores RMSNorm weights as (1 + w) because ggml multiplies
    by the weight directly; ours (like HF's) applies (1 + w): undo the shift. (Gemma's RoPE
    is Neox-style in llama.cpp too, so unlike Llama no q/k rows to unpermute.)"""
    return tensor - 1.0 if name.endswith("norm.weight") else tensor


def config_from_gguf(meta: Any, tensor_shapes: dict[str, list[int]]) -> Gemma3Config:
    """Gemma3Config from GGUF metadata, filling what llama.cpp leaves out with its own rules."""
    from gguf import Keys

    common = gguf_common(meta, tensor_shapes)
    layers, hidden = common["num_hidden_layers"], common["hidden_size"]
    heads = common["num_attention_heads"]
    head_dim = int(meta.get(Keys.Attention.KEY_LENGTH, hidden // heads))
    return Gemma3Config(
        **common,
        head_dim=head_dim,
        rope_theta=float(meta.get(Keys.Rope.FREQ_BASE, 1_000_000.0)),
        # llama.cpp hard-codes 10k for Gemma 3's local layers unless the file says otherwise.
        rope_local_base_freq=float(meta.get(Keys.Rope.FREQ_BASE_SWA, 10_000.0)),
        rope_scaling=gguf_rope_scaling(meta),
        sliding_window=int(meta.require(Keys.Attention.SLIDING_WINDOW)),
        layer_types=_gguf_layer_types(meta, layers),
        query_pre_attn_scalar=_gguf_query_scalar(layers, hidden, heads, head_dim),
        final_logit_softcapping=meta.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
        attn_logit_softcapping=meta.get(Keys.LLM.ATTN_LOGIT_SOFTCAPPING),
    )


def _gguf_layer_types(meta: Any, layers: int) -> list[str]:
    from gguf import Keys

    pattern = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # newer converters: one bool per layer, True = sliding
        return [SLIDING if bool(p) else FULL for p in pattern]
    # Otherwise llama.cpp's fixed Gemma 3 rule: every 6th layer is global.
    return default_layer_types(layers, int(pattern) if pattern else 6)


def _gguf_query_scalar(layers: int, hidden: int, heads: int, head_dim: int) -> float:
    # GGUF has no key for it; llama.cpp uses hidden/heads for the 62-layer 27B model and
    # head_dim for every other Gemma 3 size, which matches the released HF configs.
    return float(hidden // heads if layers == 62 else head_dim)


def config_from_hf(hf: Any) -> Gemma3Config:
    """Gemma3Config from transformers' config (``gemma3_text``, or the text part of
    ``gemma3``); its old/new RoPE layouts resolve into ``rope_parameters``."""
    text = getattr(hf, "text_config", None) or hf
    rope = text.rope_parameters
    fields = {**hf_gemma_fields(text),
              "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", True))}
    return Gemma3Config(
        **fields,
        rope_theta=float(rope[FULL]["rope_theta"]),
        rope_local_base_freq=float(rope[SLIDING]["rope_theta"]),
        rope_scaling=hf_rope_scaling(rope[FULL]),
    )


def hf_gemma_fields(text: Any) -> dict[str, Any]:
    """The fields Gemma 2 and Gemma 3 read alike from a transformers text config (all but
    RoPE, which Gemma 3 sets per layer type)."""
    return dict(
        **hf_common(text),
        head_dim=text.head_dim,
        sliding_window=text.sliding_window,
        layer_types=list(text.layer_types),
        query_pre_attn_scalar=float(text.query_pre_attn_scalar),
        final_logit_softcapping=text.final_logit_softcapping,
        attn_logit_softcapping=text.attn_logit_softcapping,
        hidden_activation=text.hidden_activation,
        attention_bias=bool(getattr(text, "attention_bias", False)),
    )


Config = Gemma3Config
Model = Gemma3ForCausalLM
