"""Infinite-LLM (DistAttention + gManager) against static instances, on simulated GPUs.

Three systems over the same GPUs and trace (the paper's §7 comparison):

  infinite  N instances of one model; a request's full-attention KV may be spread
            over several of them. Its home instance (the debtor) runs the
            non-attention layers and the attention over the blocks it holds; each
            creditor computes the attention over the blocks it holds (its own step
            grows by that, Eq. 6) and the debtor's step waits for the slowest shard
            plus a query/partial round trip. The gManager (kvserve.cluster.placement)
            sees the instances through heartbeats every `heartbeat_s` and plans moves
            (Algorithm 1); a debtor whose pool runs out moves blocks at once to the
            creditors the gManager names (forced moves, checked against the
            creditor's real free space as try_move_kvcache does).
  multi     vLLM-M: the same N instances, no spreading; a request longer than one
            instance's pool is rejected on arrival.
  single    vLLM-S: one instance over all N GPUs: tensor parallel inside a node
            (an all-reduce per layer twice, over NVLink) and pipeline stages across
            nodes (a hop per stage boundary over the network).

Hybrid-aware: only the full-attention layers' KV is spread and moved; sliding-
window state is bounded per request and stays home. `hybrid=False` treats every
attention layer as full (what a Llama-only design would store and move).

The clock is the roofline of kvserve.sim.cost (the same bytes and FLOPs per token);
the instances keep block-level accounting rather than the real memory core, which
has no notion of a request's blocks living on another instance. Requests are
dispatched to the instance with the most free memory (the paper's policy for
infinite and multi); scheduling is vLLM's continuous batching with chunked
prefill: decodes first, then prompt chunks up to `chunk_tokens` per step.
Preemption (multi, single; infinite when no creditor has room) drops the newest
running request's KV and recomputes it later, as vLLM does.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from kvserve.cluster.placement import (
    GManager,
    InstanceLoad,
    PerfModel,
    RequestPlacementEntry,
    spread_layers,
)
from kvserve.sim.cost import CostModel, kv_budget
from kvserve.sim.gpus import GPU
from kvserve.sim.models import Model
from kvserve.sim.network import Network, NetworkConfig
from kvserve.sim.traces import TraceRequest

MODES = ("infinite", "multi", "single")
NVLINK = 450e9  # bytes/s each way per H100 SXM (NVLink 4: 900 GB/s both ways)


@dataclass
class DistConfig:
    model: Model
    gpu: GPU
    gpus: int = 8  # all GPUs; infinite and multi run one instance per GPU
    mode: str = "infinite"
    hybrid: bool = True  # spread only full-attention KV (False: every attention layer)
    tokens_per_block: int = 16
    max_num_seqs: int = 256
    chunk_tokens: int = 8192  # prompt tokens per step (chunked prefill)
    gpu_utilization: float = 0.9
    gpus_per_node: int = 8
    heartbeat_s: float = 0.05
    beta_thres: int = 64
    util_thres: float = 0.7
    move_blocks: int = 1024  # a forced move takes at least this many blocks
    balance_prefill: bool = True  # spread a long prompt's blocks evenly (see _low_water)
    stall_limit_s: float = 120.0  # no instance stepped this long: the stalled request is dropped
    rtt_s: float = 30e-6  # query out, partial result (two floats per head) back
    network: NetworkConfig = field(default_factory=NetworkConfig)  # across nodes
    nvlink: float = NVLINK  # within a node: moves and TP all-reduces
    # One NCCL all-reduce's fixed cost over 8 NVLinked GPUs (the ring's bytes come on
    # top). 11 us makes a TP-8 instance's non-attention throughput per GPU a third of
    # one GPU's at batch 256 (Llama 3.1 8B), as Infinite-LLM's Fig. 1(c) measured;
    # nccl-tests report 10-20 us at small sizes. The roofline alone has no such loss.
    allreduce_latency_s: float = 11e-6
    # A pipeline stage's activations to the next node (RDMA send/recv): not the
    # network's per-transfer set-up, which models KV moves with their metadata.
    pp_hop_latency_s: float = 20e-6

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: choose from {MODES}")


# ------------------------------------------------------------------ pricing


class Pricer:
    """Roofline step time of one instance of tp x pp GPUs (kvserve.sim.cost's rule:
    max(bytes / bandwidth, FLOPs / peak)), plus TP all-reduces and PP hops."""

    def __init__(self, cfg: DistConfig, tp: int = 1, pp: int = 1) -> None:
        self.cfg, self.tp, self.pp = cfg, tp, pp
        m = cfg.model
        self.cost = CostModel(m, cfg.gpu)  # one GPU; scaled below
        self.full, _ = spread_layers(m, hybrid=True)
        self.sliding = [(g.layers, g.window or g.chunk) for g in m.attention_groups()
                        if g.window or g.chunk]
        self.qk_pv = 4.0 * m.heads * m.head_dim

    def attn(self, queries: int, keys: int, layers: int) -> tuple[float, float]:
        """(bytes, FLOPs) of `queries` new tokens attending `keys` earlier ones in
        `layers` layers (causal pairs inside a prompt chunk included)."""
        pairs = queries * keys + queries * (queries + 1) / 2
        nbytes = layers * self.cost.kv_token_bytes * (keys + queries)
        return nbytes, layers * self.qk_pv * pairs

    def bounded(self, queries: int, context: int) -> tuple[float, float]:
        """Sliding-window layers: each query sees at most its window."""
        b = f = 0.0
        for layers, w in self.sliding:
            bb, ff = self.attn(queries, min(context, w), layers)
            b, f = b + bb, f + ff
        return b, f

    def seconds(self, tokens: int, sampled: int, attn_bytes: float, attn_flops: float) -> float:
        gpus = self.tp * self.pp
        m, c, g = self.cfg.model, self.cost, self.cfg.gpu
        mm = (tokens * m.linear_flops_per_token() + sampled * m.lm_head_flops())
        # Every pipeline stage re-reads its weights per micro-batch: weights at tp GPUs'
        # bandwidth; KV and FLOPs spread over all GPUs.
        mem = c._dense_weight_bytes / (g.hbm_bandwidth * self.tp) \
            + attn_bytes / (g.hbm_bandwidth * gpus)
        flop = mm / (g.bf16_flops * gpus) + attn_flops / (g.bf16_flops * gpus)
        return max(mem, flop) + self.comm(tokens)

    def attn_seconds(self, nbytes: float, flops: float) -> float:
        """Attention alone (a creditor's MicroAttention shard)."""
        gpus = self.tp * self.pp
        g = self.cfg.gpu
        return max(nbytes / (g.hbm_bandwidth * gpus), flops / (g.bf16_flops * gpus))

    def comm(self, tokens: int) -> float:
        """TP: two ring all-reduces of the activations per layer; PP: a hop per boundary."""
        t = 0.0
        act = tokens * self.cfg.model.hidden * 2  # bf16 activations
        if self.tp > 1:
            ring = 2 * (self.tp - 1) / self.tp * act / self.cfg.nvlink
            t += 2 * self.cfg.model.num_layers * (self.cfg.allreduce_latency_s + ring)
        if self.pp > 1:
            net = self.cfg.network
            t += (self.pp - 1) * (self.cfg.pp_hop_latency_s + act / self.pp / net.bandwidth)
        return t


# ------------------------------------------------------------------ state


@dataclass
class Req:
    tr: TraceRequest
    home: str = ""
    computed: int = 0  # tokens whose KV exists (prompt progress + generated)
    generated: int = 0
    blocks: dict[str, int] = field(default_factory=dict)  # instance -> full-attn blocks
    state: int = 0  # bounded (sliding) state at home, in blocks
    in_flight: int = 0  # blocks of it being moved
    admitted_seq: int = 0
    first_token: float | None = None
    finish: float | None = None
    rejected: str | None = None
    preempted: int = 0

    @property
    def id(self) -> str:
        return self.tr.id

    @property
    def prompt(self) -> int:
        return self.tr.prompt_len

    @property
    def length(self) -> int:
        return self.tr.prompt_len + self.tr.output_len


@dataclass
class Inst:
    name: str
    node: int
    total: int  # pool, in blocks
    pricer: Pricer
    used: int = 0  # own requests' blocks and state, hosted blocks, reservations
    running: list[Req] = field(default_factory=list)
    waiting: deque[Req] = field(default_factory=deque)
    hosted: dict[str, int] = field(default_factory=dict)  # req -> blocks held for it
    reserved: int = 0  # blocks of moves on their way here (try_move_kvcache said yes)
    pending_bytes: float = 0.0  # attention over hosted blocks since its last step
    pending_flops: float = 0.0
    clock: float = 0.0
    reported: dict[str, tuple[int, bool]] = field(default_factory=dict)  # gManager's view
    steps: int = 0
    busy_s: float = 0.0
    stall_s: float = 0.0  # waiting with work but no memory (moves, other instances)

    @property
    def free(self) -> int:
        return self.total - self.used

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)


