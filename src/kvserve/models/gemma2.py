"""Gemma 2 decoder: Gemma 3's decoder (models/gemma3.py) without q/k norms.

Sliding-window and global layers alternate and share one RoPE base; attention scores
are soft-capped (tanh(s / cap) * cap, before the mask) and so are the final logits;
q.k is scaled by query_pre_attn_scalar^-0.5. The paged backend serves softcapped
layers through torch ops (models/paged_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.models.chat_template import GEMMA_CHAT_TEMPLATE
from kvserve.models.checkpoint import hf_rope_scaling
from kvserve.models.gemma3 import (
    Gemma3Config,
    Gemma3ForCausalLM,
    default_layer_types,
    hf_gemma_fields,
)


@dataclass
class Gemma2Config(Gemma3Config):
    """Architecture of a Gemma 2 model (the defaults are HF's)."""

    rope_theta: float = 10_000.0  # every layer's; rope_local_base_freq follows it
    sliding_window: int = 4096
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = 30.0
    attn_logit_softcapping: float | None = 50.0
    qk_norm: bool = False
    family: str = "gemma2"

    def __post_init__(self) -> None:
        if not self.layer_types:  # sliding first, then alternating
            self.layer_types = default_layer_types(self.num_hidden_layers, pattern=2)
        self.rope_local_base_freq = self.rope_theta
        super().__post_init__()

    @property
    def local_rope_scaling(self) -> dict[str, Any] | None:
        return self.rope_scaling  # one RoPE for every layer


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 over a flattened varlen batch (Gemma 3's forward, driven by the config)."""

    config: Gemma2Config


CHAT_TEMPLATE = GEMMA_CHAT_TEMPLATE


def config_from_hf(hf: Any) -> Gemma2Config:
    """Gemma2Config from transformers' ``gemma2`` config."""
    if getattr(hf, "use_bidirectional_attention", None):
        raise NotImplementedError("bidirectional Gemma 2 (an encoder) is not served")
    rope = hf.rope_parameters or {}
    return Gemma2Config(
        **hf_gemma_fields(hf),
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        rope_scaling=hf_rope_scaling(rope),
    )


Config = Gemma2Config
Model = Gemma2ForCausalLM
