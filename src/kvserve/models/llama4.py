"""Llama 4 text decoder (Scout, Maverick): chunked local attention and mixture of experts.

Most layers use RoPE and attend within their chunk only: a query at position p sees keys
from p // chunk * chunk (the memory core's CHUNKED rule: pages before the chunk go back to
the pool). Every `no_rope_layer_interval`-th layer (NoPE) attends globally without RoPE
and scales its queries by a temperature that grows with the position (attention
temperature tuning). RoPE layers L2-normalize q and k (an RMS norm without weight).
Feed-forward blocks are dense SwiGLUs or, on `moe_layers`, a top-k router with sigmoid
scores over experts that take their input pre-scaled by the score, plus a shared expert.

HF rotates adjacent channel pairs (a complex multiplication); `adapt_state_dict` reorders
the q/k rows of RoPE layers so the shared rotate-half RoPE computes the same rotation
(`layers.pairs_to_halves`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from kvserve.memory.spec import LayerKind
from kvserve.models.base import AttentionBackend, CausalLM, DecoderStack, KVLayer, ModelConfig
from kvserve.models.checkpoint import hf_common, hf_rope_scaling
from kvserve.models.layers import (
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    act_mul,
    add_then_norm,
    apply_rope,
    fuse_projections,
    norm_rope,
    pairs_to_halves,
)

CHUNKED = "chunked_attention"
FULL = "full_attention"


@dataclass
class Llama4Config(ModelConfig):
    """Architecture of a Llama 4 text model (the defaults are HF's). `intermediate_size` is
    an expert's (and the shared expert's), `intermediate_size_mlp` a dense layer's."""

    intermediate_size_mlp: int = 16_384
    rope_theta: float = 500_000.0
    rope_scaling: dict[str, Any] | None = None
    attention_chunk_size: int | None = 8192
    layer_types: list[str] = field(default_factory=list)  # chunked_attention / full_attention
    no_rope_layers: list[int] = field(default_factory=list)  # 1: RoPE, 0: NoPE
    no_rope_layer_interval: int = 4
    moe_layers: list[int] | None = None
    interleave_moe_layer_step: int = 1
    num_local_experts: int = 16
    num_experts_per_tok: int = 1
    use_qk_norm: bool = True  # on RoPE layers
    attn_temperature_tuning: bool = True  # on NoPE layers
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    family: str = "llama4"

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_hidden_layers
        if not self.no_rope_layers:  # HF's default: every interval-th layer is NoPE
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0)
                                   for i in range(n)]
        self.no_rope_layers = [int(r) for r in self.no_rope_layers[:n]]
        if self.moe_layers is None:
            step = self.interleave_moe_layer_step
            self.moe_layers = list(range(step - 1, n, step))
        if not self.layer_types:
            self.layer_types = [CHUNKED if r else FULL for r in self.no_rope_layers]
        if len(self.layer_types) != n or len(self.no_rope_layers) != n:
            raise ValueError("layer_types and no_rope_layers need one entry per layer")
        if any(t not in (CHUNKED, FULL) for t in self.layer_types):
            raise ValueError(f"unknown layer type in {self.layer_types}")
        if CHUNKED in self.layer_types and not self.attention_chunk_size:
            raise ValueError("chunked_attention layers need an attention_chunk_size")
        act_mul(self.hidden_act)  # refuses an activation it does not have
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "linear", "llama3"):
            raise NotImplementedError(f"rope scaling {rope_type!r} is not supported")

    def uses_rope(self, layer_idx: int) -> bool:
        return bool(self.no_rope_layers[layer_idx])

    def kv_layers(self) -> list[KVLayer]:
        kv = (self.num_key_value_heads, self.head_dim, self.head_dim**-0.5)
        return [KVLayer(LayerKind.CHUNKED, *kv, chunk=self.attention_chunk_size or 0)
                if t == CHUNKED else KVLayer(LayerKind.FULL, *kv) for t in self.layer_types]


class _Step(NamedTuple):
    """What every layer of one forward shares: RoPE's cos/sin, the NoPE layers' query
    temperature per token [n, 1, 1] (float32) and the qk-norm's unit weight [head_dim]."""

    cos_sin: tuple[torch.Tensor, ...]
    temperature: torch.Tensor | None
    unit: torch.Tensor


class Llama4Attention(nn.Module):
    def __init__(self, config: Llama4Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        D = self.head_dim = config.head_dim
        self.use_rope = config.uses_rope(layer_idx)
        self.qk_norm = config.use_qk_norm and self.use_rope
        self.tuned = config.attn_temperature_tuning and not self.use_rope
        self.eps = config.rms_norm_eps
        # q, k and v in one matmul; adapt_state_dict fuses (and reorders) the checkpoint's.
        self.qkv_proj = Linear(config.hidden_size, (self.n_heads + 2 * self.n_kv_heads) * D,
                               bias=config.attention_bias)
        self.o_proj = Linear(self.n_heads * D, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, step: _Step, attn: AttentionBackend) -> torch.Tensor:
        n, D = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        qk = qkv[:, : (self.n_heads + self.n_kv_heads) * D].view(n, -1, D)
        if self.qk_norm:
            # HF rotates, then normalizes; a rotation keeps a head's RMS, so one pass
            # normalizes and rotates (equal up to rounding).
            qk = norm_rope(qk, step.unit, self.eps, step.cos_sin, in_place=True)
        elif self.use_rope:
            qk = apply_rope(qk, *step.cos_sin)
        q, k = qk.split((self.n_heads, self.n_kv_heads), dim=1)
        if self.tuned:  # in float32, rounded back, as HF does
            q = (q * step.temperature).to(q.dtype)
        v = qkv[:, (self.n_heads + self.n_kv_heads) * D:].view(n, self.n_kv_heads, D)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(n, self.n_heads * D))


