"""Model families (one module each, found through models/registry.py) and checkpoint
loading."""

from kvserve.models.attention_ref import ContiguousAttention, greedy_generate
from kvserve.models.base import AttentionBackend, CausalLM, KVLayer, ModelConfig
from kvserve.models.chat_template import GEMMA_CHAT_TEMPLATE, render_chat
from kvserve.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from kvserve.models.loader import (
    build_model,
    default_cache_dir,
    default_gguf_path,
    load_model,
    load_model_files,
)

__all__ = [
    "GEMMA_CHAT_TEMPLATE",
    "AttentionBackend",
    "CausalLM",
    "ContiguousAttention",
    "Gemma3Config",
    "Gemma3ForCausalLM",
    "KVLayer",
    "ModelConfig",
    "build_model",
    "default_cache_dir",
    "default_gguf_path",
    "greedy_generate",
    "load_model",
    "load_model_files",
    "render_chat",
]
