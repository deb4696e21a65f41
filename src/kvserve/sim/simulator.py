"""Replay a trace through the real KVCacheManager and Scheduler, with a roofline clock.

Nothing is computed: each step the engine's own Scheduler picks the batch
against the engine's own memory core (same allocation, eviction, prefix
hits and preemption as a real run), the cost model prices the batch, and
the simulated clock moves on by that time. Requests join the scheduler when
the clock reaches their arrival; when nothing runs the clock jumps to the
next arrival. A conversation's next turn arrives only after the previous
turn's answer (traces.SessionTurns). A step's sampled token is a fixed
synthetic id.

Per step it records the batch (tokens, decode batch size) and, every
`mem_every` steps, the memory core's Stats taken after scheduling, i.e.
the memory the step's forward pass holds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvserve.engine.request import Request, SamplingParams
from kvserve.engine.scheduler import Scheduled, Scheduler
from kvserve.memory import KVCacheManager, Stats
from kvserve.memory.host_tier import HostStats
from kvserve.sim.cost import Budget, Chunk, CostModel, kv_budget
from kvserve.sim.gpus import GPU
from kvserve.sim.models import BF16, Model
from kvserve.sim.traces import OUTPUT_TOKEN, SessionTurns, TokenSynth, TraceRequest


@dataclass
class SimConfig:
    model: Model
    gpu: GPU
    policy: str = "jenga"
    tokens_per_page: int = 16
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's context length
    max_num_batched_tokens: int | None = None  # None: vLLM v0's max(max_model_len, 2048)
    gpu_utilization: float = 0.9
    fp8_weights: bool = False
    kv_dtype_bytes: int = BF16
    tp: int = 1
    enable_caching: bool = True
    mem_every: int = 1  # take the memory core's Stats every N steps (0: never)
    host_bytes: int = 0  # a host tier (MemServe's DRAM pool) of this size; 0: none
    mamba_checkpoint: int = 512  # Mamba states cached every N tokens (vllm_align: its block)
    state_page_multiple: int = 0  # pad Mamba pages to a multiple of this (Model.kv_specs)

    @property
    def model_len(self) -> int:
        return min(self.max_model_len or self.model.max_len, self.model.max_len)

    @property
    def batched_tokens(self) -> int:
        # Without chunked prefill vLLM v0 sets the budget to max(max_model_len, 2048),
        # so a whole prompt runs in one step.
        return self.max_num_batched_tokens or max(self.model_len, 2048)

    def budget(self) -> Budget:
        return kv_budget(self.model, self.gpu, fp8_weights=self.fp8_weights,
                         max_num_batched_tokens=self.batched_tokens,
                         max_num_seqs=self.max_num_seqs, utilization=self.gpu_utilization,
                         tp=self.tp)


@dataclass
class RequestRecord:
    id: str
    arrival: float
    prompt_len: int
    output_len: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    first_token: float | None = None
    finish: float | None = None
    rejected: str | None = None  # why it was never run


@dataclass
class MemSample:
    t: float
    step: int
    stats: Stats


@dataclass
class StepRecord:
    t: float  # clock at the step's start
    dt: float
    tokens: int  # tokens computed
    decode: int  # requests past their prompt (one token each)
    prefill_tokens: int
    running: int
    waiting: int
    memory_bound: bool


@dataclass
class SimResult:
    config: SimConfig
    budget: Budget
    pool_bytes: int
    steps: list[StepRecord] = field(default_factory=list)
    memory: list[MemSample] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)
    preemptions: int = 0
    queried_tokens: int = 0  # the memory core's lookup counters (every admission attempt)
    hit_tokens: int = 0
    host: HostStats | None = None  # the host tier's totals at the end
    swap_seconds: float = 0.0  # step time spent waiting for host-to-device loads

    def realized(self, trace: list[TraceRequest]) -> list[TraceRequest]:
        """trace as this run saw it, in arrival order: a conversation's later turns arrive
        after their previous answers (SessionTurns), so offline bounds replay this order."""
        at = {r.id: r.arrival for r in self.requests}
        return sorted((replace(tr, arrival=at.get(tr.id, tr.arrival)) for tr in trace),
                      key=lambda tr: tr.arrival)

    @property
    def clock(self) -> float:
        return self.steps[-1].t + self.steps[-1].dt if self.steps else 0.0


class OutOfMemory(RuntimeError):
    """The weights and activation reserve leave no KV memory."""


StepHook = Callable[[KVCacheManager, Scheduler, list[Scheduled]], None]
# on_done(record, request (None: rejected on arrival), time): a request finished or was
# rejected; the record says which
DoneHook = Callable[[RequestRecord, Request | None, float], None]


class Simulator:
    def __init__(self, cfg: SimConfig, on_step: StepHook | None = None,
                 on_done: DoneHook | None = None) -> None:
        self.cfg = cfg
        budget = cfg.budget()
        if budget.kv <= 0:
            raise OutOfMemory(
                f"{cfg.model.name} on {cfg.gpu.name} x{cfg.tp}: weights "
                f"{budget.weights / 1e9:.1f} GB + reserve {budget.reserve / 1e9:.1f} GB exceed "
                f"{budget.usable / 1e9:.1f} GB usable; lower --max-model-len or use FP8 / more GPUs"
            )
        self.cost = CostModel(cfg.model, cfg.gpu, fp8_weights=cfg.fp8_weights,
                              kv_dtype_bytes=cfg.kv_dtype_bytes, tp=cfg.tp)
        self.kv = KVCacheManager(
            cfg.model.kv_specs(cfg.kv_dtype_bytes, cfg.mamba_checkpoint,
                               cfg.state_page_multiple),
            budget.kv, cfg.tokens_per_page,
            policy=cfg.policy, enable_caching=cfg.enable_caching,
            host_bytes=cfg.host_bytes, worth_loading=self._worth_loading,
            # kvserve's prefill reads a step's own keys from k and v; the baselines are
            # other engines' allocators (vLLM v0 / v1, the paper's), which page them all.
            window_only=cfg.policy == "jenga",
        )
        self.sched = Scheduler(self.kv, cfg.max_num_seqs, cfg.batched_tokens)
        self._moved = [0, 0]  # bytes copied this step: [device -> host, host -> device]
        self.synth = TokenSynth()
        self.on_step = on_step
        self.on_done = on_done
        self.clock = 0.0
        self.result = SimResult(cfg, budget, self.kv.pool_bytes)
        self._records: dict[str, RequestRecord] = {}
        self._image_tokens: dict[str, int] = {}
        # run()'s arrivals; a cluster drives arrive() itself and keeps its own turns
        self._turns: SessionTurns | None = None
        self._pending: list[tuple[float, int, TraceRequest]] = []  # a heap, by arrival
        self._seq = itertools.count()

    # ------------------------------------------------------------------- run

    def run(self, trace: list[TraceRequest]) -> SimResult:
        self._turns = SessionTurns(trace)
        for tr in self._turns.first:
            self._push(tr)
        pending = self._pending
        while pending or self.busy:
            while pending and pending[0][0] <= self.clock:
                self.arrive(heapq.heappop(pending)[2])
            if not self.busy:
                if pending:
                    self.wait_until(pending[0][0])
                continue
            self.step()
        return self.collect()

    def _push(self, tr: TraceRequest) -> None:
        heapq.heappush(self._pending, (tr.arrival, next(self._seq), tr))

    # An instance of a cluster is driven from outside through the calls below: a shared
    # event clock feeds it requests (arrive) and advances it one step at a time (step).

    @property
    def busy(self) -> bool:
        return self.sched.has_work()

    def wait_until(self, t: float) -> None:
        """Idle until t (a step under way still ends when it ends)."""
        self.clock = max(self.clock, t)

    def step(self) -> float:
        """Run one engine step from the clock; returns its duration."""
        dt = self._step(self.clock)
        self.clock += dt
        return dt

    def collect(self) -> SimResult:
        """The result so far, with the scheduler's and memory core's totals."""
        res = self.result
        res.preemptions = self.sched.num_preemptions
        res.queried_tokens, res.hit_tokens = self.kv.queried_tokens, self.kv.hit_tokens
        res.host = self.kv.stats().host
        return res

    def arrive(self, tr: TraceRequest) -> RequestRecord:
        """tr joins the scheduler (or is rejected, which the record says)."""
        rec = RequestRecord(tr.id, tr.arrival, tr.prompt_len, tr.output_len)
        self.result.requests.append(rec)
        limit = self.cfg.model_len
        if tr.prompt_len >= limit:
            rec.rejected = f"prompt of {tr.prompt_len} tokens >= max_model_len {limit}"
            self._done(rec, None, self.clock)
            return rec
        images = tr.image_inputs()
        # The engine's admission check: the prompt plus one token must fit an empty pool.
        if not self.kv.fits_alone(tr.prompt_len + 1, self.cfg.batched_tokens, images):
            rec.rejected = "needs more KV memory than the pool holds"
            self._done(rec, None, self.clock)
            return rec
        max_tokens = min(tr.output_len, limit - tr.prompt_len)
        req = Request(tr.id, None, self.synth.prompt_ids(tr),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      arrival=tr.arrival, images=images)
        self._records[tr.id] = rec
        self._image_tokens[tr.id] = tr.image_tokens
        self.sched.add(req)
        return rec

    def _forget(self, rid: str) -> None:
        """A request left: its id may come back (a cluster's next stage of it)."""
        del self._records[rid]
        self._image_tokens.pop(rid, None)

    def _done(self, rec: RequestRecord, req: Request | None, now: float) -> None:
        nxt = self._turns.after(rec.id, now) if self._turns is not None else None
        if nxt is not None:
            self._push(nxt)
        if self.on_done is not None:
            self.on_done(rec, req, now)

    def _step(self, clock: float) -> float:
        batch, failed = self.sched.schedule()
        for req in failed:
            rec = self._records[req.request_id]
            self._forget(req.request_id)
            rec.rejected = "could not be scheduled alone"
            self.sched.finish(req)
            self._done(rec, req, clock)
        if not batch:
            if failed:
                return 0.0
            raise RuntimeError("the scheduler returned an empty batch with work left")
        if self.on_step is not None:
            self.on_step(self.kv, self.sched, batch)
        cost = self.cost.step([self._chunk(s) for s in batch])
        load, write = self._swap_times()
        dt = max(cost.seconds + load, write)
        self._record_step(clock, dt, cost.memory_bound, batch)
        sampled = [s.request for s in batch if s.completes_prompt]
        self.sched.commit(batch)
        done = clock + cost.seconds
        for req in sampled:
            self._sample(req, done)
        return dt

    # ------------------------------------------------------------- host tier

    def _swap_times(self) -> tuple[float, float]:
        """Seconds of this step's host-tier copies over PCIe: (loads, write-backs).

        Loads (host to device) precede the forward that reads them: on the
        critical path. Write-backs run on the other direction's copy engine,
        beside the forward, and only cost what outlasts it.
        """
        self._moved = [0, 0]
        if self.kv.flush(self._count) == 0:
            return 0.0, 0.0
        pcie = self.cfg.gpu.pcie_bandwidth * self.cfg.tp
        load = self._moved[1] / pcie
        self.result.swap_seconds += load
        return load, self._moved[0] / pcie

    def _count(self, to_host: bool, s: int, src: list[int], dst: list[int]) -> None:
        self._moved[0 if to_host else 1] += len(src) * self.kv.layout.page_bytes[s]

    def _worth_loading(self, n: int, have: int, could: int, nbytes: int) -> bool:
        """MemServe's Eq. 2: load when moving the bytes beats recomputing the tokens."""
        pcie = self.cfg.gpu.pcie_bandwidth * self.cfg.tp
        saved = (self.cost.step([Chunk(have, n - have, sampled=True)]).seconds
                 - self.cost.step([Chunk(could, n - could, sampled=True)]).seconds)
        return nbytes / pcie <= saved

    def _chunk(self, s: Scheduled) -> Chunk:
        req = s.request
        image_tokens = self._image_tokens.get(req.request_id, 0)
        # The image is encoded (vision tower, cross KV) by the chunk reaching its marker.
        new = sum(im.num_tokens for im in req.images
                  if s.start <= im.offset < s.start + s.num_tokens)
        return Chunk(s.start, s.num_tokens, s.completes_prompt, image_tokens, new)

    def _sample(self, req: Request, now: float) -> None:
        rec = self._records[req.request_id]
        rec.cached_tokens = req.num_cached_tokens  # fixed at its first admission
        if rec.first_token is None:
            rec.first_token = now
        req.token_ids.append(OUTPUT_TOKEN)
        if len(req.output_ids) >= req.params.max_tokens:
            self.sched.finish(req)
            rec.finish = now
            self._forget(req.request_id)
            self._done(rec, req, now)

    def _record_step(self, clock: float, dt: float, memory_bound: bool,
                     batch: list[Scheduled]) -> None:
        res = self.result
        step = len(res.steps)
        decode = sum(1 for s in batch if s.start >= s.request.num_prompt)
        prefill = sum(s.num_tokens for s in batch if s.start < s.request.num_prompt)
        res.steps.append(StepRecord(clock, dt, sum(s.num_tokens for s in batch), decode, prefill,
                                    len(self.sched.running), len(self.sched.waiting),
                                    memory_bound))
        if self.cfg.mem_every and step % self.cfg.mem_every == 0:
            res.memory.append(MemSample(clock, step, self.kv.stats()))


def simulate(trace: list[TraceRequest], cfg: SimConfig,
             on_step: StepHook | None = None) -> SimResult:
    return Simulator(cfg, on_step).run(trace)
