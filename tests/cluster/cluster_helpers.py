"""Tiny engines for cluster tests: built inside each Ray actor from a seeded random Gemma 3."""

from __future__ import annotations

import torch
from tiny_gemma import ByteTokenizer, tiny_gemma

from kvserve.engine.engine import EngineConfig, LLMEngine


def tiny_engine(kv_memory: int = 1 << 20, max_num_seqs: int = 8) -> LLMEngine:
    """tiny_gemma with small embeddings: its layers, not the last token's embedding, then
    decide the next token, so greedy output follows the whole context (with the default
    weights it repeats one token, which would hide a wrong KV page)."""
    model = tiny_gemma()
    torch.manual_seed(1)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.01)
    cfg = EngineConfig(kv_memory=kv_memory, dtype="float32", tokens_per_page=4,
                       max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    return LLMEngine(model, ByteTokenizer(), cfg)
