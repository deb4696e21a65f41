"""Bamba (IBM): a hybrid of Mamba-2 layers and full-attention layers.

Pre-norm decoder layers: input_layernorm, then a Mamba-2 mixer (models/mamba2.py) or
GQA attention with RoPE on the first half of each head, a residual add, then
pre_ff_layernorm and a SwiGLU MLP. Attention KV lives in the pool's FULL pages; each
Mamba layer's state (conv inputs and SSM state) in MAMBA pages, one live state per
sequence plus a cached checkpoint every two scan chunks (512 tokens at the usual
chunk of 256), which prefix hits restore.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvserve.memory.spec import LayerKind
from kvserve.models.base import AttentionBackend, CausalLM, DecoderStack, KVLayer, ModelConfig
from kvserve.models.checkpoint import hf_common, hf_rope_scaling
from kvserve.models.layers import (
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    add_then_norm,
    fuse_projections,
)
from kvserve.models.mamba2 import Mamba2Mixer

MAMBA = "linear_attention"
ATTENTION = "full_attention"
# Checkpoints every this many scan chunks: a checkpoint lands on a chunk boundary, and
# 2 x 256 is the memory core's default of 512 tokens.
CHUNKS_PER_CHECKPOINT = 2


@dataclass
class BambaConfig(ModelConfig):
    layer_types: list[str] = field(default_factory=list)  # MAMBA or ATTENTION per layer
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 0.5
    attention_bias: bool = False
    hidden_act: str = "silu"
    mamba_n_heads: int = 128
    mamba_d_head: int = 64
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    family: str = "bamba"

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types must have one entry per layer")
        if any(t not in (MAMBA, ATTENTION) for t in self.layer_types):
            raise ValueError(f"unknown layer type in {self.layer_types}")
        if self.hidden_act != "silu":
            raise NotImplementedError(f"activation {self.hidden_act!r} is not supported")
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ValueError("mamba_n_heads must be a multiple of mamba_n_groups")
        self.time_step_limit = tuple(float(t) for t in self.time_step_limit)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def checkpoint_every(self) -> int:
        return CHUNKS_PER_CHECKPOINT * self.mamba_chunk_size

    def mamba_state(self) -> tuple[tuple[int, ...], ...]:
        conv_dim = self.mamba_n_heads * self.mamba_d_head + 2 * self.mamba_n_groups * \
            self.mamba_d_state
        return ((conv_dim, self.mamba_d_conv - 1),
                (self.mamba_n_heads, self.mamba_d_head, self.mamba_d_state))

    def kv_layers(self) -> list[KVLayer]:
        attn = KVLayer(LayerKind.FULL, self.num_key_value_heads, self.head_dim,
                       self.head_dim**-0.5)
        mamba = KVLayer(LayerKind.MAMBA, state=self.mamba_state(),
                        checkpoint_every=self.checkpoint_every)
        return [mamba if t == MAMBA else attn for t in self.layer_types]


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: BambaConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_mamba = config.layer_types[layer_idx] == MAMBA
        if self.is_mamba:
            self.mamba = Mamba2Mixer(
                layer_idx, hidden, config.mamba_n_heads, config.mamba_d_head,
                config.mamba_n_groups, config.mamba_d_state, config.mamba_d_conv,
                config.mamba_chunk_size, eps, config.mamba_conv_bias,
                config.mamba_proj_bias, config.time_step_limit)
        else:
            self.self_attn = SelfAttention(
                layer_idx, hidden, config.num_attention_heads, config.num_key_value_heads,
                config.head_dim, eps, config.attention_bias, config.attention_bias)
        self.feed_forward = GatedMLP(hidden, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos_sin: tuple[torch.Tensor, ...],
                attn: AttentionBackend, next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, h: input_layernorm(x). Returns the new stream and
        next_norm of it (DecoderStack.pre_norm)."""
        h = self.mamba(h, attn) if self.is_mamba else self.self_attn(h, cos_sin, attn)
        x, h = add_then_norm(x, h, self.pre_ff_layernorm)
        return add_then_norm(x, self.feed_forward(h), next_norm)


class BambaForCausalLM(CausalLM):
    config: BambaConfig

    def __init__(self, config: BambaConfig) -> None:
        super().__init__(config)
        self.model = DecoderStack(config, BambaDecoderLayer)
        self.rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        return self.model.pre_norm(x, self.rope.cos_sin(positions, x.dtype), attn)

    def adapt_state_dict(self, state_dict):  # noqa: ANN001, ANN201 - see CausalLM
        # HF's Bamba calls the final norm final_layernorm; DecoderStack calls it norm.
        state_dict = {k.replace("model.final_layernorm.", "model.norm."): v
                      for k, v in state_dict.items()}
        return fuse_projections(state_dict, {
            "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "feed_forward.gate_up_proj": ("feed_forward.gate_proj", "feed_forward.up_proj")})


def config_from_hf(hf: Any) -> BambaConfig:
    """BambaConfig from transformers' (`bamba`)."""
    if getattr(hf, "mlp_bias", False):
        raise NotImplementedError("Bamba with mlp_bias is not supported")
    rope = hf.rope_parameters or {}
    return BambaConfig(
        **hf_common(hf),
        head_dim=hf.hidden_size // hf.num_attention_heads,
        layer_types=list(hf.layers_block_type),
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        rope_scaling=hf_rope_scaling(rope),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.5)),
        attention_bias=bool(hf.attention_bias),
        hidden_act=hf.hidden_act,
        mamba_n_heads=hf.mamba_n_heads,
        mamba_d_head=hf.mamba_d_head,
        mamba_n_groups=hf.mamba_n_groups,
        mamba_d_state=hf.mamba_d_state,
        mamba_d_conv=hf.mamba_d_conv,
        mamba_chunk_size=hf.mamba_chunk_size,
        mamba_conv_bias=bool(hf.mamba_conv_bias),
        mamba_proj_bias=bool(hf.mamba_proj_bias),
        time_step_limit=tuple(hf.time_step_limit or (0.0, float("inf"))),
    )


Config = BambaConfig
Model = BambaForCausalLM
