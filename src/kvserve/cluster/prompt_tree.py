"""MemServe's global prompt trees: which instance holds the KV of which prompt prefix.

A prompt is indexed by its chain of block hashes (the instances' own prefix-cache
keys, `memory.prefix_cache.extend_block_hashes`): a block's hash names its whole
prefix, so a dict from hash to holders is a radix tree at block granularity, and
matching walks the chain until no holder is left. Two ways feed it, as MemServe
and the systems after it (Dynamo, llm-d) do:

- exact: the instances' KV events (blocks stored / removed, with the tier);
- approximate: the blocks of each request routed through, marked with an expiry
  (MemServe's TTL), for instances whose events are not (yet) known.

An entry from events never expires; one learnt from routing does after `ttl` s.
Block hashes of token ids are the same in every process (Python hashes ints and
tuples of ints without a per-process seed), so the router's chains match the
instances' keys.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence

from kvserve.memory.prefix_cache import extend_block_hashes

EXACT = math.inf  # the expiry of an entry an event reported


def block_hashes(tokens: Sequence[int], block: int) -> list[Hashable]:
    """The prefix-cache key of every full block of tokens."""
    out: list[Hashable] = []
    extend_block_hashes(out, tokens, block)
    return out


class PromptTree:
    """Holders of prompt prefixes among one kind of instance (prefill, decode, colocated)."""

    def __init__(self, ttl: float = 120.0) -> None:
        self.ttl = ttl
        # block hash -> instance -> expiry (EXACT for blocks an event reported)
        self._holders: dict[Hashable, dict[str, float]] = {}
        self._blocks: dict[str, set[Hashable]] = {}  # instance -> its blocks, for drop()

    def __len__(self) -> int:
        return len(self._holders)

    def learn(self, instance: str, hashes: Iterable[Hashable], now: float) -> None:
        """Approximate mode: the instance just served these blocks; trust it for ttl s."""
        self._add(instance, hashes, now + self.ttl)

    def stored(self, instance: str, hashes: Iterable[Hashable]) -> None:
        """Exact mode: a BlockStored event."""
        self._add(instance, hashes, EXACT)

    def removed(self, instance: str, hashes: Iterable[Hashable]) -> None:
        """Exact mode: a BlockRemoved event (the instance holds the block in no tier)."""
        mine = self._blocks.get(instance)
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None and holders.pop(instance, None) is not None:
                mine.discard(h)
                if not holders:
                    del self._holders[h]

    def drop(self, instance: str) -> None:
        """Forget everything of an instance (it died or left)."""
        self.removed(instance, list(self._blocks.get(instance, ())))
        self._blocks.pop(instance, None)

    def match(self, hashes: Sequence[Hashable], now: float) -> dict[str, int]:
        """Per instance, how many leading blocks of the chain it holds (absent: none)."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h, {})
            here = {inst for inst, exp in holders.items() if exp > now}
            alive = here if alive is None else alive & here
            if not alive:
                break
            for inst in alive:
                out[inst] = i + 1
        return out

    def expire(self, now: float) -> int:
        """Drop the learnt entries past their TTL; returns how many went."""
        gone = [(h, inst) for h, holders in self._holders.items()
                for inst, exp in holders.items() if exp <= now]
        for h, inst in gone:
            self.removed(inst, [h])
        return len(gone)

    def _add(self, instance: str, hashes: Iterable[Hashable], expiry: float) -> None:
        mine = self._blocks.setdefault(instance, set())
        for h in hashes:
            holders = self._holders.setdefault(h, {})
            holders[instance] = max(holders.get(instance, 0.0), expiry)
            mine.add(h)
