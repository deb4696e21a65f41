"""KV between instances: MemServe's transfer / transfer_with_insert across processes.

The sender looks its tokens up in its MemPool (`match`: per spec only the pages a
hit needs: a sliding window's last window, a Mamba state, every block of full
attention), leaves out the blocks the receiver already holds, and gathers each
spec's pages into one buffer (a page row already holds that block for every layer
of the spec: MemServe's aggregated "huge page", so a transfer is one object per
spec whatever the layer count). The receiver allocates, writes, and inserts the
pages into its prefix cache under the same block keys; its scheduler then finds
them as an ordinary hit. Where the receiver has no room nothing is inserted and
the tokens are recomputed: a transfer can shorten work, never fail a request.

How bytes move is a `Transport`: Ray's object store here (CPU, any machine of a
Ray cluster); an NCCL / NIXL transport for GPU memory fits the same interface.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.memory.allocator import OutOfPages
from kvserve.physical.host import copy_pages
from kvserve.physical.mempool import DEVICE, Addr, MemPool


@dataclass
class KVPayload:
    """Pages of a token prefix, per spec: which blocks, and their rows stacked."""

    tokens: list[int]  # the prefix the blocks belong to (its full blocks)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    data: dict[str, torch.Tensor] = field(default_factory=dict)  # [len(blocks), page_bytes]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values())

    @property
    def num_pages(self) -> int:
        return sum(len(b) for b in self.blocks.values())


def export_kv(pool: MemPool, tokens: list[int],
              have: Mapping[str, set[int]] | None = None) -> KVPayload:
    """The cached KV of tokens' longest cached prefix, less the blocks in `have`."""
    prefix, picks = plan_export(pool, tokens, have)
    out = KVPayload(prefix)
    for name, pairs in picks.items():
        out.blocks[name] = [b for b, _ in pairs]
        out.data[name] = _gather(pool, [a for _, a in pairs])
    return out


def plan_export(pool: MemPool, tokens: list[int], have: Mapping[str, set[int]] | None = None,
                ) -> tuple[list[int], dict[str, list[tuple[int, Addr]]]]:
    """What export_kv sends, without the bytes: tokens' longest cached prefix and, per
    spec, the (block, page) pairs of it the receiver lacks (the simulator prices these)."""
    pool.flush()  # tier copies first: a page may be on its way to the host
    n, rows = pool.match(tokens)
    picks: dict[str, list[tuple[int, Addr]]] = {}
    for name, row in rows.items():
        skip = have.get(name, set()) if have else set()
        pairs = [(b, a) for b, a in enumerate(row) if a is not None and b not in skip]
        if pairs:
            picks[name] = pairs
    return list(tokens[:n]), picks


def _gather(pool: MemPool, addrs: list[Addr]) -> torch.Tensor:
    s = pool.kv.layout.index(addrs[0].spec)
    rows = pool.device.pages(s)
    buf = torch.empty((len(addrs), rows.shape[1]), dtype=rows.dtype)
    for tier in {a.tier for a in addrs}:
        idx = [i for i, a in enumerate(addrs) if a.tier == tier]
        copy_pages(pool._pages(tier, s), buf, [addrs[i].page for i in idx], idx)
    return buf


def import_kv(pool: MemPool, payload: KVPayload) -> int:
    """Write the payload's pages into new device pages and cache them under the
    payload's block keys (transfer_with_insert's receiving end); returns the pages
    inserted, 0 when the pool has no room (the tokens get recomputed)."""

    def write(name: str, pages: list[Addr]) -> None:
        s = pool.kv.layout.index(name)
        copy_pages(payload.data[name], pool.device.pages(s), list(range(len(pages))),
                   [a.page for a in pages])
    return insert_blocks(pool, payload.tokens, payload.blocks, write)


def insert_blocks(pool: MemPool, tokens: list[int], blocks: Mapping[str, list[int]],
                  write: Callable[[str, list[Addr]], None] | None = None) -> int:
    """import_kv's bookkeeping: new device pages for each spec's blocks (`write` fills
    them; the simulator has no bytes), cached under tokens' block keys, then freed into
    the evictable cache. Returns the pages inserted, 0 when the pool has no room."""
    if not blocks:
        return 0
    try:
        addrs = pool.alloc_mem({name: len(b) for name, b in blocks.items()}, DEVICE)
    except OutOfPages:
        return 0
    nblocks = len(tokens) // pool.kv.T
    rows: dict[str, list[Addr | None]] = {}
    taken = iter(addrs)  # alloc_mem returns pages grouped by spec, in size's order
    for name, bl in blocks.items():
        mine = [next(taken) for _ in bl]
        if write is not None:
            write(name, mine)
        row: list[Addr | None] = [None] * nblocks
        for b, a in zip(bl, mine):
            row[b] = a
        rows[name] = row
    n = pool.insert(tokens, rows)
    pool.free_mem(addrs)  # cached now, evictable; a page cached already becomes empty
    return n


class Transport(Protocol):
    """Moves a payload from the instance that built it to the one that imports it."""

    def send(self, payload: KVPayload) -> object: ...

    def receive(self, handle: object) -> KVPayload: ...


class ObjectStoreTransport:
    """Ray's object store. The sending actor method returns the payload, which makes it
    one object in the store (a buffer per spec); the front end hands its reference
    to the receiving actor's call without reading it, and Ray resolves it there (shared
    memory on one node, a pull between nodes). So both ends are the identity here; a
    GPU transport would register buffers in `send` and pull them in `receive`."""

    def send(self, payload: KVPayload) -> object:
        return payload

    def receive(self, handle: object) -> KVPayload:
        if not isinstance(handle, KVPayload):
            raise TypeError(f"expected a KVPayload, got {type(handle).__name__}")
        return handle
