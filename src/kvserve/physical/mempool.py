"""MemServe's MemPool: one instance's KV memory over device and host, behind one API.

The memory core (KVCacheManager) keeps the index and the pages of both
tiers; this module binds them to bytes (the device KVPool, the HostPool) and
offers the paper's API (Table 1) over them:

    alloc_mem(size, tier, id)     pages of each spec on a tier -> addresses
    free_mem(addrs)
    insert(tokens, addrs)         publish pages as the KV of tokens' blocks
    match(tokens)                 longest cached prefix, over both tiers
    delete(tokens)
    swap_out(n) / swap_in(addrs)  device <-> host
    transfer(id, src, dst) / transfer_with_insert(id, tokens, src, dst)

An address names instance, tier, spec and page, so a hybrid model's specs,
each with its own page size, travel through the same calls (MemServe
assumes one page size). Transfers are local here; the cluster carries them
between instances. The engine calls `flush` before each forward: it makes
the copies the scheduler's evictions and host-tier hits logged.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvserve.memory import KVCacheManager
from kvserve.memory.allocator import TwoLevelAllocator
from kvserve.memory.host_tier import Copier, play
from kvserve.physical.host import HostPool, copy_pages
from kvserve.physical.pool import KVPool

DEVICE, HOST = "device", "host"
OWNER = "mempool"  # the request id pages allocated through the API are held under


@dataclass(frozen=True)
class Addr:
    instance: int
    tier: str  # "device" | "host"
    spec: str
    page: int


PerSpec = Mapping[str, Sequence["Addr | None"]]  # per spec, one entry per block


class MemPool:
    def __init__(self, kv: KVCacheManager, device: KVPool, host: HostPool | None = None,
                 instance: int = 0) -> None:
        if (host is None) != (kv.host is None):
            raise ValueError("the host pool and the memory core's host tier go together")
        self.kv, self.device, self.host, self.instance = kv, device, host, instance
        self._behind: _Copier | None = None

    # ------------------------------------------------------------------ engine

    def flush(self) -> int:
        """Make the logged copies between the tiers; returns how many pages moved.
        Write-behind copies under way finish first."""
        self._join()
        return self.kv.flush(self._copy)

    def write_behind(self) -> None:
        """Copy the pages finished requests left cached to the host tier in a thread,
        beside what the engine does until its next flush (sampling, detokenizing,
        scheduling: no KV bytes change before the next forward, which flushes first)."""
        batch = self.kv.take_ahead()
        if not batch:
            return
        self._join()
        self._behind = _Copier(batch, self._copy)
        self._behind.start()

    def give_back(self, before: int | None) -> int:
        """Evict the device pages cached with keys below step `before` (None: none), then
        return the memory of every device large page no one holds to the OS; returns
        the bytes returned. Evictions' copies to the host tier are made first."""
        free = self.kv.idle_pages(before)
        self.flush()
        return self.device.give_back(free)

    def _join(self) -> None:
        if self._behind is not None:
            behind, self._behind = self._behind, None
            behind.join()
            self.kv.ahead_done(behind.batch)
            if behind.error is not None:
                raise behind.error

    def _copy(self, to_host: bool, s: int, src: list[int], dst: list[int]) -> None:
        dev, host = self.device.pages(s), self.host.pages(s)
        copy_pages(dev, host, src, dst) if to_host else copy_pages(host, dev, src, dst)

    # ------------------------------------------------------------ memory blocks

    def alloc_mem(self, size: Mapping[str, int], tier: str = DEVICE,
                  instance: int | None = None) -> list[Addr]:
        """`size[spec]` pages of each spec on `tier`, held until free_mem; OutOfPages
        (nothing taken) when the tier cannot hold them even after evicting cache."""
        self._local(instance)
        alloc = self._alloc(tier)
        specs = self.kv.layout.specs
        needs = [(self.kv.layout.index(name), n) for name, n in size.items()]
        pages = alloc.allocate(OWNER, needs)
        return [Addr(self.instance, tier, specs[s].name, p)
                for (s, _), pids in zip(needs, pages) for p in pids]

    def free_mem(self, addrs: Sequence[Addr]) -> None:
        for a in addrs:
            self._local(a.instance)
            self._alloc(a.tier).free(self.kv.layout.index(a.spec), [a.page], self.kv.now)

    # ------------------------------------------------------------------- index

    def insert(self, tokens: Sequence[int], addrs: PerSpec) -> int:
        """Publish each spec's pages as the KV of tokens' blocks, in block order (None:
        no page for that block); returns the pages inserted (a block cached already is
        left as it is)."""
        keys, n = self.kv.block_keys(tokens), 0
        for name, row in addrs.items():
            s = self.kv.layout.index(name)
            if len(row) > len(keys):
                raise ValueError(f"{len(row)} {name} pages for {len(keys)} full blocks")
            for b, a in enumerate(row):
                if a is not None:
                    self._local(a.instance)
                    n += self._alloc(a.tier).insert(s, a.page, keys[b], (b + 1) * self.kv.T)
        return n

    def match(self, tokens: Sequence[int]) -> tuple[int, dict[str, list[Addr | None]]]:
        """The longest prefix of tokens cached for every spec (tokens) and its pages."""
        n, rows = self.kv.match(tokens)
        out = {}
        for spec, row in zip(self.kv.layout.specs, rows):
            out[spec.name] = [None if e is None else
                              Addr(self.instance, HOST if e[0] else DEVICE, spec.name, e[1])
                              for e in row]
        return n, out

    def delete(self, tokens: Sequence[int]) -> int:
        return self.kv.delete(tokens)

    # -------------------------------------------------------------------- swap

    def swap_out(self, num_blocks: int) -> int:
        """Move about num_blocks cached pages, least recently used first, to the host."""
        moved = self.kv.swap_out(num_blocks)
        self.flush()
        return moved

    def swap_in(self, addrs: Sequence[Addr]) -> list[Addr]:
        """Copies of host pages on the device (cached there under the same keys)."""
        if any(a.tier != HOST for a in addrs):
            raise ValueError("swap_in takes host-tier addresses")
        out = self.transfer(self.instance, addrs, tier=DEVICE)
        self._republish(addrs, out)
        return out

    # ---------------------------------------------------------------- transfer

    def transfer(self, instance: int, src: Sequence[Addr], dst: Sequence[Addr] | None = None,
                 tier: str = DEVICE) -> list[Addr]:
        """Copy pages to `dst` (allocated on `tier` of `instance` when not given)."""
        self._local(instance)
        if dst is None:
            size: dict[str, int] = {}
            for a in src:
                size[a.spec] = size.get(a.spec, 0) + 1
            dst = self.alloc_mem(size, tier, instance)
            dst = _in_order(src, dst)
        if len(dst) != len(src) or any(a.spec != b.spec for a, b in zip(src, dst)):
            raise ValueError("transfer needs one destination page of the same spec per source")
        self.flush()  # pending tier copies first: they may write the sources
        groups: dict[tuple[str, str, str], tuple[list[int], list[int]]] = {}
        for a, b in zip(src, dst):
            pair = groups.setdefault((a.spec, a.tier, b.tier), ([], []))
            pair[0].append(a.page)
            pair[1].append(b.page)
        for (name, frm, to), (si, di) in groups.items():
            s = self.kv.layout.index(name)
            copy_pages(self._pages(frm, s), self._pages(to, s), si, di)
        return list(dst)

    def transfer_with_insert(self, instance: int, tokens: Sequence[int], src: PerSpec,
                             tier: str = DEVICE) -> dict[str, list[Addr | None]]:
        """transfer, then insert the copies as the KV of tokens at the destination."""
        flat = [a for row in src.values() for a in row if a is not None]
        moved = iter(self.transfer(instance, flat, tier=tier))
        dst = {name: [None if a is None else next(moved) for a in row]
               for name, row in src.items()}
        self.insert(tokens, dst)
        return dst

    # ------------------------------------------------------------------ helpers

    def _local(self, instance: int | None) -> None:
        if instance is not None and instance != self.instance:
            raise NotImplementedError(
                f"instance {instance} is remote; this MemPool is instance {self.instance} "
                "(remote transfers go through the cluster)")

    def _alloc(self, tier: str) -> TwoLevelAllocator:
        if tier == DEVICE:
            return self.kv.alloc
        if tier == HOST and self.kv.host is not None:
            return self.kv.host.alloc
        raise ValueError(f"no {tier!r} tier here (tiers: device"
                         f"{', host' if self.kv.host is not None else ''})")

    def _pages(self, tier: str, s: int) -> torch.Tensor:
        self._alloc(tier)  # a clear error for a missing tier
        return self.device.pages(s) if tier == DEVICE else self.host.pages(s)

    def _republish(self, src: Sequence[Addr], dst: Sequence[Addr]) -> None:
        """Cache the copies under the keys their sources are cached under."""
        for a, b in zip(src, dst):
            s = self.kv.layout.index(a.spec)
            sp = self._alloc(a.tier).specs[s]
            if sp.hash[a.page] is not None:
                self._alloc(b.tier).insert(s, b.page, sp.hash[a.page], sp.plen[a.page])


class _Copier(threading.Thread):
    """Makes a batch of write-behind copies; an error is raised again by the join."""

    def __init__(self, batch: list[tuple[bool, int, int, int]], copy: Copier) -> None:
        super().__init__(name="kvserve-write-behind", daemon=True)
        self.batch, self.copy = batch, copy
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            play(self.copy, self.batch)
        except BaseException as e:  # noqa: BLE001 (handed to the engine thread)
            self.error = e


def _in_order(src: Sequence[Addr], dst: Sequence[Addr]) -> list[Addr]:
    """alloc_mem returns pages grouped by spec: match them to src's order."""
    by_spec: dict[str, list[Addr]] = {}
    for a in dst:
        by_spec.setdefault(a.spec, []).append(a)
    taken = {name: iter(row) for name, row in by_spec.items()}
    return [next(taken[a.spec]) for a in src]
