"""Config fields every family reads the same way from a GGUF's metadata or an HF config."""

from __future__ import annotations

from typing import Any


def gguf_common(meta: Any, tensor_shapes: dict[str, list[int]]) -> dict[str, Any]:
    """The `ModelConfig` fields of a llama.cpp GGUF (`meta`: loader._GGUFMeta)."""
    from gguf import Keys

    hidden = int(meta.require(Keys.LLM.EMBEDDING_LENGTH))
    heads = int(meta.require(Keys.Attention.HEAD_COUNT))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return dict(
        vocab_size=tensor_shapes["token_embd.weight"][1],
        hidden_size=hidden,
        intermediate_size=int(meta.require(Keys.LLM.FEED_FORWARD_LENGTH)),
        num_hidden_layers=int(meta.require(Keys.LLM.BLOCK_COUNT)),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(Keys.Attention.HEAD_COUNT_KV, heads)),
        rms_norm_eps=float(meta.get(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
        max_position_embeddings=int(meta.get(Keys.LLM.CONTEXT_LENGTH, 32_768)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_gguf_eos_ids(meta, tokens),
        pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id", 0)),
    )


def _gguf_eos_ids(meta: Any, tokens: list[str]) -> list[int]:
    ids = [int(meta.get("tokenizer.ggml.eos_token_id", 1))]
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is None and "<end_of_turn>" in tokens:
        # Gemma's chat replies end with <end_of_turn>, not <eos>; Google's
        # generation_config lists both.
        eot = tokens.index("<end_of_turn>")
    if eot is not None and int(eot) not in ids:
        ids.append(int(eot))
    return ids


def gguf_rope_scaling(meta: Any) -> dict[str, Any] | None:
    from gguf import Keys

    kind = meta.get(Keys.Rope.SCALING_TYPE)
    factor = meta.get(Keys.Rope.SCALING_FACTOR)
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    return {"rope_type": str(kind), "factor": float(factor)}


def hf_common(text: Any) -> dict[str, Any]:
    """The `ModelConfig` fields of a transformers text config."""
    heads = text.num_attention_heads
    return dict(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        max_position_embeddings=text.max_position_embeddings,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        bos_token_id=text.bos_token_id,
        eos_token_ids=eos_ids(text.eos_token_id),
        pad_token_id=int(getattr(text, "pad_token_id", None) or 0),
    )


def eos_ids(eos: Any) -> list[int]:
    """An HF eos_token_id (an int, a list or None) as a list."""
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, list) else [int(eos)]


def hf_rope_scaling(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """transformers' rope_parameters as our scaling dict (None for the default)."""
    kind = (params or {}).get("rope_type", "default")
    if kind == "default":
        return None
    return {k: v for k, v in params.items() if k != "rope_theta"}
