"""A simulated cluster: MemServe's global scheduler and designs over N simulated instances.

Each instance is the single-instance simulator (the real memory core and
scheduler, a roofline clock), driven step by step under one event clock: the
instance whose next step starts earliest runs next, and events (an arrival, a
transfer landing, a request's next stage) run at their time, before any step
that starts at or after it. An instance is thus never ahead of an event it
could see: a request handed to a busy instance joins at its next step, as in a
real engine.

The rest is the real cluster's code, imported: `GlobalScheduler` routes every
request (least-load / session / prompt-tree with Eq. 1, Eq. 2 pulls; its prompt
trees learnt from routing, and exact from the instances' KV events when
`heartbeat_s` is set), `cluster.disagg` names the designs, and each request
goes through a design as `cluster.frontend` runs it:

  colocated      route (and pull) -> generate -> learn prompt + output
  disaggregated  route P (and pull), then D; D's held blocks if it keeps KV;
                 P prefills with max_tokens=1, exports the prompt's KV (less what
                 D holds), deletes it unless it keeps it; the network carries it;
                 D imports it (insert, evictable) and decodes from prompt + first
                 token, recomputing the last partial block; D learns or deletes
                 the finished sequence; pd-caching-3 sends it back to P (off the
                 request's path, on the network's queues)

Transfers are `kv_moves` (the real export plan and insert, bytes from the page
sizes) over `network` (a NIC per instance, bandwidth and latency). A session's
next turn arrives its trace gap (the user's think time) after the previous
turn's answer (MemServe §8.2's causal sessions).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial

from kvserve.cluster.disagg import design
from kvserve.cluster.global_scheduler import GlobalScheduler, Member
from kvserve.cluster.instance import (
    COLOCATED,
    DECODE,
    PREFILL,
    Heartbeat,
    InstanceInfo,
    kv_events,
    longest_prompt,
)
from kvserve.cluster.prompt_tree import block_hashes
from kvserve.engine.request import Request
from kvserve.memory import KVCacheManager
from kvserve.sim.cost import Chunk, CostModel
from kvserve.sim.kv_moves import IndexPool, SimPayload, export, import_
from kvserve.sim.network import Network, NetworkConfig
from kvserve.sim.simulator import RequestRecord, SimConfig, SimResult, Simulator
from kvserve.sim.traces import OUTPUT_TOKEN, SessionTurns, TokenSynth, TraceRequest


@dataclass
class ClusterConfig:
    instance: SimConfig  # every instance's model, GPU and engine settings
    instances: int = 8  # GPUs (instances of tp GPUs each), whatever the design
    prefill: int = 0  # disaggregated designs: prefill instances (0: half); the rest decode
    design: str = "colocated"
    routing: str = "prompt-tree"  # the global scheduler's policy
    network: NetworkConfig = field(default_factory=NetworkConfig)
    heartbeat_s: float = 0.0  # exact KV events every s of simulated time (0: learn only)
    ttl: float = 120.0  # prompt-tree entries learnt from routing live this long
    imbalance: int = 4  # prompt-tree: within this many requests of the least loaded
    causal: bool = True  # a session's turn waits for the previous turn's answer

    def roles(self) -> list[tuple[str, str]]:
        """(name, role) of every instance."""
        if not design(self.design).disaggregated:
            return [(f"c{i}", COLOCATED) for i in range(self.instances)]
        p = self.prefill or self.instances // 2
        if not 0 < p < self.instances:
            raise ValueError(f"{self.instances} instances cannot have {p} prefill instances "
                             "and at least one decode instance")
        return ([(f"p{i}", PREFILL) for i in range(p)]
                + [(f"d{i}", DECODE) for i in range(self.instances - p)])


@dataclass
class Job:
    """One request as the front end sees it."""

    tr: TraceRequest
    arrival: float  # at the front end (a session's turn: after the previous answer)
    max_tokens: int
    prefill: str = ""  # the instance that prefilled it (colocated: that ran it)
    decode: str = ""
    cached_tokens: int = 0  # prompt tokens the prefill found cached
    decode_cached: int = 0  # tokens the decode instance found cached (imported or kept)
    prompt_bytes: int = 0  # KV bytes P sent D for it
    first_token: float | None = None
    finish: float | None = None
    rejected: str | None = None
    prompt: list[int] = field(default_factory=list, repr=False)
    hashes: list[Hashable] = field(default_factory=list, repr=False)

    @property
    def id(self) -> str:
        return self.tr.id


@dataclass
class ClusterResult:
    config: ClusterConfig
    jobs: list[Job]
    instances: dict[str, tuple[str, SimResult]]  # name -> (role, its simulator's result)
    network: Network
    clock: float  # when the last event or step ended


# what follows a stage on an instance: (its record, the request's tokens at the end, time)
Then = Callable[[RequestRecord, list[int], float], None]


class Node:
    """One simulated instance: its simulator, a MemPool over its memory core, and the
    global scheduler's Member for it."""

    def __init__(self, name: str, role: str, cfg: SimConfig,
                 on_done: Callable[[Node, RequestRecord, Request | None, float], None]) -> None:
        self.sim = Simulator(cfg, on_done=lambda rec, req, now: on_done(self, rec, req, now))
        self.pool = IndexPool(self.sim.kv)
        kv = self.sim.kv
        info = InstanceInfo(name, role, kv.T, cfg.model_len, cfg.model.vocab, cfg.model.name,
                            sum(kv.layout.page_bytes) / kv.T,
                            longest_prompt(kv, cfg.model_len, cfg.batched_tokens))
        self.member = Member(info, None)
        self.known: dict[str, set[Hashable]] = {}  # cached keys the last heartbeat told

    @property
    def name(self) -> str:
        return self.member.name


