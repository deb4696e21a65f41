"""The host tier: cached pages the device pool evicts, kept in host memory.

MemServe's MemPool spans HBM and DRAM. Here the device pool's allocator calls
`store` for every cached page it is about to evict; the page is copied to a
second pool in host memory instead of being forgotten, and a later lookup
that finds the rest of a prefix there loads it back (`load`) and counts it as
a hit. The host pool is a TwoLevelAllocator over the same layout, so every
spec keeps its own page size (MemServe assumes one) and the host tier
evicts by the same rules as the device: large pages LRU, ties longest prefix
first, so a prefix's pages of every spec stored together leave together.
A page keeps the eviction key it had on the device: a loop member's page
(MRU keys) stays the first to go, and a page that serves no hit (DEAD) is
never written at all.

Copies are not made here (this package never touches bytes): `store` and
`load` append to an ordered log that `flush` hands to the physical side in
runs of one direction, one call per spec and run (block aggregation, §5.2).
The engine flushes before each forward, the first moment the data is read
or overwritten. Pages a logged copy reads or writes stay pinned (used) in
the host pool until the flush, so no copy of the same flush can reuse them;
a device page that is evicted, refilled and evicted again in one step shows
up in the log in that order, and runs keep it.

Write-behind keeps the write-backs off the step's critical path: when a
request finishes, its cached pages are queued (`write_ahead`) and copied
after the step's forward, beside the scheduling of the next step, which
touches no KV bytes; the next flush waits for them first. A page evicted
later finds its copy already here and costs nothing. The copies are
duplicates while the device still caches the page, so they get the lowest
key (DUPLICATE) and are the host tier's first to go; an eviction raises the
page to its device key. Only a host tier at least twice the device pool
writes behind: a smaller one would spend itself on duplicates.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvserve.memory.allocator import DEAD, OutOfPages, TwoLevelAllocator
from kvserve.memory.spec import Layout

WRITER = "host-tier"  # the host pool's one request: write-backs fill large pages in turn
DUPLICATE = DEAD + 1  # key of a copy the device pool still caches: evicted first here

# copy(to_host, spec, src pages, dst pages): move whole small pages of one spec
Copier = Callable[[bool, int, list[int], list[int]], None]


@dataclass
class HostStats:
    """Host-tier bytes per spec and what moved between the tiers."""

    pool_bytes: int
    spec_bytes: dict[str, int]  # cached (or in-flight) bytes per spec
    pages_out: int = 0  # device -> host
    pages_in: int = 0  # host -> device
    bytes_out: int = 0
    bytes_in: int = 0
    hit_tokens: int = 0  # prompt tokens served from pages loaded from the host
    dropped: int = 0  # evicted pages the host had no room for


class HostTier:
    """Index and allocator of the host pool, and the log of copies to make."""

    def __init__(self, layout: Layout, num_large: int, partitioned: bool = False) -> None:
        self.layout = layout
        self.alloc = TwoLevelAllocator(layout, num_large, partitioned)
        self.log: list[tuple[bool, int, int, int]] = []  # (to_host, spec, src, dst)
        self.pinned: list[tuple[int, int, int | None]] = []  # (spec, page, key to free with)
        self.ahead: list[tuple[bool, int, int, int]] = []  # write-behind copies, as the log
        self._behind: set[tuple[int, int]] = set()  # host pages of write-behind copies
        self._raised: dict[tuple[int, int], int] = {}  # key of those evicted since
        self.pages_out = self.pages_in = self.bytes_out = self.bytes_in = 0
        self.hit_tokens = 0
        self.dropped = 0

    @property
    def pool_bytes(self) -> int:
        return self.alloc.num_large * self.layout.large_page_bytes

    def cached(self, s: int) -> dict[Hashable, int]:
        """Block key -> host page of spec s."""
        return self.alloc.specs[s].cached

    def store(self, s: int, device_page: int, h: Hashable, plen: int, key: int) -> bool:
        """Copy an evicted device page here under its key; False if it is not kept."""
        if key <= DEAD:  # serves no hit: not worth the copy
            return False
        hp = self.alloc.specs[s].cached.get(h)
        if hp is not None:  # written behind or loaded earlier: the same KV
            if (s, hp) in self._behind:  # its write-behind copy is still under way
                self._raised[(s, hp)] = max(key, self._raised.get((s, hp), key))
            self.alloc.touch(s, [hp], key)
            return True
        hp = self._take_page(s, h, plen)
        if hp is None:  # everything here is pinned by this step's copies
            self.dropped += 1
            return False
        self.log.append((True, s, device_page, hp))
        self.pinned.append((s, hp, key))
        return True

    def write_ahead(self, s: int, device_page: int, h: Hashable, plen: int) -> None:
        """Queue a copy of a cached device page that may be evicted later (write-behind)."""
        if h in self.alloc.specs[s].cached:
            return
        hp = self._take_page(s, h, plen)
        if hp is None:  # all pinned: the eviction will copy it, if it comes
            return
        self.ahead.append((True, s, device_page, hp))
        self._behind.add((s, hp))

    def _take_page(self, s: int, h: Hashable, plen: int) -> int | None:
        """A host page of spec s (evicting the oldest if need be) cached under h, held
        until its copy is made, and counted as written; None if all are pinned."""
        try:
            [[hp]] = self.alloc.allocate(WRITER, [(s, 1)])
        except OutOfPages:
            return None
        self.alloc.insert(s, hp, h, plen)
        self.pages_out += 1
        self.bytes_out += self.layout.page_bytes[s]
        return hp

    def take_ahead(self) -> list[tuple[bool, int, int, int]]:
        """The queued write-behind copies, in log form, to make now (`play`), off the
        step's critical path; then `ahead_done`."""
        batch, self.ahead = self.ahead, []
        return batch

    def ahead_done(self, batch: list[tuple[bool, int, int, int]]) -> None:
        """The copies of `batch` are made: their pages join the host tier."""
        for _, s, _, hp in batch:
            self._behind.discard((s, hp))
            self.alloc.free(s, [hp], self._raised.pop((s, hp), DUPLICATE))

    def pin(self, s: int, h: Hashable) -> int:
        """The host page caching h, kept until the next flush (a load's source)."""
        hp = self.alloc.specs[s].cached[h]
        self.alloc.claim(s, [hp])
        return hp

    def unpin(self, s: int, hp: int) -> None:
        """Undo a pin whose load did not happen: nothing changes, not even the LRU."""
        self.alloc.unclaim(s, [hp])

    def load(self, s: int, hp: int, device_page: int) -> None:
        """Log the copy of pinned host page hp into device_page."""
        self.log.append((False, s, hp, device_page))
        self.pinned.append((s, hp, None))
        self.pages_in += 1
        self.bytes_in += self.layout.page_bytes[s]

    def flush(self, copy: Copier, now: int) -> int:
        """Make every logged copy, in order, one call per run and spec; returns the pages.

        Write-behind copies still queued go first (their device pages may be
        refilled by this step's loads). Then the pinned pages go back to the
        host pool: written pages as cache under their device key, loaded
        ones as recently used.
        """
        ahead = self.take_ahead()
        play(copy, ahead)
        self.ahead_done(ahead)
        log, self.log = self.log, []
        try:
            play(copy, log)
        finally:
            pinned, self.pinned = self.pinned, []
            for s, hp, key in pinned:
                self.alloc.free(s, [hp], now if key is None else key)
        return len(ahead) + len(log)

    def discard(self, s: int, h: Hashable, now: int) -> bool:
        """Forget the page caching h, if any."""
        hp = self.alloc.specs[s].cached.get(h)
        if hp is not None:
            self.alloc.discard(s, [hp], now)
        return hp is not None

    def stats(self) -> HostStats:
        spec_bytes = {}
        for spec, sp, pb in zip(self.layout.specs, self.alloc.specs, self.layout.page_bytes):
            spec_bytes[spec.name] = (sp.n_used + sp.n_evictable) * pb
        return HostStats(self.pool_bytes, spec_bytes, self.pages_out, self.pages_in,
                         self.bytes_out, self.bytes_in, self.hit_tokens, self.dropped)


def play(copy: Copier, log: list[tuple[bool, int, int, int]]) -> None:
    """Make the copies of a log in order: one call per run of one direction and spec."""
    for to_host, run in itertools.groupby(log, key=lambda c: c[0]):
        per_spec: dict[int, tuple[list[int], list[int]]] = {}
        for _, s, src, dst in run:
            pair = per_spec.setdefault(s, ([], []))
            pair[0].append(src)
            pair[1].append(dst)
        for s, (src, dst) in per_spec.items():
            copy(to_host, s, src, dst)
