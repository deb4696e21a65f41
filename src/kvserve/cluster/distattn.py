"""Infinite-LLM's rManager: one instance's side of DistAttention, as debtor and creditor.

A request whose KV outgrows its instance's pool (its debtor) lends its oldest
full-attention blocks to other instances (creditors) instead of being preempted or
refused. Each full-attention layer then computes attention over the keys it holds,
asks every creditor for attention of the same query rows over the blocks it holds
(`models/dist_attention.py`: output and log-sum-exp), and merges them exactly. Only
the query travels per layer, never the KV.

Beyond the paper, hybrid-aware: only full-attention specs lend (`KVCacheManager.lend`);
sliding-window and Mamba state is bounded and stays with the request, so a Gemma 3
request moves 1/6 of the bytes Infinite-LLM would move for every layer.

`ShardStore` is the creditor: it reserves pages first come first served
(`try_move_kvcache`), holds the lent page rows, attends over them and drops them
when the debtor's request leaves. `Debtor` is the engine's `Lender`: when a step
cannot get pages it lends the longest running request's next blocks to the first
creditor that accepts them. Creditors are reached through `Creditor`, in-process
(`LocalCreditor`) or over Ray (the cluster instance's methods).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
import torch

from kvserve.engine.engine import LLMEngine
from kvserve.kernels.cpu import kernels_for
from kvserve.memory.allocator import OutOfPages
from kvserve.models.dist_attention import Partial, RemoteKVLost, partial_attention
from kvserve.physical.mempool import Addr

LEND_FRACTION = 0.5  # a creditor lends at most this share of its pool: its own requests run
MIN_LEND_BLOCKS = 8  # one lend moves at least this many blocks: fewer, larger transfers
# Query rows up to this go to the CPU kernel over the shard's pages in place; more (a
# prefill chunk) to SDPA over a gathered copy, faster per row (models/paged_attention.py)
KERNEL_ROWS = 16


@dataclass
class Shard:
    """Blocks of one debtor request held by a creditor, per full-attention spec."""

    addrs: list[Addr]
    rows: dict[str, list[int]] = field(default_factory=dict)  # spec -> pages, block order
    filled: bool = False
    debtor: str = ""  # the instance the request runs on


class ShardStore:
    """The creditor side: KV blocks other instances' requests lent to this one.

    Touches the engine's allocator, so calls that allocate or free run on the engine's
    thread (the cluster instance routes them there); `attend` only reads pages no one
    else writes, so it may run beside a step.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.mempool = engine.mempool
        self.shards: dict[str, list[Shard]] = {}
        pool = engine.kv
        self.limit = int(LEND_FRACTION * pool.num_large_pages * pool.layout.large_page_bytes)

    def lent_bytes(self) -> int:
        page = self.engine.kv.layout.page_bytes
        specs = self.engine.kv.layout
        return sum(page[specs.index(a.spec)] for ss in self.shards.values() for s in ss
                   for a in s.addrs)

    def is_debtor(self) -> bool:
        return any(self.engine.kv.lent(r.request_id) for r in self.engine.scheduler.running)

    def try_move_kvcache(self, req_id: str, num_blocks: int, debtor: str = "") -> bool:
        """Reserve room for num_blocks of the request's full-attention blocks (every full
        spec), first come first served; False (nothing taken) where they do not fit, or
        where this instance lends KV itself (never debtor and creditor at once)."""
        if self.is_debtor():
            return False
        kv = self.engine.kv
        full = [m.spec.name for m in kv.full_specs()]
        if self.lent_bytes() + num_blocks * kv.full_block_bytes() > self.limit:
            return False
        try:
            addrs = self.mempool.alloc_mem({name: num_blocks for name in full})
        except OutOfPages:
            return False
        shard = Shard(addrs, debtor=debtor)
        for a in addrs:
            shard.rows.setdefault(a.spec, []).append(a.page)
        self.shards.setdefault(req_id, []).append(shard)
        return True

    def store(self, req_id: str, data: dict[str, torch.Tensor]) -> None:
        """Write the rows of the request's oldest reservation not yet filled."""
        shard = next(s for s in self.shards.get(req_id, []) if not s.filled)
        device = self.mempool.device
        for name, rows in data.items():
            pages = device.pages(self.engine.kv.layout.index(name))
            pages[torch.tensor(shard.rows[name])] = rows.to(pages.device)
        shard.filled = True

    def attend(self, req_id: str, index: int, q: torch.Tensor) -> Partial:
        """Attention of q [Q, Hq, D] over every block of the request held here, in
        full-attention layer `index` (all of them precede every query: no mask)."""
        shards = [s for s in self.shards.get(req_id, []) if s.filled]
        if not shards:
            raise KeyError(f"no KV of request {req_id!r} is held here")
        name = self.engine.kv.full_specs()[0].spec.name
        cache = self.mempool.device.layer(name, index)  # [pages, 2, T, Hkv, D]
        pages = torch.tensor([p for s in shards for p in s.rows[name]])
        scale = next(b.scale for b in self.engine.runner.attn.bindings
                     if b.spec == name and b.index == index)
        kernels = kernels_for(cache)
        if kernels is not None and q.shape[0] <= KERNEL_ROWS and q.dtype == cache.dtype:
            # Decode rows: the kernel reads the pages in place (no gather of the shard)
            # and returns its log-sum-exp.
            R, n = q.shape[0], len(pages) * cache.shape[2]
            ints = [torch.zeros(R, dtype=torch.int32), torch.zeros(R, dtype=torch.int32),
                    torch.full((R,), n, dtype=torch.int32)]
            lse = torch.empty(q.shape[:2])
            out = kernels.paged_attention(q.contiguous(), cache, pages.int()[None], *ints,
                                          scale, lse)
            return out, lse
        kv = cache.index_select(0, pages.to(cache.device))
        keys = kv[:, 0].reshape(-1, *cache.shape[3:]).to(q.dtype)
        values = kv[:, 1].reshape(-1, *cache.shape[3:]).to(q.dtype)
        return partial_attention(q, keys, values, scale)

    def drop(self, req_id: str) -> int:
        """The debtor's request left: free its blocks here; returns how many pages."""
        shards = self.shards.pop(req_id, [])
        addrs = [a for s in shards for a in s.addrs]
        self.mempool.free_mem(addrs)
        return len(addrs)

    def drop_debtor(self, debtor: str) -> int:
        """A debtor instance died: free every block its requests lent here."""
        gone = [r for r, ss in self.shards.items() if any(s.debtor == debtor for s in ss)]
        return sum(self.drop(r) for r in gone)

    def entries(self) -> dict[str, int]:
        """Per debtor request, the blocks held here (the paper's placement entries)."""
        kv = self.engine.kv
        n_full = max(1, len(kv.full_specs()))
        return {r: sum(len(s.addrs) for s in ss) // n_full for r, ss in self.shards.items()}


class Creditor(Protocol):
    """How a debtor reaches one creditor's ShardStore."""

    name: str

    def try_move_kvcache(self, req_id: str, num_blocks: int, debtor: str = "") -> bool: ...
    def store(self, req_id: str, data: dict[str, torch.Tensor]) -> None: ...
    def attend(self, req_id: str, index: int, q: torch.Tensor) -> Callable[[], Partial]: ...
    def drop(self, req_id: str) -> None: ...


class LocalCreditor:
    """A creditor in this process (tests, and one machine without Ray)."""

    def __init__(self, name: str, store: ShardStore) -> None:
        self.name, self.shards = name, store

    def try_move_kvcache(self, req_id: str, num_blocks: int, debtor: str = "") -> bool:
        return self.shards.try_move_kvcache(req_id, num_blocks, debtor)

    def store(self, req_id: str, data: dict[str, torch.Tensor]) -> None:
        self.shards.store(req_id, data)

    def attend(self, req_id: str, index: int, q: torch.Tensor) -> Callable[[], Partial]:
        part = self.shards.attend(req_id, index, q)
        return lambda: part

    def drop(self, req_id: str) -> None:
        self.shards.drop(req_id)


class RayCreditor:
    """A creditor that is another cluster instance, called through Ray."""

    TIMEOUT_S = 30.0  # a creditor that does not answer a reservation in this is skipped

    def __init__(self, name: str, handle: Any) -> None:
        self.name, self.handle = name, handle

    def try_move_kvcache(self, req_id: str, num_blocks: int, debtor: str = "") -> bool:
        try:
            return ray.get(self.handle.try_move_kvcache.remote(req_id, num_blocks, debtor),
                           timeout=self.TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            return False  # dead or busy: the next creditor

    def store(self, req_id: str, data: dict[str, torch.Tensor]) -> None:
        ray.get(self.handle.store_shard.remote(req_id, data), timeout=self.TIMEOUT_S)

    def attend(self, req_id: str, index: int, q: torch.Tensor) -> Callable[[], Partial]:
        ref = self.handle.shard_attention.remote(req_id, index, q)

        def wait() -> Partial:
            try:
                return ray.get(ref)
            except ray.exceptions.RayError as e:
                raise RemoteKVLost(req_id, f"instance {self.name}: {type(e).__name__}") from e
        return wait

    def drop(self, req_id: str) -> None:
        self.handle.drop_shards.remote(req_id)  # a dead creditor holds nothing to free


class _Remote:
    """One request's lent KV: every creditor holding some, attended together."""

    def __init__(self, req_id: str, creditors: Sequence[Creditor]) -> None:
        self.req_id, self.creditors = req_id, list(creditors)

    def attend(self, index: int, q: torch.Tensor) -> Callable[[], list[Partial]]:
        waits = [c.attend(self.req_id, index, q) for c in self.creditors]
        return lambda: [w() for w in waits]


class Debtor:
    """The debtor side: the engine's Lender. `creditors(num_blocks)` names, best first,
    the instances that may take that many blocks now (the gManager's choice)."""

    def __init__(self, engine: LLMEngine,
                 creditors: Callable[[int], Sequence[Creditor]], name: str = "") -> None:
        self.engine, self.name = engine, name
        self.creditors = creditors
        self.lent: dict[str, list[Creditor]] = {}  # request -> creditors, in lending order
        self.moved_bytes = 0

    def make_room(self, num_tokens: int) -> bool:
        kv = self.engine.kv
        running = [r.request_id for r in self.engine.scheduler.running]
        req = max(running, key=kv.lendable_blocks, default=None)
        if req is None or not kv.lendable_blocks(req):
            return False
        n = min(kv.lendable_blocks(req), max(MIN_LEND_BLOCKS, -(-num_tokens // kv.T) + 1))
        return any(self.move(req, n, creditor) for creditor in self.creditors(n))

    def move(self, req: str, num_blocks: int, creditor: Creditor) -> bool:
        """Lend up to num_blocks of req's written, not yet lent blocks to creditor, if it
        reserves them (move_kvcache / try_move_kvcache of the paper's protocol)."""
        kv = self.engine.kv
        if req not in kv.reqs:
            return False
        n = min(num_blocks, kv.lendable_blocks(req))
        if n <= 0 or not creditor.try_move_kvcache(req, n, self.name):
            return False
        try:
            self._move(req, n, creditor)
        except ray.exceptions.RayError:  # died or hung since: nothing changed here
            if creditor not in self.lent.get(req, []):
                creditor.drop(req)  # its reservation, if it still lives
            return False
        return True

    def _move(self, req: str, n: int, creditor: Creditor) -> None:
        """Copy the blocks' rows, hand them over, then let them go here."""
        kv, pool = self.engine.kv, self.engine.mempool.device
        first = kv.lent(req) // kv.T
        tables = kv.block_tables(req)
        data = {}
        for m in kv.full_specs():
            pages = torch.tensor(tables[m.spec.name][first:first + n])
            data[m.spec.name] = pool.pages(m.s).index_select(0, pages.to(pool.device)).cpu()
        creditor.store(req, data)
        kv.lend(req, n)
        self.moved_bytes += sum(t.numel() * t.element_size() for t in data.values())
        holders = self.lent.setdefault(req, [])
        if creditor not in holders:
            holders.append(creditor)

    def remote(self, req_id: str) -> _Remote:
        return _Remote(req_id, self.lent.get(req_id, []))

    def forget(self, req_id: str) -> None:
        for creditor in self.lent.pop(req_id, []):
            creditor.drop(req_id)

