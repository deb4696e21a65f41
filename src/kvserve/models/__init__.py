"""Model definitions and checkpoint loading (Gemma 3 text)."""

from kvserve.models.attention_ref import ContiguousAttention, greedy_generate
from kvserve.models.chat_template import GEMMA_CHAT_TEMPLATE, render_chat
from kvserve.models.gemma3 import AttentionBackend, Gemma3Config, Gemma3ForCausalLM
from kvserve.models.loader import default_cache_dir, default_gguf_path, load_model, load_model_files

__all__ = [
    "GEMMA_CHAT_TEMPLATE",
    "AttentionBackend",
    "ContiguousAttention",
    "Gemma3Config",
    "Gemma3ForCausalLM",
    "default_cache_dir",
    "default_gguf_path",
    "greedy_generate",
    "load_model",
    "load_model_files",
    "render_chat",
]