@dataclass
class DistResult:
    config: DistConfig
    requests: list[Req]
    instances: list[Inst]
    clock: float
    moved_bytes: int = 0  # KV moved between instances (what was spread)
    all_layer_bytes: int = 0  # the same token ranges, every attention layer's KV
    forced_moves: int = 0
    planned_moves: int = 0
    refused_moves: int = 0  # try_move_kvcache said no (stale view)
    reclaim_moves: int = 0  # a creditor short of memory handed blocks on
    retrieve_moves: int = 0  # a debtor with room took its blocks back
    preemptions: int = 0
    max_spread: int = 0  # most instances one request's KV was on at once
    block_bytes: int = 0
    steps: list[tuple[float, int]] = field(default_factory=list)  # (step end, tokens)

    def tokens_by(self, t: float) -> int:
        """Tokens computed (prompt and output, finished or not) by steps ending by t."""
        return sum(n for end, n in self.steps if end <= t)


# ------------------------------------------------------------------ simulator


class DistSim:
    def __init__(self, cfg: DistConfig, trace: list[TraceRequest]) -> None:
        self.cfg = cfg
        m = cfg.model
        self.full, self.bounded_tokens = spread_layers(m, cfg.hybrid)
        self.kv_tok = kv_tok = CostModel(m, cfg.gpu).kv_token_bytes
        self.block_bytes = cfg.tokens_per_block * self.full * kv_tok
        attn_layers = sum(g.layers for g in m.attention_groups())
        self.all_layer_block = cfg.tokens_per_block * attn_layers * kv_tok
        # bounded layers and their mean window: sliding state stays home
        self.bounded_layers = attn_layers - self.full
        self.insts = self._instances()
        self.by_name = {i.name: i for i in self.insts}
        self.gm = GManager(PerfModel.from_roofline(
            m, cfg.gpu, tokens_per_block=cfg.tokens_per_block, hybrid=cfg.hybrid),
            cfg.beta_thres, cfg.util_thres)
        self.inter = Network(cfg.network)
        self.intra = Network(NetworkConfig(cfg.nvlink, cfg.network.latency / 10))
        self.reqs = [Req(tr) for tr in sorted(trace, key=lambda r: r.arrival)]
        self.res = DistResult(cfg, self.reqs, self.insts, 0.0, block_bytes=self.block_bytes)
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self._homes: dict[str, str] = {}
        self.queue: deque[Req] = deque()  # the front end's, not yet dispatched
        self._progress = 0.0  # when an instance last ran a step
        for r in self.reqs:
            self._at(r.tr.arrival, partial(self._arrive, r))
        if cfg.mode == "infinite":
            self._at(cfg.heartbeat_s, self._beat)

    def _instances(self) -> list[Inst]:
        cfg = self.cfg
        if cfg.mode == "single":
            tp = min(cfg.gpus, cfg.gpus_per_node)
            pp = max(1, cfg.gpus // tp)
            shape = [(tp, pp)]
        else:
            shape = [(1, 1)] * cfg.gpus
        out = []
        for k, (tp, pp) in enumerate(shape):
            budget = kv_budget(cfg.model, cfg.gpu, fp8_weights=False,
                               max_num_batched_tokens=cfg.chunk_tokens,
                               max_num_seqs=cfg.max_num_seqs * pp,
                               utilization=cfg.gpu_utilization, tp=tp * pp)
            if budget.kv <= 0:
                raise ValueError(f"{cfg.model.name} leaves no KV memory on {cfg.gpu.name}")
            out.append(Inst(f"g{k}", k // cfg.gpus_per_node, budget.kv // self.block_bytes,
                            Pricer(cfg, tp, pp)))
        return out

    # ------------------------------------------------------------ event loop

    def run(self) -> DistResult:
        while True:
            busy = [i for i in self.insts if i.busy]
            inst = min(busy, key=lambda i: i.clock) if busy else None
            if self._events and (inst is None or self._events[0][0] <= inst.clock):
                t, _, fn = heapq.heappop(self._events)
                self.res.clock = max(self.res.clock, t)
                fn(t)
            elif inst is not None:
                self._step(inst)
                self.res.clock = max(self.res.clock, inst.clock)
                if self.queue:
                    self._dispatch(inst.clock)
            elif self.queue:  # nothing runs and nothing will: the head never fits
                self.queue.popleft().rejected = "does not fit even an idle cluster"
                self._dispatch(self.res.clock)
            else:
                break
        return self.res

    def _at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def _wake(self, inst: Inst, now: float) -> None:
        if not inst.busy:
            inst.clock = max(inst.clock, now)
            inst.pending_bytes = inst.pending_flops = 0.0  # done while it idled

    # -------------------------------------------------------------- memory

    def _need(self, tokens: int) -> tuple[int, int]:
        """(full-attention blocks, bounded state in blocks) of a request of `tokens`."""
        full = -(-tokens // self.cfg.tokens_per_block)
        if not self.bounded_layers:
            return full, 0
        win = self.bounded_tokens / self.bounded_layers  # the mean window
        state = self.bounded_layers * min(tokens, win) * self.kv_tok
        return full, math.ceil(state / self.block_bytes)

    def _held(self, r: Req) -> int:
        return sum(r.blocks.values())

    def _grow(self, inst: Inst, r: Req, tokens: int) -> bool:
        """Allocate r's blocks for `tokens` total at home; False if the pool is out."""
        full, state = self._need(tokens)
        add = full - self._held(r) + (state - r.state)
        if add > inst.free:
            return False
        inst.used += add
        r.blocks[inst.name] = r.blocks.get(inst.name, 0) + full - self._held(r)
        r.state = state
        return True

    def _release(self, r: Req) -> None:
        """r's KV everywhere goes (finished or preempted)."""
        for name, n in r.blocks.items():
            inst = self.by_name[name]
            inst.used -= n
            if name != r.home:
                inst.hosted.pop(r.id, None)
        self.by_name[r.home].used -= r.state
        r.blocks, r.state, r.computed = {}, 0, 0

    # ------------------------------------------------------------ arrival

    def _arrive(self, r: Req, now: float) -> None:
        full, state = self._need(r.length)
        largest = max(i.total for i in self.insts)
        if state + 1 > largest:
            r.rejected = f"its bounded state ({state} blocks) fills a whole pool"
            return
        if self.cfg.mode != "infinite" and full + state > largest:
            r.rejected = f"{r.length} tokens need {full + state} blocks > the pool's {largest}"
            return
        if self.cfg.mode == "infinite" and full + state > sum(i.total for i in self.insts):
            r.rejected = "longer than the whole cluster's KV memory"
            return
        self.queue.append(r)
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        """The front end's FIFO queue: its head goes to the instance with the most free
        memory (the paper's policy) once it fits there; until then it waits."""
        while self.queue:
            r = self.queue[0]
            inst = max(self.insts, key=lambda i: (self._room_for(i), -len(i.running), i.name))
            if not self._fits(inst, r, self._room_for(inst)):
                return
            self.queue.popleft()
            r.home = inst.name
            self._homes[r.id] = inst.name
            self._wake(inst, now)
            inst.waiting.append(r)

    # ------------------------------------------------------------ a step

    def _step(self, inst: Inst) -> None:
        self._admit(inst)
        batch = self._batch(inst)
        if not batch:
            self._stall(inst)
            return
        self._progress = inst.clock
        tokens = sum(n for _, n in batch)
        sampled = [r for r, n in batch if r.computed + n >= r.prompt]
        nbytes, flops = inst.pending_bytes, inst.pending_flops
        inst.pending_bytes = inst.pending_flops = 0.0
        shards: dict[str, float] = {}
        for r, n in batch:
            b, f = self._attention(inst, r, n, shards)
            nbytes, flops = nbytes + b, flops + f
        local = inst.pricer.seconds(tokens, len(sampled), nbytes, flops)
        remote = max(shards.values(), default=0.0)
        dt = max(local, remote + self.cfg.rtt_s if shards else 0.0)
        inst.steps += 1
        inst.busy_s += dt
        inst.clock += dt
        self.res.steps.append((inst.clock, tokens))
        for r, n in batch:
            self._advance(inst, r, n, inst.clock)

    def _stall(self, inst: Inst) -> None:
        """Nothing can run now (waiting on memory or moves): sleep until the next event or
        another instance's step (either may free memory)."""
        times = [t for t, _, _ in self._events[:1]]
        times += [i.clock for i in self.insts if i is not inst and i.busy]
        if not times or inst.clock - self._progress > self.cfg.stall_limit_s:
            return self._starved(inst)
        later = [t for t in times if t > inst.clock]
        nxt = min(later) if later else inst.clock + 1e-4
        inst.stall_s += nxt - inst.clock
        inst.clock = nxt

    def _starved(self, inst: Inst) -> None:
        """No event will free memory: reject the head request (it cannot ever run)."""
        r = inst.running.pop() if inst.running else inst.waiting.popleft()
        self._release(r)
        r.rejected = f"out of memory on {inst.name} with nothing left to wait for"

    def _admit(self, inst: Inst) -> None:
        """The instance's own queue (dispatched or preempted requests), FIFO."""
        while (inst.waiting and len(inst.running) < self.cfg.max_num_seqs * inst.pricer.pp
               and self._fits(inst, inst.waiting[0], inst.free - self._promised(inst))):
            r = inst.waiting.popleft()
            r.computed = 0
            r.admitted_seq = next(self._seq)
            inst.running.append(r)

    def _room_for(self, inst: Inst) -> int:
        return inst.free - self._promised(inst) - sum(
            sum(self._need(r.prompt)) for r in inst.waiting)

    def _fits(self, inst: Inst, r: Req, room: int) -> bool:
        """The whole prompt fits the memory not yet promised to prompts in flight (vLLM's
        can_allocate); infinite also takes a prompt longer than half the pool when the
        cluster's free memory (the gManager's view) covers it."""
        need = sum(self._need(r.prompt))
        if need <= room:
            return True
        first = sum(self._need(min(r.prompt, self.cfg.chunk_tokens)))
        return (self.cfg.mode == "infinite" and need > inst.total // 2 and room >= first
                and self._cluster_free(inst) >= sum(self._need(r.length)))

    def _promised(self, inst: Inst) -> int:
        """Blocks the prompts under way here still need (at home, at most its free)."""
        left = sum(max(0, sum(self._need(r.prompt)) - self._held(r) - r.state)
                   for r in inst.running if r.computed < r.prompt)
        return min(left, inst.free)

    def _cluster_free(self, home: Inst) -> int:
        """Blocks a long request homed at `home` could get: home's free blocks and those
        of instances that may lend (not debtors: an instance is never both), less what
        admitted long requests will still need. The gManager admits a long request only
        if that covers all of it, so two long requests never wait on each other."""
        promised = sum(max(0, sum(self._need(r.length)) - self._held(r) - r.state)
                       for i in self.insts for r in i.running
                       if sum(self._need(r.prompt)) > i.total // 2)
        lenders = sum(i.free for i in self.insts if i is not home and not self._is_debtor(i))
        return home.free + lenders - promised

    def _batch(self, inst: Inst) -> list[tuple[Req, int]]:
        """Decodes first (one token), then prompt chunks within chunk_tokens; each
        request's blocks for the step are allocated, preempting or moving on a full pool."""
        budget = self.cfg.chunk_tokens
        out: list[tuple[Req, int]] = []
        order = sorted(inst.running, key=lambda r: (r.computed < r.prompt, r.admitted_seq))
        for r in order:
            if r not in inst.running or budget <= 0:
                continue
            n = 1 if r.computed >= r.prompt else min(budget, r.prompt - r.computed)
            if self._room(inst, r, r.computed + n):
                out.append((r, n))
                budget -= n
        return out

    def _room(self, inst: Inst, r: Req, tokens: int) -> bool:
        if self._grow(inst, r, tokens):
            self._low_water(inst, r)
            return True
        if self.cfg.mode == "infinite":
            full, state = self._need(tokens)
            short = full - self._held(r) + state - r.state - inst.free
            if self._force(inst, short, inst.clock):
                return False  # r waits for the move to land
        victim = max(inst.running, key=lambda x: x.admitted_seq)
        if victim is r and len(inst.running) == 1:
            return False  # alone and still short: wait (infinite) for lent memory
        self._preempt(inst, victim)
        return victim is not r and self._grow(inst, r, tokens)

    def _preempt(self, inst: Inst, r: Req) -> None:
        inst.running.remove(r)
        self._release(r)
        r.generated, r.preempted = 0, r.preempted + 1
        self.res.preemptions += 1
        inst.waiting.appendleft(r)

    def _attention(self, inst: Inst, r: Req, n: int,
                   shards: dict[str, float]) -> tuple[float, float]:
        """(bytes, FLOPs) of r's attention at home; creditors' shards priced on theirs."""
        tpb = self.cfg.tokens_per_block
        b, f = inst.pricer.bounded(n, r.computed)
        remote = 0
        for name, blocks in r.blocks.items():
            if name == inst.name:
                continue
            keys = blocks * tpb
            remote += keys
            cb, cf = inst.pricer.attn(n, keys, inst.pricer.full)
            c = self.by_name[name]
            c.pending_bytes += cb
            c.pending_flops += cf
            shards[name] = shards.get(name, 0.0) + c.pricer.attn_seconds(cb, cf)
        lb, lf = inst.pricer.attn(n, max(0, r.computed - remote), inst.pricer.full)
        return b + lb, f + lf

    def _advance(self, inst: Inst, r: Req, n: int, now: float) -> None:
        r.computed += n
        if r.computed < r.prompt:
            return
        if r.first_token is None:
            r.first_token = now
        r.generated += 1
        if r.generated >= r.tr.output_len:
            r.finish = now
            inst.running.remove(r)
            self._release(r)
        self.res.max_spread = max(self.res.max_spread, len(r.blocks))

    # ------------------------------------------------------------ moves

    def _low_water(self, inst: Inst, r: Req) -> None:
        """Infinite: a long request (a quarter of the pool or more) starts moving blocks
        before the pool is out, so its prompt keeps streaming (the transfer overlaps the
        steps, Fig. 6b). Short requests leave that to Algorithm 1.

        balance_prefill: a prompt longer than half a pool also moves blocks until home
        holds no more than its share (prompt / instances): a prompt chunk's attention
        runs in parallel only as far as the keys are spread, and the debtor's step waits
        for its own share too (§5.2.1: remote work covered by local work)."""
        if self.cfg.mode != "infinite" or self._moving(inst):
            return
        home = r.blocks.get(inst.name, 0)
        pressed = (inst.free < 2 * self.cfg.chunk_tokens // self.cfg.tokens_per_block
                   and home > inst.total // 4)
        prompt_blocks = self._need(r.prompt)[0]
        unbalanced = (self.cfg.balance_prefill and r.computed < r.prompt
                      and prompt_blocks > inst.total // 2
                      and home > prompt_blocks / len(self.insts) + self.cfg.move_blocks)
        if pressed or unbalanced:
            self._force(inst, self.cfg.move_blocks, inst.clock)

    def _moving(self, inst: Inst) -> bool:
        return any(r.in_flight for r in inst.running if r.home == inst.name)

    def _force(self, inst: Inst, short: int, now: float) -> bool:
        """A debtor out of memory moves blocks of its longest request to the creditors
        the gManager names, each checked against its real free space. True if a move
        is under way (the blocks come free when it lands)."""
        if self._moving(inst):
            return True
        if inst.hosted:  # a creditor takes its memory back rather than borrow (§5.2)
            return self._reclaim(inst, short)
        r = max(inst.running, key=lambda x: x.blocks.get(inst.name, 0), default=None)
        if r is None:
            return False
        want = max(short, self.cfg.move_blocks)
        started = False
        for c in self.gm.creditors(inst.name, want):
            movable = r.blocks.get(inst.name, 0) - r.in_flight - 1
            if want <= 0 or movable <= 0:
                break
            n = min(want, movable, self.by_name[c].free)
            if n > 0 and self._move(r, inst.name, c, n, now):
                self.res.forced_moves += 1
                want -= n
                started = True
        return started

    def _reclaim(self, inst: Inst, short: int) -> bool:
        """A creditor short of memory hands a hosted request's blocks back to its debtor,
        or to another creditor when the debtor has no room."""
        rid = max(inst.hosted, key=inst.hosted.__getitem__)
        r = next((x for x in self.by_name[self._homes[rid]].running if x.id == rid), None)
        n = min(inst.hosted[rid] - r.in_flight, max(short, 1)) if r is not None else 0
        if n <= 0:
            return False
        home = self.by_name[r.home]
        dsts = [r.home] if home.free >= n else []
        dsts += [c for c in self.gm.creditors(r.home, n) if c != inst.name]
        for dst in dsts:
            d = self.by_name[dst]
            k = min(n, d.free)
            if k > 0 and self._move(r, inst.name, dst, k, inst.clock):
                self.res.reclaim_moves += 1
                return True
        return False

    def _is_debtor(self, inst: Inst) -> bool:
        return any(r.home == inst.name and (len(r.blocks) > 1 or r.in_flight)
                   for r in inst.running)

    def _move(self, r: Req, src: str, dst: str, n: int, now: float) -> bool:
        """try_move_kvcache, then the transfer: dst reserves n blocks first come first
        served (refusing if it borrows itself: never both roles); they leave src when
        the transfer lands."""
        s, d = self.by_name[src], self.by_name[dst]
        lending = dst != r.home
        if (d.free < n or (lending and self._is_debtor(d)) or r.finish is not None
                or r.rejected or r.blocks.get(src, 0) - r.in_flight < n):
            self.res.refused_moves += 1
            return False
        d.used += n
        d.reserved += n
        r.in_flight += n
        net = self.intra if s.node == d.node else self.inter
        landed = net.send("move", src, dst, n * self.block_bytes, now)
        self.res.moved_bytes += n * self.block_bytes
        self.res.all_layer_bytes += n * self.all_layer_block
        self._at(landed, partial(self._landed, r, src, dst, n, r.preempted))
        return True

    def _landed(self, r: Req, src: str, dst: str, n: int, epoch: int, now: float) -> None:
        d = self.by_name[dst]
        r.in_flight -= n
        d.reserved -= n
        gone = r.finish is not None or r.preempted != epoch or r.blocks.get(src, 0) < n
        if gone:  # the request finished or restarted meanwhile: drop the reservation
            d.used -= n
            return
        s = self.by_name[src]
        r.blocks[src] -= n
        s.used -= n
        if not r.blocks[src]:
            del r.blocks[src]
        if src != r.home:
            s.hosted[r.id] -= n
            if not s.hosted[r.id]:
                del s.hosted[r.id]
        r.blocks[dst] = r.blocks.get(dst, 0) + n
        if dst != r.home:
            d.hosted[r.id] = d.hosted.get(r.id, 0) + n
        self._wake(s, now)

    # ------------------------------------------------------------ heartbeat

    def _beat(self, now: float) -> None:
        """Every rManager's load and changed entries; then Algorithm 1's moves."""
        for inst in self.insts:
            self.gm.heartbeat(self._load(inst), self._changed(inst))
        for mv in self.gm.retrieve():
            home = self.by_name[mv.dst]
            r = next((x for x in home.running if x.id == mv.req_id), None)
            if r is not None and self._move(r, mv.src, mv.dst, mv.num_blocks, now):
                self.res.retrieve_moves += 1
        for mv in self.gm.plan():
            src = self.by_name[mv.src]
            r = next((x for x in src.running if x.id == mv.req_id), None)
            if (r is not None and not src.hosted
                    and r.blocks.get(mv.src, 0) - r.in_flight - 1 >= mv.num_blocks):
                if self._move(r, mv.src, mv.dst, mv.num_blocks, now):
                    self.res.planned_moves += 1
        if self._events or any(i.busy for i in self.insts):
            self._at(now + self.cfg.heartbeat_s, self._beat)

    def _load(self, inst: Inst) -> InstanceLoad:
        queue = list(itertools.islice(inst.waiting, 32))
        return InstanceLoad(inst.name, len(inst.running), inst.free, inst.total, len(queue),
                            sum(sum(self._need(r.prompt)) for r in queue))

    def _changed(self, inst: Inst) -> list[RequestPlacementEntry]:
        """The entries that changed since the last heartbeat (0 blocks: gone)."""
        now = {r.id: (r.blocks.get(inst.name, 0), True)
               for r in inst.running if r.home == inst.name}
        now.update((rid, (n, False)) for rid, n in inst.hosted.items())
        out = [RequestPlacementEntry(rid, inst.name, n, local)
               for rid, (n, local) in now.items() if inst.reported.get(rid) != (n, local)]
        out += [RequestPlacementEntry(rid, inst.name, 0, local)
                for rid, (_, local) in inst.reported.items() if rid not in now]
        inst.reported = {rid: v for rid, v in now.items() if v[0] > 0}
        return out


def check(sim: DistSim) -> None:
    """The block accounting adds up: every instance's used blocks are its own requests'
    blocks and state, the blocks it hosts for others and the moves coming in."""
    own: dict[str, int] = {i.name: i.reserved for i in sim.insts}
    hosted: dict[str, dict[str, int]] = {i.name: {} for i in sim.insts}
    for r in sim.reqs:
        if r.home and (r.blocks or r.state):
            own[r.home] += r.state
        for name, n in r.blocks.items():
            own[name] += n
            if name != r.home:
                hosted[name][r.id] = n
    for i in sim.insts:
        assert i.used == own[i.name], (i.name, i.used, own[i.name])
        assert i.hosted == hosted[i.name], (i.name, i.hosted, hosted[i.name])
        assert 0 <= i.used <= i.total, (i.name, i.used, i.total)


def longest_context(cfg: DistConfig) -> int:
    """The longest request (prompt + output tokens) the system can hold at all: one
    instance's pool (multi, single) or the whole cluster's (infinite)."""
    sim = DistSim(cfg, [])
    cap = sum(i.total for i in sim.insts) if cfg.mode == "infinite" else sim.insts[0].total
    lo, hi = 0, cap * cfg.tokens_per_block
    while lo < hi:  # the most tokens whose blocks and state fit cap
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(sim._need(mid)) <= cap else (lo, mid - 1)
    return lo


def simulate_dist(trace: list[TraceRequest], cfg: DistConfig) -> DistResult:
    return DistSim(cfg, trace).run()


# ------------------------------------------------------------------ metrics


def summary(res: DistResult) -> dict:
    done = [r for r in res.requests if r.finish is not None]
    first = min((r.tr.arrival for r in res.requests), default=0.0)
    span = max((r.finish for r in done), default=first) - first
    out_tokens = sum(r.tr.output_len for r in done)
    all_tokens = out_tokens + sum(r.prompt for r in done)
    lat = [(r.finish - r.tr.arrival) / r.length for r in done]
    cfg = res.config
    return {
        "mode": cfg.mode, "model": cfg.model.name, "gpus": cfg.gpus, "hybrid": cfg.hybrid,
        "requests": len(res.requests), "finished": len(done),
        "rejected": sum(r.rejected is not None for r in res.requests),
        "unfinished": sum(r.finish is None and r.rejected is None for r in res.requests),
        "sim_seconds": span,
        "tokens_per_s": all_tokens / span if span > 0 else 0.0,
        "output_tokens_per_s": out_tokens / span if span > 0 else 0.0,
        "requests_per_s": len(done) / span if span > 0 else 0.0,
        "mean_s_per_token": sum(lat) / len(lat) if lat else 0.0,
        "pool_blocks": [i.total for i in res.instances],
        "moved_bytes": res.moved_bytes, "all_layer_bytes": res.all_layer_bytes,
        "forced_moves": res.forced_moves, "planned_moves": res.planned_moves,
        "refused_moves": res.refused_moves,
        "reclaim_moves": res.reclaim_moves, "retrieve_moves": res.retrieve_moves,
        "preemptions": res.preemptions,
        "max_spread": res.max_spread,
        "longest_done": max((r.length for r in done), default=0),
    }
