"""Incremental detokenization that streams correct text.

Decoding token by token breaks multi-byte characters and SentencePiece's
leading-space handling, so each step decodes a short window of recent tokens
twice (with and without the new ones) and emits only the difference, holding
back text that ends in an incomplete character.
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW = 6  # tokens of context before the unread part


@dataclass
class DetokState:
    prefix_offset: int = 0
    read_offset: int = 0


def detokenize_step(tokenizer, ids: list[int], state: DetokState) -> str:
    """New text for ids[state.read_offset:], advancing state; '' while incomplete."""
    prefix = tokenizer.decode(ids[state.prefix_offset:state.read_offset],
                              skip_special_tokens=True)
    full = tokenizer.decode(ids[state.prefix_offset:], skip_special_tokens=True)
    if full.endswith("\ufffd") or len(full) <= len(prefix):
        return ""
    new = full[len(prefix):]
    state.prefix_offset = max(state.read_offset, len(ids) - WINDOW)
    state.read_offset = len(ids)
    return new


def start_state(prompt_ids: list[int]) -> DetokState:
    n = len(prompt_ids)
    return DetokState(prefix_offset=max(0, n - WINDOW), read_offset=n)
