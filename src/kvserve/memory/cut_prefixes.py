"""Cut prefixes: what is left of a cached prefix once eviction took a block its hit needs.

Eviction takes a cached prefix's tail first, in every layer type at once (its
pages share one key; equal keys evict the longest prefix first). Once it has
taken a block that the hit at the prefix's reuse point needs (the last full
attention block, or a sliding window page before that point), the rest of the
prefix back to the next point that still hits serves no lookup. Yet it keeps its
key. Under plain LRU it is evicted next all the same, but in a loop (MRU keys,
`ReusePoints.reuse_key`) every newer loop member's pages go before it, and such
remainders piled up: Gemma 3 12B, 64 articles round-robin at 1/s held 2.3 GB of
a 35 GB pool in pages that no hit could use, on average (0.12 GB with this rule;
`benchmarks/pool_composition.py`).

So the manager registers each finished request's block hashes under the key its
pages got; an eviction of a page with that key makes the manager find how far the
sequence still hits (every spec at once) and demote the pages past that point that
still carry the key: pages a later request re-keyed belong to its prefix now.
"""

from __future__ import annotations

from collections.abc import Hashable


class CutPrefixes:
    """Finished requests' block hashes by the eviction key their pages got at finish,
    and the keys eviction has taken pages from since the last `take`.

    At most `limit` blocks are kept, the oldest keys dropping first.
    """

    __slots__ = ("by_key", "touched", "blocks", "limit")

    def __init__(self, limit: int) -> None:
        self.by_key: dict[int, list[list[Hashable]]] = {}
        # keys of evicted pages (the allocator adds them: `evicted_keys`), any key
        self.touched: set[int] = set()
        self.blocks = 0
        self.limit = limit

    def add(self, key: int, hashes: list[Hashable]) -> None:
        self.by_key.setdefault(key, []).append(hashes)
        self.blocks += len(hashes)
        while self.blocks > self.limit:
            old = next(iter(self.by_key))
            self.blocks -= sum(map(len, self.by_key.pop(old)))
            self.touched.discard(old)

    def take(self) -> list[tuple[int, list[list[Hashable]]]]:
        """(key, sequences) of every key touched since the last call."""
        by_key = self.by_key
        out = [(k, by_key[k]) for k in self.touched if k in by_key]
        self.touched.clear()
        return out

    def drop(self, key: int, hashes: list[Hashable]) -> None:
        """The sequence hits nowhere any more: forget it."""
        seqs = self.by_key.get(key)
        if seqs is None:
            return
        for i, h in enumerate(seqs):
            if h is hashes:
                del seqs[i]
                self.blocks -= len(hashes)
                break
        if not seqs:
            del self.by_key[key]
