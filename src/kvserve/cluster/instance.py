"""One engine instance of a cluster: an LLMEngine on its engine thread, as a Ray actor.

The front end calls it through Ray (no other RPC): `generate` streams a request's
outputs (a Ray streaming generator; cancelling it aborts the request), `prefill`
and `decode` are the two halves of a disaggregated request, `export_kv` /
`import_kv` move cached KV (transfer_with_insert), `poll` is the heartbeat: load
and KV events. Everything that touches the engine runs on its engine thread
(EngineLoop.call), between steps.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass, field

import torch

from kvserve.cluster.distattn import Debtor, RayCreditor, ShardStore
from kvserve.cluster.placement import InstanceLoad, RequestPlacementEntry
from kvserve.cluster.transfer import KVPayload, ObjectStoreTransport, export_kv, import_kv
from kvserve.engine.engine import KV_LOST, LLMEngine
from kvserve.engine.request import RequestOutput
from kvserve.memory import KVCacheManager
from kvserve.models.dist_attention import Partial, RemoteKVLost
from kvserve.server.engine_loop import EngineLoop, Submission
from kvserve.server.metrics import EngineSnapshot

PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"
LEASE_S = 60.0  # pages held for a transfer whose sender went silent are unpinned after this
ROLES = (PREFILL, DECODE, COLOCATED)


@dataclass
class InstanceInfo:
    name: str
    role: str
    block: int  # tokens per page: the block size of the prefix-cache keys
    max_model_len: int
    vocab_size: int
    model: str
    kv_bytes_per_token: float  # every spec's page bytes over its tokens: what a prefix moves
    max_prompt: int  # the longest prompt the pool can hold alone
    lend_tokens: int = 0  # tokens of full-attention KV it lends others at most (DistAttention)


@dataclass
class Heartbeat:
    """An instance's load and KV events since its last heartbeat (vLLM's KV events in
    content: blocks stored / removed per medium; here per tier)."""

    name: str
    running: int
    waiting: int
    stored: dict[str, list[Hashable]] = field(default_factory=dict)  # tier -> block keys
    removed: dict[str, list[Hashable]] = field(default_factory=dict)
    gone: list[Hashable] = field(default_factory=list)  # left every tier
    sent_bytes: int = 0  # KV bytes exported / imported so far
    received_bytes: int = 0
    lent: dict[str, int] = field(default_factory=dict)  # request -> blocks held for others
    lent_out_bytes: int = 0  # KV bytes its own requests lent to others so far
    # Infinite-LLM's rManager report: load in full-attention blocks, the placement entries
    # changed since the last heartbeat, and new decode-step samples for the perf model
    load: InstanceLoad | None = None
    entries: list[RequestPlacementEntry] = field(default_factory=list)
    samples: list[tuple[int, int, float]] = field(default_factory=list)


class Instance:
    def __init__(self, name: str, role: str, build: Callable[[], LLMEngine],
                 threads: int | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; choose from {ROLES}")
        if threads:
            torch.set_num_threads(threads)  # N instances on one machine share its cores
        self.name, self.role = name, role
        self.engine = build()
        if self.engine.mempool is None:
            raise ValueError("cluster instances need the paged KV backend (a MemPool)")
        self.loop = EngineLoop(self.engine)
        self.loop.start()
        self.transport = ObjectStoreTransport()
        self._known: dict[str, set[Hashable]] = {}  # cached keys the last heartbeat told
        self._leases: dict[str, tuple[float, list[tuple[int, int]]]] = {}  # pins for senders
        self.sent_bytes = self.received_bytes = 0
        self.shards = ShardStore(self.engine)  # DistAttention: others' KV lent to this one
        self.peers: dict[str, RayCreditor] = {}
        self.creditor_order: list[str] = []  # the front end's ranking, most room first
        self._placed: dict[str, tuple[int, bool]] = {}  # entries the last heartbeat told

    def info(self) -> InstanceInfo:
        e = self.engine
        per_token = sum(e.kv.layout.page_bytes) / e.kv.T
        full = e.kv.full_block_bytes() / e.kv.T
        return InstanceInfo(self.name, self.role, e.kv.T, e.max_model_len,
                            e.config.vocab_size, str(e.cfg.model or "gemma-3-270m"), per_token,
                            self._max_prompt(), int(self.shards.limit / full) if full else 0)

    def _max_prompt(self) -> int:
        e = self.engine
        return longest_prompt(e.kv, e.max_model_len, e.cfg.max_num_batched_tokens)

    def tokenizer(self) -> object:
        return self.engine.tokenizer

    # -------------------------------------------------------------- requests

    async def generate(self, sub: Submission,
                       before: Callable[[LLMEngine], object] | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        group = await self.loop.add([sub], time.monotonic(), before)
        async for _, out in group.outputs():
            if out.finished and out.outputs[0].stop_reason == KV_LOST:
                raise RemoteKVLost(sub.request_id)  # the front end starts it again
            yield out

    async def prefill(self, sub: Submission, have: dict[str, set[int]] | None,
                      keep: bool) -> tuple[RequestOutput, object | None]:
        """Run the prompt and sample the first token; returns that output and, when the
        request goes on, a handle on its prompt's KV (less the blocks in `have`)."""
        first = dataclasses.replace(sub, params=dataclasses.replace(sub.params, max_tokens=1))
        out = None
        async for o in self.generate(first):
            out = o
        prompt = sub.prompt_token_ids
        handle = None
        if not finished_early(out, sub):
            payload = await self.loop.call(lambda: self._export(prompt, have))
            handle = self.transport.send(payload)
        if not keep:
            await self.loop.call(lambda: self.engine.kv.delete(prompt))
        return out, handle

    async def decode(self, sub: Submission, handle: object | None,
                     keep: bool) -> AsyncIterator[RequestOutput]:
        """Continue a request a prefill instance started: import its KV, then generate."""
        payload = None if handle is None else self.transport.receive(handle)
        before = None if payload is None else (lambda e: self._import(payload))
        lease, out = sub.request_id, None
        try:
            async for out in self.generate(sub, before):
                if lease is not None:  # its first token: the lookup took the held pages
                    await self.loop.call(functools.partial(self._release, lease))
                    lease = None
                yield out
        finally:
            if lease is not None:
                await self.loop.call(functools.partial(self._release, lease))
            if not keep:
                tokens = sub.prompt_token_ids + (out.outputs[0].token_ids if out else [])
                await self.loop.call(lambda: self.engine.kv.delete(tokens))

    # -------------------------------------------------------------------- KV

    async def held(self, tokens: list[int], lease: str) -> dict[str, set[int]]:
        """Per spec, the full blocks of tokens this instance caches (a sender skips them),
        pinned under `lease` until the transfer's request has taken them (decode) or the
        import is done (import_kv), or LEASE_S passed (the sender died)."""
        def hold() -> dict[str, set[int]]:
            have, pins = self.engine.kv.hold(tokens)
            self._release(lease)
            self._leases[lease] = (time.monotonic(), pins)
            return have
        return await self.loop.call(hold)

    def _release(self, lease: str | None) -> None:
        """Engine thread: unpin a lease's pages (a lease unknown or released: nothing)."""
        taken = self._leases.pop(lease, None) if lease is not None else None
        if taken is not None:
            self.engine.kv.release(taken[1])

    def _expire_leases(self) -> None:
        old = [k for k, (t, _) in self._leases.items() if time.monotonic() - t > LEASE_S]
        for k in old:
            self._release(k)

    async def export_kv(self, tokens: list[int], have: dict[str, set[int]] | None = None,
                        ) -> object:
        return self.transport.send(await self.loop.call(lambda: self._export(tokens, have)))

    async def import_kv(self, handle: object, lease: str | None = None) -> int:
        """Insert a payload into the cache; the lease `held` took for it ends."""
        payload = self.transport.receive(handle)

        def run() -> int:
            try:
                return self._import(payload)
            finally:
                self._release(lease)
        return await self.loop.call(run)

    def _export(self, tokens: list[int], have: dict[str, set[int]] | None) -> KVPayload:
        payload = export_kv(self.engine.mempool, tokens, have)
        self.sent_bytes += payload.nbytes
        return payload

    def _import(self, payload: KVPayload) -> int:
        n = import_kv(self.engine.mempool, payload)
        if n:
            self.received_bytes += payload.nbytes
        return n

    # ---------------------------------------------------------- DistAttention

    def set_peers(self, peers: dict[str, object], lend: bool = True) -> None:
        """The other instances (Ray handles); with `lend`, a full pool lends running
        requests' KV to them (Infinite-LLM) instead of preempting."""
        self.peers = {n: RayCreditor(n, h) for n, h in peers.items() if n != self.name}
        if lend and self.engine.lender is None:
            self.engine.lend_with(Debtor(self.engine, self._creditors, self.name))

    def set_creditors(self, order: list[str]) -> None:
        self.creditor_order = order

    def _creditors(self, num_blocks: int) -> list[RayCreditor]:
        """Peers in the front end's order (most room first), then any it did not rank."""
        ranked = [n for n in self.creditor_order if n in self.peers]
        return [self.peers[n] for n in ranked + sorted(set(self.peers) - set(ranked))]

    async def move_kvcache(self, req_id: str, num_blocks: int, dst: str) -> bool:
        """The gManager's instruction: lend num_blocks more of a request's KV to dst (it
        may refuse: the map it planned on was stale)."""
        lender = self.engine.lender
        if not isinstance(lender, Debtor) or dst not in self.peers:
            return False
        return await self.loop.call(lambda: lender.move(req_id, num_blocks, self.peers[dst]))

    async def try_move_kvcache(self, req_id: str, num_blocks: int, debtor: str = "") -> bool:
        return await self.loop.call(
            lambda: self.shards.try_move_kvcache(req_id, num_blocks, debtor))

    async def store_shard(self, req_id: str, data: dict) -> None:
        await self.loop.call(lambda: self.shards.store(req_id, data))

    def shard_attention(self, req_id: str, index: int, q: torch.Tensor) -> Partial:
        """Beside the engine's steps: it reads only pages lent to this request."""
        return self.shards.attend(req_id, index, q)

    async def drop_shards(self, req_id: str) -> int:
        return await self.loop.call(lambda: self.shards.drop(req_id))

    async def drop_debtor(self, name: str) -> int:
        """Instance `name` died: free every block its requests lent here."""
        return await self.loop.call(lambda: self.shards.drop_debtor(name))

    # ------------------------------------------------------------ heartbeat

    async def poll(self) -> Heartbeat:
        return await self.loop.call(self._heartbeat)

    def _heartbeat(self) -> Heartbeat:
        self._expire_leases()
        e = self.engine
        hb = Heartbeat(self.name, len(e.scheduler.running), len(e.scheduler.waiting),
                       sent_bytes=self.sent_bytes, received_bytes=self.received_bytes,
                       lent=self.shards.entries(),
                       lent_out_bytes=getattr(e.lender, "moved_bytes", 0))
        self._known = kv_events(hb, e.kv, self._known)
        self._report_placement(hb)
        return hb

    def _report_placement(self, hb: Heartbeat) -> None:
        """The rManager's heartbeat: load and changed entries in full-attention blocks."""
        kv = self.engine.kv
        block = kv.full_block_bytes()
        if not block:
            return
        waiting = self.engine.scheduler.waiting
        hb.load = InstanceLoad(self.name, len(self.engine.scheduler.running),
                               (kv.pool_bytes - kv.stats().used) // block,
                               kv.pool_bytes // block, len(waiting),
                               sum(-(-len(r.token_ids) // kv.T) for r in waiting))
        now = {r.request_id: (kv.lendable_blocks(r.request_id), True)
               for r in self.engine.scheduler.running}
        now.update({r: (n, False) for r, n in hb.lent.items()})
        hb.entries = [RequestPlacementEntry(r, self.name, n, local)
                      for r, (n, local) in now.items() if self._placed.get(r) != (n, local)]
        hb.entries += [RequestPlacementEntry(r, self.name, 0, local)
                       for r, (_, local) in self._placed.items() if r not in now]
        self._placed = now
        hb.samples = list(self.engine.step_samples)  # each reported once
        self.engine.step_samples.clear()

    async def snapshot(self) -> EngineSnapshot:
        return await self.loop.snapshot()

    def ping(self) -> str:
        return self.name


def longest_prompt(kv: KVCacheManager, max_model_len: int, chunk: int) -> int:
    """Bisect the longest prompt an engine accepts (KV pool and context length)."""
    lo, hi = 0, max_model_len - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if kv.fits_alone(mid + 1, chunk):
            lo = mid
        else:
            hi = mid - 1
    return lo


def kv_events(hb: Heartbeat, kv: KVCacheManager,
              known: dict[str, set[Hashable]]) -> dict[str, set[Hashable]]:
    """Fill hb's KV events: the cached keys per tier against `known` (what the last
    heartbeat told). Returns the keys to know for the next one."""
    now = kv.cached_keys()
    for tier, keys in now.items():
        old = known.get(tier, set())
        hb.stored[tier] = list(keys - old)
        hb.removed[tier] = list(old - keys)
    held = set().union(*now.values())
    hb.gone = [h for keys in hb.removed.values() for h in keys if h not in held]
    return now


def finished_early(out: RequestOutput | None, sub: Submission) -> bool:
    """Whether the prefill's one token ended the request (a stop, or all it asked for)."""
    if out is None or out.outputs[0].finish_reason != "length":
        return True
    return sub.params.max_tokens <= 1
