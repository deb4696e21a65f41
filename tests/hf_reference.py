"""Shared pieces of the tests that compare kvserve with Hugging Face transformers."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import torch
from gguf import GGUFReader  # gguf's own, also while gguf_parsed_once stands in for it

from kvserve.models import Gemma3Config, Gemma3ForCausalLM

NEW_TOKENS = 16
# HF top-2 logits closer than this may legitimately flip under float reassociation.
NEAR_TIE = 1e-3

SHORT_TEXT = "The old lighthouse keeper climbed the spiral stairs every evening, and tonight he"


@dataclass
class KvModel:
    config: Gemma3Config
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any
    model: Gemma3ForCausalLM


@dataclass
class HfGreedy:
    """HF's greedy continuation and, per generated step, the logits it chose from."""

    tokens: list[int]
    logits: list[torch.Tensor]


_GGUF_READERS: dict[tuple[str, int, int], Any] = {}


def gguf_reader(path: str | os.PathLike[str]) -> Any:
    """One read-only ``gguf.GGUFReader`` per file for the session.

    Building one reads the 262k-entry vocabulary field by field (15-20 s on 2 cores); the
    reader is a read-only memory map of the file, so handing the same one out again changes
    nothing a caller reads.
    """
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _GGUF_READERS:
        _GGUF_READERS[key] = GGUFReader(path, "r")
    return _GGUF_READERS[key]


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Inside this block, transformers' GGUF loading parses each file once per session.

    transformers builds a new ``gguf.GGUFReader`` for a model's config, again for its tensors
    and again for a tokenizer's config; each is ``gguf_reader``'s one per file instead, so
    the config, the dequantisation and the tokenizer conversion are still transformers' own,
    from the file.
    """
    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        return gguf_reader(path) if mode == "r" else GGUFReader(path, mode)

    gguf.GGUFReader = reader  # transformers imports it from gguf at each call
    try:
        yield
    finally:
        gguf.GGUFReader = GGUFReader


def ledger_text(lines: int) -> str:
    """Varied, deterministic prose long enough to cross the 512-token sliding window."""
    towns = ["Avila", "Bergen", "Cusco", "Dakar", "Esbjerg", "Fez", "Galway", "Hue", "Izmir"]
    goods = ["copper wire", "salted fish", "wool", "indigo", "walnuts", "glass beads", "tea"]
    ships = ["Heron", "Marigold", "Stormpetrel", "Juniper", "Kestrel"]
    out = ["Harbour ledger of the merchant house, kept by the second clerk."]
    for i in range(lines):
        town, good, ship = towns[i * 7 % 9], goods[i * 5 % 7], ships[i * 3 % 5]
        crates = 12 + (i * 37) % 89
        out.append(
            f"Day {i + 1}: the {ship} arrived from {town} carrying {crates} crates of {good}; "
            f"the clerk noted {(i * 13) % 7} damaged and paid the pilot {3 + i % 11} silver."
        )
    return "\n".join(out)


def assert_same_greedy(ours: list[int], ref: HfGreedy) -> int:
    """Assert our greedy tokens equal HF's; return how many steps were compared.

    A divergence is accepted only where HF's own top-2 logits are within NEAR_TIE and we
    picked HF's runner-up: that is float noise deciding a tie, and after it the two
    continuations legitimately differ, so comparison stops there. Anything else fails.
    """
    assert ref.tokens, "HF generated nothing"
    for step, (mine, theirs) in enumerate(zip(ours, ref.tokens, strict=False)):
        if mine == theirs:
            continue
        top = torch.topk(ref.logits[step], 2)
        gap = float(top.values[0] - top.values[1])
        if gap < NEAR_TIE and mine == int(top.indices[1]):
            warnings.warn(
                f"accepted near-tie divergence at step {step} (gap {gap:.2g})", stacklevel=2
            )
            return step
        raise AssertionError(
            f"greedy divergence at step {step}: kvserve {mine} vs HF {theirs} "
            f"(HF top-2 {top.indices.tolist()} gap {gap:.3g}); kvserve {ours}, HF {ref.tokens}"
        )
    # HF stops early on EOS; we always run NEW_TOKENS steps, so only HF's length is compared.
    assert len(ours) >= len(ref.tokens)
    return len(ref.tokens)


def serve_in_order(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], list[int]]:
    """One request at a time through an LLMEngine: (generated ids, cached prompt tokens)."""
    outs, hits = [], []
    for i, prompt in enumerate(prompts):
        req = engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs.append(o.outputs[0].token_ids)
        hits.append(req.num_cached_tokens)
    return outs, hits
