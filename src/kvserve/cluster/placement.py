"""Infinite-LLM's cluster placement: the gManager's request placement map, its
performance model (Eq. 5-7) and the greedy debtor/creditor algorithm (Algorithm 1).

Pure Python: the runtime (Ray actors) and the simulator (kvserve.sim.distattn)
both feed it heartbeats and carry out the moves it returns.

Units: a *block* is `tokens_per_block` tokens of KV of the full-attention layers
only. Sliding-window and Mamba state is bounded per request and stays on the
request's home instance (its debtor), so it is not spread and never counted
here as movable; instances report their pools in block-equivalents.

Roles (paper §5.2): an instance whose requests have blocks elsewhere is a
*debtor*; one holding blocks of other instances' requests is a *creditor*. An
instance is never both at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestPlacementEntry:
    """The paper's Listing 1: part of a request's KV on one instance."""

    req_id: str
    inst_id: str
    num_blocks: int  # full-attention KV blocks of req_id on inst_id; 0: none left (drops it)
    local: bool  # inst_id is the request's debtor (home) instance


@dataclass(frozen=True)
class InstanceLoad:
    inst_id: str
    batch: int  # running requests
    free_blocks: int
    total_blocks: int
    waiting: int = 0  # queued requests that memory would let in (Eq. 6's beta' - beta)
    waiting_blocks: int = 0  # blocks those queued requests need, together

    @property
    def util(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 1.0


@dataclass(frozen=True)
class Move:
    req_id: str
    src: str
    dst: str
    num_blocks: int


# ------------------------------------------------------------ performance model


@dataclass(frozen=True)
class PerfModel:
    """Eq. 5: T_lyr(b, S) = W(b)/f(b) + S/g, per average decoder layer of one decode step.

    W(b)/f(b) = max(fixed_s + per_seq_s * b, compute_per_seq_s * b): the weights
    are read once per step whatever the batch (fixed_s), each request adds its
    bounded state (per_seq_s: sliding windows, activations) and, past the roofline
    knee, compute grows with the batch (compute_per_seq_s; 0 in a fitted model,
    which is linear). S/g = per_block_s * attn_blocks: decode attention reads
    every full-attention block once and does not batch.
    """

    n_layers: int
    fixed_s: float
    per_seq_s: float
    per_block_s: float
    compute_per_seq_s: float = 0.0

    def nonattn_time(self, batch: int) -> float:
        return max(self.fixed_s + self.per_seq_s * batch, self.compute_per_seq_s * batch)

    def layer_time(self, batch: int, attn_blocks: int) -> float:
        return self.nonattn_time(batch) + self.per_block_s * attn_blocks

    def step_time(self, batch: int, attn_blocks: int) -> float:
        return self.n_layers * self.layer_time(batch, attn_blocks)

    def tps(self, batch: int, attn_blocks: int) -> float:
        """Tokens/s of one instance: batch / (n_layers * T_lyr)."""
        if batch <= 0:
            return 0.0
        return batch / self.step_time(batch, attn_blocks)

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]], n_layers: int) -> PerfModel:
        """Least squares of step seconds = n_layers * (c0 + c1 * batch + c2 * blocks)."""
        rows = [(1.0, float(b), float(k)) for b, k, _ in samples]
        ys = [t / n_layers for _, _, t in samples]
        c0, c1, c2 = _least_squares(rows, ys)
        return cls(n_layers, c0, c1, c2)

    @classmethod
    def from_roofline(cls, model, gpu, *, tokens_per_block: int = 16, tp: int = 1,
                      fp8_weights: bool = False, kv_dtype_bytes: int = 2,
                      hybrid: bool = True) -> PerfModel:
        """From the simulator's description (kvserve.sim.models.Model, sim.gpus.GPU).

        The same roofline as kvserve.sim.cost.CostModel, split as Eq. 5 splits it.
        hybrid=False prices every attention layer as full (what a system that
        ignores sliding windows would plan with).
        """
        from kvserve.sim.cost import CostModel

        cost = CostModel(model, gpu, fp8_weights=fp8_weights, kv_dtype_bytes=kv_dtype_bytes,
                         tp=tp)
        n = model.num_layers
        full, bounded = spread_layers(model, hybrid)
        fixed = cost._dense_weight_bytes / cost.bandwidth  # the weights every step reads
        per_seq = bounded * cost.kv_token_bytes / cost.bandwidth
        compute = model.linear_flops_per_token() / cost.matmul_flops
        per_block = tokens_per_block * full * cost.kv_token_bytes / cost.bandwidth
        return cls(n, fixed / n, per_seq / n, per_block / n, compute / n)


def spread_layers(model, hybrid: bool = True) -> tuple[int, int]:
    """(layers whose KV grows with the context and is spread, bounded KV tokens x layers
    per request that stays home). hybrid=False treats every attention layer as full."""
    from kvserve.memory import LayerKind

    full = bounded = 0
    for g in model.attention_groups():
        if g.kind is LayerKind.FULL or not hybrid:
            full += g.layers
        elif g.kind is LayerKind.SLIDING:
            bounded += g.layers * g.window
        elif g.kind is LayerKind.CHUNKED:
            bounded += g.layers * g.chunk
    return full, bounded


def _least_squares(rows: list[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Solve the normal equations (A^T A) x = A^T y by Gaussian elimination."""
    k = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(ata[r][col]))
        if abs(ata[pivot][col]) < 1e-300:
            raise ValueError("PerfModel.fit: samples do not determine the coefficients")
        ata[col], ata[pivot] = ata[pivot], ata[col]
        aty[col], aty[pivot] = aty[pivot], aty[col]
        for r in range(k):
            if r != col:
                f = ata[r][col] / ata[col][col]
                ata[r] = [a - f * b for a, b in zip(ata[r], ata[col])]
                aty[r] -= f * aty[col]
    return [aty[i] / ata[i][i] for i in range(k)]


