"""Llama-style decoders: Llama 2/3, SmolLM2, Mistral, Ministral, Qwen2 and Qwen3.

One pre-norm block: x + attn(norm(x)), then x + SwiGLU(norm(x)); grouped-query attention
with RoPE (rotate-half, as HF computes it), optional q/k/v biases (Qwen2), optional
per-head q/k RMSNorm before RoPE (Qwen3), and per layer either full attention or a
sliding window (Mistral: every layer; Qwen2/Qwen3/Ministral: `layer_types`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvserve.memory.spec import LayerKind
from kvserve.models.base import AttentionBackend, CausalLM, DecoderStack, KVLayer, ModelConfig
from kvserve.models.checkpoint import gguf_common, gguf_rope_scaling, hf_common, hf_rope_scaling
from kvserve.models.fused_layers import FusedLayers
from kvserve.models.layers import (
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    add_then_norm,
    fuse_projections,
    pairs_to_halves,
)

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass
class LlamaConfig(ModelConfig):
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    hidden_act: str = "silu"
    family: str = "llama"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.layer_types:
            kind = SLIDING if self.sliding_window else FULL
            self.layer_types = [kind] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types must have one entry per layer")
        if any(t not in (SLIDING, FULL) for t in self.layer_types):
            raise ValueError(f"unknown layer type in {self.layer_types}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")

    def kv_layers(self) -> list[KVLayer]:
        scale = self.head_dim**-0.5
        return [KVLayer(LayerKind.SLIDING, self.num_key_value_heads, self.head_dim, scale,
                        window=self.sliding_window or 0) if t == SLIDING
                else KVLayer(LayerKind.FULL, self.num_key_value_heads, self.head_dim, scale)
                for t in self.layer_types]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = SelfAttention(
            layer_idx, hidden, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, eps, config.qkv_bias, config.o_bias,
            qk_norm=0.0 if config.qk_norm else None)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act,
                            bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos_sin: tuple[torch.Tensor, ...],
                attn: AttentionBackend, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, h: input_layernorm(x). Returns the new stream and
        next_norm of it (the next layer's input norm, or the final norm)."""
        x, h = add_then_norm(x, self.self_attn(h, cos_sin, attn), self.post_attention_layernorm)
        return add_then_norm(x, self.mlp(h), next_norm)


class LlamaForCausalLM(CausalLM):
    config: LlamaConfig

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.model = DecoderStack(config, LlamaDecoderLayer)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.fused_layers = FusedLayers()  # a step's layers in one kernel call, where it can

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        out = self.fused_layers(self, x, attn, cos_sin, cos_sin)
        return out if out is not None else self.model.pre_norm(x, cos_sin, attn)

    def adapt_state_dict(self, state_dict):  # noqa: ANN001, ANN201 - see CausalLM
        return fuse_projections(state_dict)


# --------------------------------------------------------------------------- checkpoints


def config_from_hf(hf: Any) -> LlamaConfig:
    """LlamaConfig from transformers' Llama / Mistral / Ministral / Qwen2 / Qwen3 config."""
    rope = hf.rope_parameters or {}
    layer_types = list(getattr(hf, "layer_types", None) or [])
    window = getattr(hf, "sliding_window", None)
    if not layer_types:  # Mistral: a window, when set, on every layer
        layer_types = [SLIDING if window else FULL] * hf.num_hidden_layers
    qwen2 = hf.model_type == "qwen2"
    return LlamaConfig(
        **hf_common(hf),
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        rope_scaling=hf_rope_scaling(rope),
        sliding_window=window if SLIDING in layer_types else None,
        layer_types=layer_types,
        qkv_bias=qwen2 or bool(getattr(hf, "attention_bias", False)),
        o_bias=not qwen2 and bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=hf.model_type == "qwen3",
        hidden_act=hf.hidden_act,
    )


def config_from_gguf(meta: Any, tensor_shapes: dict[str, list[int]]) -> LlamaConfig:
    """LlamaConfig from a llama.cpp GGUF of architecture llama, qwen2 or qwen3."""
    from gguf import Keys

    common = gguf_common(meta, tensor_shapes)
    heads = common["num_attention_heads"]
    window = meta.get(Keys.Attention.SLIDING_WINDOW)
    return LlamaConfig(
        **common,
        head_dim=int(meta.get(Keys.Attention.KEY_LENGTH, common["hidden_size"] // heads)),
        rope_theta=float(meta.get(Keys.Rope.FREQ_BASE, 10_000.0)),
        rope_scaling=gguf_rope_scaling(meta),
        sliding_window=int(window) if window else None,
        qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
    )


def gguf_tensor(name: str, tensor: torch.Tensor, config: LlamaConfig,
                arch: str) -> torch.Tensor:
    """llama.cpp's Llama converter permutes q and k rows so its RoPE can rotate adjacent
    pairs; HF's rotates halves. Put the rows back (its Qwen converters do not permute:
    ggml runs those with Neox-style RoPE)."""
    if arch != "llama":
        return tensor
    if name.endswith("self_attn.q_proj.weight"):
        return pairs_to_halves(tensor, config.num_attention_heads)
    if name.endswith("self_attn.k_proj.weight"):
        return pairs_to_halves(tensor, config.num_key_value_heads)
    return tensor


Config = LlamaConfig
Model = LlamaForCausalLM