class Llama4Experts(nn.Module):
    """The routed experts' weights as HF stores them: gate_up [E, hidden, 2 I] ([gate | up]
    columns) and down [E, I, hidden], applied as x @ w."""

    def __init__(self, experts: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * intermediate))
        self.down_proj = nn.Parameter(torch.empty(experts, intermediate, hidden))
        self.act = act_mul(act)

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.act(x @ self.gate_up_proj[e]) @ self.down_proj[e]


class Llama4MoE(nn.Module):
    """shared_expert(x) + sum over the top-k experts e of expert_e(x * sigmoid(logit_e))."""

    def __init__(self, config: Llama4Config) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.top_k = config.num_experts_per_tok
        # A plain nn.Linear: quantizing the router could flip which experts a token takes.
        self.router = nn.Linear(hidden, config.num_local_experts, bias=False)
        self.experts = Llama4Experts(config.num_local_experts, hidden, inter, config.hidden_act)
        self.shared_expert = GatedMLP(hidden, inter, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, chosen = self.router(x).topk(self.top_k, dim=1)
        weight = torch.sigmoid(top.float()).to(x.dtype)
        out = self.shared_expert(x)
        # Only the tokens an expert was chosen for go through it (HF runs every token
        # through every expert, the others scaled by 0); summed in expert order, as HF.
        routed = torch.zeros_like(out)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            routed.index_add_(0, rows, self.experts(e, x[rows] * weight[rows, slot, None]))
        return out.add_(routed)


class Llama4DecoderLayer(nn.Module):
    def __init__(self, config: Llama4Config, layer_idx: int) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.self_attn = Llama4Attention(config, layer_idx)
        self.feed_forward = (Llama4MoE(config) if layer_idx in config.moe_layers
                             else GatedMLP(hidden, config.intermediate_size_mlp,
                                           config.hidden_act))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, h: torch.Tensor, step: _Step, attn: AttentionBackend,
                next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream, h: input_layernorm(x). Returns the new stream and
        next_norm of it (the next layer's input norm, or the final norm)."""
        x, h = add_then_norm(x, self.self_attn(h, step, attn), self.post_attention_layernorm)
        return add_then_norm(x, self.feed_forward(h), next_norm)


FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "feed_forward.gate_up_proj": ("feed_forward.gate_proj", "feed_forward.up_proj"),
    "feed_forward.shared_expert.gate_up_proj": ("feed_forward.shared_expert.gate_proj",
                                                "feed_forward.shared_expert.up_proj"),
}


class Llama4ForCausalLM(CausalLM):
    config: Llama4Config

    def __init__(self, config: Llama4Config) -> None:
        super().__init__(config)
        self.model = DecoderStack(config, Llama4DecoderLayer)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        """NoPE layers' query scale per token [n, 1, 1]: 1 + attn_scale *
        log(1 + floor((p + 1) / floor_scale)), float32."""
        c = self.config
        if not c.attn_temperature_tuning or all(c.no_rope_layers):
            return None
        steps = torch.floor((positions.float() + 1.0) / c.floor_scale)
        return (torch.log1p(steps) * c.attn_scale + 1.0)[:, None, None]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        unit = torch.ones(self.config.head_dim, device=x.device)
        step = _Step(self.rope.cos_sin(positions, x.dtype), self.temperature(positions), unit)
        return self.model.pre_norm(x, step, attn)

    def adapt_state_dict(self, state_dict):  # noqa: ANN001, ANN201 - see CausalLM
        c, out = self.config, dict(state_dict)
        for i in range(c.num_hidden_layers):
            if not c.uses_rope(i):
                continue
            for proj, heads in (("q_proj", c.num_attention_heads),
                                ("k_proj", c.num_key_value_heads)):
                for kind in ("weight", "bias"):
                    name = f"model.layers.{i}.self_attn.{proj}.{kind}"
                    if name in out:
                        out[name] = pairs_to_halves(out[name], heads)
        return fuse_projections(out, FUSED)


# --------------------------------------------------------------------------- checkpoints


def config_from_hf(hf: Any) -> Llama4Config:
    """Llama4Config from transformers' ``llama4_text`` config (or the text part of
    ``llama4``); HF has already resolved its defaults (no_rope_layers, moe_layers,
    layer_types)."""
    text = getattr(hf, "text_config", None) or hf
    rope = text.rope_parameters or {}
    n = text.num_hidden_layers
    return Llama4Config(
        **hf_common(text),
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        intermediate_size_mlp=text.intermediate_size_mlp,
        rope_theta=float(rope.get("rope_theta", 500_000.0)),
        rope_scaling=hf_rope_scaling(rope),
        attention_chunk_size=text.attention_chunk_size,
        layer_types=list(text.layer_types),
        no_rope_layers=list(text.no_rope_layers)[:n],
        moe_layers=list(text.moe_layers),
        num_local_experts=text.num_local_experts,
        num_experts_per_tok=text.num_experts_per_tok,
        use_qk_norm=bool(text.use_qk_norm),
        attn_temperature_tuning=bool(text.attn_temperature_tuning),
        floor_scale=float(text.floor_scale),
        attn_scale=float(text.attn_scale),
        attention_bias=bool(getattr(text, "attention_bias", False)),
        hidden_act=text.hidden_act,
    )


Config = Llama4Config
Model = Llama4ForCausalLM