# -------------------------------------------------------------------- gManager


@dataclass
class _Inst:
    load: InstanceLoad
    entries: dict[str, int] = field(default_factory=dict)  # req -> blocks held here


class GManager:
    """The global request placement map and Algorithm 1 over it.

    beta_thres: instances running at most this many requests may borrow (debtors);
    util_thres: instances at most this full may lend (creditors), and plan() never
    fills a creditor past it, leaving it room for its own requests.
    """

    def __init__(self, perf: PerfModel, beta_thres: int, util_thres: float,
                 min_gain: float = 0.02) -> None:
        self.perf = perf
        # a move must buy this share of the pair's throughput: moves cost network time
        # the model leaves out, and a marginal one is undone by the next change of load
        self.min_gain = min_gain
        self.beta_thres = beta_thres
        self.util_thres = util_thres
        self._insts: dict[str, _Inst] = {}
        self._placement: dict[str, dict[str, int]] = {}  # req -> inst -> blocks
        self._home: dict[str, str] = {}  # req -> debtor (home) instance

    # ------------------------------------------------------------- the map

    def heartbeat(self, load: InstanceLoad, entries: Iterable[RequestPlacementEntry]) -> None:
        """An rManager's report: its load and the entries changed since its last one."""
        inst = self._insts.setdefault(load.inst_id, _Inst(load))
        inst.load = load
        for e in entries:
            if e.inst_id != load.inst_id:
                raise ValueError(f"{load.inst_id} reported an entry of {e.inst_id}")
            self._apply(inst, e)

    def _apply(self, inst: _Inst, e: RequestPlacementEntry) -> None:
        where = self._placement.setdefault(e.req_id, {})
        if e.local:
            self._home[e.req_id] = e.inst_id
        if e.num_blocks > 0:
            where[e.inst_id] = inst.entries[e.req_id] = e.num_blocks
            return
        where.pop(e.inst_id, None)
        inst.entries.pop(e.req_id, None)
        if e.local and self._home.get(e.req_id) == e.inst_id:
            del self._home[e.req_id]  # the request left its home: it is done
        if not where:
            del self._placement[e.req_id]
            self._home.pop(e.req_id, None)

    def placement(self, req_id: str) -> dict[str, int]:
        return dict(self._placement.get(req_id, {}))

    def debtor(self, req_id: str) -> str | None:
        return self._home.get(req_id)

    def load(self, inst_id: str) -> InstanceLoad | None:
        inst = self._insts.get(inst_id)
        return inst.load if inst else None

    def drop_instance(self, inst_id: str) -> list[str]:
        """A dead instance: forget it; the requests that had blocks there (to recompute)."""
        inst = self._insts.pop(inst_id, None)
        if inst is None:
            return []
        hit = sorted(inst.entries)
        for req in hit:
            self._apply(inst, RequestPlacementEntry(req, inst_id, 0,
                                                    self._home.get(req) == inst_id))
        return hit

    # ------------------------------------------------------------- roles

    def debtors(self) -> set[str]:
        """Instances with a request that has blocks on another instance."""
        return {home for req, home in self._home.items()
                if any(i != home for i in self._placement.get(req, {}))}

    def creditor_set(self) -> set[str]:
        """Instances holding blocks of a request whose home is elsewhere."""
        return {i for req, where in self._placement.items() for i in where
                if self._home.get(req) not in (None, i)}

    def creditors(self, debtor: str, num_blocks: int) -> list[str]:
        """Where a debtor whose pool is full may move num_blocks now, most free first.

        Never a debtor (an instance is not both) nor the debtor itself. Instances
        with fewer free blocks than asked stay listed: a partial move still helps.
        """
        taken = self.debtors() | {debtor}
        cands = [i for i in self._insts.values()
                 if i.load.inst_id not in taken and i.load.free_blocks > 0]
        cands.sort(key=lambda i: (-i.load.free_blocks, i.load.inst_id))
        return [i.load.inst_id for i in cands]

    # ------------------------------------------------------------- Algorithm 1

    def plan(self) -> list[Move]:
        """Algorithm 1 over the current view: debtors by batch ascending borrow from
        creditors by utilization ascending, the block count of each move the one
        the performance model (Eq. 7 over the pair) likes best."""
        loads = {i: s.load for i, s in self._insts.items()}
        used = {i: ld.total_blocks - ld.free_blocks for i, ld in loads.items()}
        debtors, creditors = self._roles(loads)
        extra = {i: 0 for i in loads}  # blocks moved onto (+) / off (-) each instance
        moves: list[Move] = []
        for d in debtors:
            req, local = self._longest(d, moves)
            if req is None:
                continue
            block_max = local - 1  # the block being appended stays home
            for c in sorted(creditors, key=lambda i: (used[i] / loads[i].total_blocks, i)):
                if block_max <= 0:
                    break
                cap = min(block_max, self._lendable(loads[c], used[c]))
                k = self._best_k(loads[d], loads[c], extra[d], extra[c], cap)
                if k <= 0:
                    break
                moves.append(Move(req, d, c, k))
                used[c] += k
                used[d] -= k
                extra[c] += k
                extra[d] -= k
                block_max -= k
        return moves

    def retrieve(self) -> list[Move]:
        """§5.2: a creditor short of space (past (1 + util_thres) / 2) reclaims what it
        lent to a debtor that now has room (up to util_thres, no queue of its own).
        Only then: a creditor with room keeps lending what plan() found worth moving,
        so the two never undo each other."""
        moves: list[Move] = []
        for d in sorted(self.debtors()):
            ld = self._insts[d].load
            room = math.floor(self.util_thres * ld.total_blocks) - (
                ld.total_blocks - ld.free_blocks)
            if ld.waiting or room <= 0:
                continue
            for req in sorted(r for r, h in self._home.items() if h == d):
                for inst, n in sorted(self._placement.get(req, {}).items()):
                    k = min(n, room)
                    if inst != d and k > 0 and self._short(inst):
                        moves.append(Move(req, inst, d, k))
                        room -= k
        return moves

    def _short(self, inst: str) -> bool:
        # halfway between util_thres (where plan() stops lending) and full: a hysteresis
        # band, so that a creditor's own growth past util_thres does not undo every move
        return self._insts[inst].load.util > (1 + self.util_thres) / 2

    def _roles(self, loads: dict[str, InstanceLoad]) -> tuple[list[str], list[str]]:
        """Debtors (batch <= beta_thres, memory-pressed or already borrowing, lending
        nothing) by batch ascending; creditors (util <= util_thres, borrowing nothing,
        not a debtor this round)."""
        now_debtors, now_creditors = self.debtors(), self.creditor_set()
        debtors = [i for i, ld in loads.items()
                   if ld.batch <= self.beta_thres and i not in now_creditors
                   and (ld.util > self.util_thres or i in now_debtors)]
        debtors.sort(key=lambda i: (loads[i].batch, i))
        chosen = set(debtors) | now_debtors
        creditors = [i for i, ld in loads.items()
                     if ld.util <= self.util_thres and i not in chosen]
        return debtors, creditors

    def _longest(self, inst: str, moves: list[Move]) -> tuple[str | None, int]:
        """The request homed on inst with the most blocks there (pick_longest_request)."""
        best, most = None, 0
        for req, n in self._insts[inst].entries.items():
            if self._home.get(req) != inst:
                continue
            n -= sum(m.num_blocks for m in moves if m.req_id == req)
            if n > most:
                best, most = req, n
        return best, most

    def _lendable(self, ld: InstanceLoad, used: int) -> int:
        """Blocks a creditor may take without passing util_thres (never past free)."""
        limit = math.floor(self.util_thres * ld.total_blocks) - used
        return max(0, min(limit, ld.total_blocks - used))

    def _attn_blocks(self, ld: InstanceLoad) -> int:
        return ld.total_blocks - ld.free_blocks

    def _best_k(self, d: InstanceLoad, c: InstanceLoad, d_extra: int, c_extra: int,
                cap: int) -> int:
        """argmax over k in [0, cap] of TPS_d + TPS_c (Eq. 6-7); 0 if nothing gains.

        Between two k where the debtor's batch beta'(k) steps up, the pair's TPS
        is convex in k (b1/(T1 - x) + b2/(T2 + x)), so its maximum lies at an end
        of such an interval: those ends are the only candidates, an exact search.
        """
        if cap <= 0:
            return 0
        per_req = d.waiting_blocks / d.waiting if d.waiting else math.inf
        cands = {0, cap}
        for j in range(1, d.waiting + 1):
            k = math.ceil(j * per_req) - (d.free_blocks - d_extra)
            if k > cap:
                break
            cands.update(x for x in (k - 1, k) if 0 <= x <= cap)

        def pair_tps(k: int) -> float:
            grown = min(d.waiting, int((d.free_blocks - d_extra + k) // per_req)) \
                if d.waiting else 0
            base = min(d.waiting, int((d.free_blocks - d_extra) // per_req)) \
                if d.waiting else 0
            b_d = d.batch + grown - base
            # the queued requests bring their own blocks: attention over them, local
            blocks_d = self._attn_blocks(d) + d_extra - k + (grown - base) * (
                0 if not d.waiting else per_req)
            return (self.perf.tps(b_d, int(blocks_d))
                    + self.perf.tps(c.batch, self._attn_blocks(c) + c_extra + k))

        base_tps = pair_tps(0)
        best = max(sorted(cands), key=pair_tps)
        return best if pair_tps(best) > base_tps * (1 + self.min_gain) else 0