class PrefillTime:
    """exec(x, y) for the global scheduler: the instances' roofline time of the prefill
    (what engine.cost_model.RooflineOp predicts), memoised: Eq. 1 sums it over every
    request in flight at every routing."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._memo: dict[tuple[float, float], float] = {}

    def exec(self, x: float, y: float) -> float:
        t = self._memo.get((x, y))
        if t is None:
            n = max(1, round(x))
            cached = min(round(n * y), n - 1)  # a prefill computes at least its last token
            t = self.cost.step([Chunk(cached, n - cached, sampled=True)]).seconds
            self._memo[(x, y)] = t
        return t


class ClusterSim:
    def __init__(self, cfg: ClusterConfig, trace: list[TraceRequest]) -> None:
        if cfg.instance.host_bytes:
            raise ValueError("the cluster simulator has no host tier")
        self.cfg, self.design = cfg, design(cfg.design)
        self.nodes = {name: Node(name, role, cfg.instance, self._stage_done)
                      for name, role in cfg.roles()}
        first = next(iter(self.nodes.values()))
        self.block = first.member.info.block
        self.sched = GlobalScheduler(
            cfg.routing, ttl=cfg.ttl, events=cfg.heartbeat_s > 0, imbalance=cfg.imbalance,
            cost=PrefillTime(first.sim.cost), bandwidth=cfg.network.bandwidth,  # type: ignore[arg-type]
            transfer_latency_s=cfg.network.latency)
        for node in self.nodes.values():
            self.sched.add(node.member)
        self.net = Network(cfg.network)
        self.jobs: list[Job] = []
        self.synth = TokenSynth()
        self.clock = 0.0
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self._stages: dict[tuple[str, str], Then] = {}  # (instance, request) -> what next
        self._load(trace)
        if cfg.heartbeat_s > 0:
            self._at(cfg.heartbeat_s, self._beat)

    # ----------------------------------------------------------- event loop

    def run(self) -> ClusterResult:
        nodes = list(self.nodes.values())
        while True:
            busy = [n for n in nodes if n.sim.busy]
            node = min(busy, key=lambda n: n.sim.clock) if busy else None
            if self._events and (node is None or self._events[0][0] <= node.sim.clock):
                t, _, fn = heapq.heappop(self._events)
                self.clock = max(self.clock, t)
                fn(t)
            elif node is not None:
                node.sim.step()
                self.clock = max(self.clock, node.sim.clock)
            else:
                break
        return ClusterResult(self.cfg, self.jobs,
                             {n.name: (n.member.info.role, n.sim.collect()) for n in nodes},
                             self.net, self.clock)

    def _at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def _load(self, trace: list[TraceRequest]) -> None:
        """Arrivals at their trace times; a session's later turns wait for its answers."""
        for tr in trace:
            if tr.images:
                raise ValueError(f"request {tr.id!r} has images: the cluster simulator "
                                 "takes text requests")
        self._turns = SessionTurns(trace, self.cfg.causal)
        for tr in self._turns.first:
            self._at(tr.arrival, partial(self._arrive, tr))

    def _next_turn(self, job: Job, now: float) -> None:
        nxt = self._turns.after(job.tr.id, now)
        if nxt is not None:
            self._at(nxt.arrival, partial(self._arrive, nxt))

    # -------------------------------------------------------------- routing

    def _arrive(self, tr: TraceRequest, now: float) -> None:
        prompt = self.synth.prompt_ids(tr)
        limit = self.cfg.instance.model_len
        job = Job(tr, now, max(1, min(tr.output_len, limit - len(prompt))), prompt=prompt,
                  hashes=block_hashes(prompt, self.block))
        self.jobs.append(job)
        if self.design.disaggregated:
            self._route(PREFILL, job, now, partial(self._route_decode, job))
        else:
            self._route(COLOCATED, job, now, partial(self._generate, job))

    def _route(self, role: str, job: Job, now: float,
               then: Callable[[Node, int, float], None], pull: bool = True) -> None:
        """The scheduler's choice, then `then(node, cached blocks, time)`; under
        prompt-tree a longer prefix elsewhere is pulled first when Eq. 2 says so."""
        n = len(job.prompt)
        m, cached = self.sched.choose(role, job.hashes, n, now, job.tr.session)
        node = self.nodes[m.name]
        if pull and self.sched.policy == "prompt-tree":
            plan = self.sched.plan_pull(role, m, job.hashes, n, now)
            if plan is not None:
                tokens = job.prompt[:plan.blocks * self.block]
                self._move("pull", self.nodes[plan.source.name], node, tokens, now,
                           lambda t: then(node, plan.blocks, t))
                return
        then(node, cached, now)

    def _move(self, kind: str, src: Node, dst: Node, tokens: list[int], now: float,
              then: Callable[[float], None] | None = None) -> None:
        """transfer_with_insert of src's cached KV of tokens, less what dst holds."""
        payload = export(src.pool, tokens, held(dst.sim.kv, tokens))
        src.member.sent_bytes += payload.nbytes

        def land(t: float) -> None:
            self._import(dst, payload)
            self.sched.learn(dst.member, tokens, t)
            if then is not None:
                then(t)
        self._at(self._send(kind, src, dst, payload.nbytes, now), land)

    def _send(self, kind: str, src: Node, dst: Node, nbytes: int, now: float) -> float:
        """Queue a transfer on the network; the scheduler sees it queued until it lands."""
        landed = self.net.send(kind, src.name, dst.name, nbytes, now)
        self.sched.transfer(src.member, dst.member, nbytes)
        self._at(landed, lambda t: self.sched.transfer(src.member, dst.member, -nbytes))
        return landed

    def _import(self, dst: Node, payload: SimPayload) -> int:
        n = import_(dst.pool, payload)
        if n:
            dst.member.received_bytes += payload.nbytes
        return n

    # ------------------------------------------------------------- stages

    def _submit(self, node: Node, job: Job, tokens: list[int], max_tokens: int,
                now: float, then: Then) -> None:
        """A stage of job starts on node at `now`; `then` runs when it ends."""
        self._stages[(node.name, job.id)] = then
        node.sim.wait_until(now)  # an idle instance starts now; a busy one after its step
        node.sim.arrive(TraceRequest(job.id, now, max_tokens, prompt_ids=tokens))

    def _stage_done(self, node: Node, rec: RequestRecord, req: Request | None,
                    now: float) -> None:
        """An instance finished (or refused) a stage. Called inside its step: what
        follows runs as an event at `now`, between steps as in the real front end."""
        then = self._stages.pop((node.name, rec.id))
        tokens = list(req.token_ids) if req is not None else []
        self._at(now, lambda t: then(rec, tokens, t))

    def _generate(self, job: Job, node: Node, cached: int, now: float) -> None:
        """Colocated: one instance prefills and decodes."""
        job.prefill = node.name
        self.sched.started(node.member, job.id, len(job.prompt), cached)
        self._submit(node, job, job.prompt, job.max_tokens, now,
                     partial(self._generated, job, node))

    def _generated(self, job: Job, node: Node, rec: RequestRecord, tokens: list[int],
                   now: float) -> None:
        self.sched.done(node.member, job.id)
        if rec.rejected is not None:
            return self._end(job, now, rec.rejected)
        job.cached_tokens, job.first_token = rec.cached_tokens, rec.first_token
        self.sched.learn(node.member, tokens, now)
        self._end(job, now)

    def _route_decode(self, job: Job, p: Node, cached: int, now: float) -> None:
        """Disaggregated: P is chosen (and pulled into); now D, then P's prefill."""
        job.prefill = p.name
        self._route(DECODE, job, now, partial(self._prefill, job, p, cached), pull=False)

    def _prefill(self, job: Job, p: Node, cached: int, d: Node, _: int, now: float) -> None:
        job.decode = d.name
        have = held(d.sim.kv, job.prompt) if self.design.keep_at_decode else None
        self.sched.started(p.member, job.id, len(job.prompt), cached)
        self._submit(p, job, job.prompt, 1, now, partial(self._prefilled, job, p, d, have))

    def _prefilled(self, job: Job, p: Node, d: Node, have: dict[str, set[int]] | None,
                   rec: RequestRecord, tokens: list[int], now: float) -> None:
        self.sched.done(p.member, job.id)
        if rec.rejected is not None:
            return self._end(job, now, rec.rejected)
        job.cached_tokens, job.first_token = rec.cached_tokens, rec.first_token
        if self.design.keep_at_prefill:
            self.sched.learn(p.member, job.prompt, now)
        payload = None if job.max_tokens <= 1 else export(p.pool, job.prompt, have)
        if not self.design.keep_at_prefill:
            p.sim.kv.delete(job.prompt)
        if payload is None:  # the first token was all it asked for
            return self._end(job, now)
        job.prompt_bytes = payload.nbytes
        p.member.sent_bytes += payload.nbytes
        landed = self._send("prompt", p, d, payload.nbytes, now)
        self._at(landed, partial(self._decode, job, p, d, payload))

    def _decode(self, job: Job, p: Node, d: Node, payload: SimPayload, now: float) -> None:
        self._import(d, payload)
        self.sched.started(d.member, job.id, 1, 1)
        self._submit(d, job, job.prompt + [OUTPUT_TOKEN], job.max_tokens - 1, now,
                     partial(self._decoded, job, p, d))

    def _decoded(self, job: Job, p: Node, d: Node, rec: RequestRecord, tokens: list[int],
                 now: float) -> None:
        self.sched.done(d.member, job.id)
        if rec.rejected is not None:
            return self._end(job, now, rec.rejected)
        job.decode_cached = rec.cached_tokens
        if self.design.keep_at_decode:
            self.sched.learn(d.member, tokens, now)
        else:
            d.sim.kv.delete(tokens)
        if self.design.return_to_prefill:
            self._move("return", d, p, tokens, now)
        self._end(job, now)

    def _end(self, job: Job, now: float, rejected: str | None = None) -> None:
        if rejected is None:
            job.finish = now
        else:
            job.rejected = rejected
        job.prompt, job.hashes = [], []  # tens of thousands of prompts add up
        self._next_turn(job, now)

    # ------------------------------------------------------------ heartbeat

    def _beat(self, now: float) -> None:
        """Every instance's load and KV events, as the front end's heartbeat polls them."""
        for node in self.nodes.values():
            s = node.sim.sched
            hb = Heartbeat(node.name, len(s.running), len(s.waiting),
                           sent_bytes=node.member.sent_bytes,
                           received_bytes=node.member.received_bytes)
            node.known = kv_events(hb, node.sim.kv, node.known)
            self.sched.heartbeat(hb)
        for tree in self.sched.trees.values():
            tree.expire(now)
        if self._events or any(n.sim.busy for n in self.nodes.values()):
            self._at(now + self.cfg.heartbeat_s, self._beat)


def simulate_cluster(trace: list[TraceRequest], cfg: ClusterConfig) -> ClusterResult:
    return ClusterSim(cfg, trace).run()


def held(kv: KVCacheManager, tokens: list[int]) -> dict[str, set[int]]:
    """The blocks a receiver holds, as the real instance's `held` reports them. Not pinned:
    the simulator does not model the real instance's lease, so a block evicted before the
    request reaches the receiver is recomputed there (pessimistic for the caching designs)."""
    have, pins = kv.hold(tokens)
    kv.release(pins)
    return have
