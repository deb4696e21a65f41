"""Attention over contiguous virtual KV (vTensor), the engine's other attention backend.

The paged backend scatters a request's KV over pages of one fixed pool, so
every kernel needs a page table (and the torch path a gather). Here each
request owns, per layer, one vTensor (`kvserve.physical.vtensor`): a reserved
virtual range with physical chunks mapped in as it grows. Attention is plain
`scaled_dot_product_attention` over a slice of that tensor: no page table, no
gather, no slot mapping.

Layout: one vTensor per request and layer, [tokens, 2, kv_heads, head_dim]
(K and V of a token side by side). Against one vTensor for K and one for V it
halves the bookkeeping that scales with layers x requests (reservations, VMAs,
prefix-tree walks, map calls per Extend), and K and V of a prefix are shared
by one chunk reference. K is still a single strided view (`kv[:, 0]`: rows of
head_dim contiguous, stride 2 x kv_heads x head_dim between tokens), which SDPA
reads in place. One VTensor for all layers would cut that further but strides
a layer's K by every layer's KV, and a chunk would hold few tokens.

Chunk size: `chunk_bytes_for` of a whole memory-core page of tokens (at most
`CHUNK_TARGET`), so a chunk holds a whole number of the memory core's pages
and both sides count prefixes in the same blocks (Gemma 3 270M in float32:
64 KiB chunks of 32 tokens, two 16-token pages).

Step protocol (the paper's §5.4 scheduler operations):

* `prepare` runs before the forward. A request new to the backend is
  *Created* with *Prefix Match* against its prompt; every scheduled request is
  then *Extended* to cover this step's tokens. One view per request and
  layer is taken for the whole step.
* `__call__` per layer writes the new K/V by slicing and attends.
* `commit` after the forward *Records* every chunk whose tokens are now all
  computed (prompt and generated tokens alike) in each layer's prefix tree,
  drops the step's views, *Unmaps* in each sliding layer the chunks wholly
  before the next step's first key (`unmap_window`), and *Extends ahead*:
  every request of the step gets chunks for its next `ahead_tokens` tokens
  from free chunks (best effort; taken back first when memory is short), so
  a decode step finds its memory mapped and `prepare` maps only for
  prefill. This engine is synchronous, so the maps are moved out of the
  step's start, not overlapped with compute as on a GPU; at 64 KiB chunks a
  map costs 15 us (a chunk kept by a lazy release) to 60 us (fresh memory),
  once per request, layer and 32 tokens: ~0.1% of a decode step
  (docs/benchmarks.md), which is why that is enough.
* `release` (the engine calls it when a request finishes or aborts) and
  `retain` (each step, with the running requests: a preempted one is
  released) *Release* lazily: chunks stay mapped until memory is needed.

How prefix hits agree. The memory core (`KVCacheManager`) still admits and
schedules and decides the hit: a request starts computing at
`start = kv.lookup(...)`. The vTensor side cannot promise to hold the same
prefix: its trees and the memory core's cache evict independently, and a
match is whole chunks. So the backend takes the memory core's hit as an upper
bound: it matches only `tokens[:start]`, and when its match is shorter it
*widens* the step to recompute the gap [match, start) itself (`prepare`
rewrites the step's `start`/`num_new`; the runner builds ids and positions
from the widened step). The engine never skips a token whose KV the vTensor
lacks, and a shared chunk is never written: matched chunks end at or before
`start`, and a request resumed below what it already computed (a preemption)
is released and created again, since its own chunks may have been recorded
and mapped by others since. A hit that jumps past what a request in chunked
prefill computed (another request computed the prefix meanwhile) is widened
back the same way: its own vTensor lacks the gap. The price is a step larger than the scheduler's
token budget by the gap: zero when the hit ends on a chunk boundary and both
caches hold it, less than a chunk when it ends inside one, the whole hit only
after the vTensor trees were trimmed under the memory core's cache; and
`num_cached_tokens` reports the memory core's hit. Capping the hit instead
would need a hook inside `KVCacheManager.lookup`, which claims the hit's pages
as it returns; recomputing keeps the memory core untouched.

Physical capacity is a ceiling on a sparse memfd, not a reservation: memory
is taken as chunks are mapped and punched back after `--kv-idle-release-s`.
The ceiling is `--kv-memory` itself: the memfd is that size, so the process
never holds more KV than that.

Sliding and chunked layers map only what a query can still see. After each
step such a layer unmaps the chunks lying wholly before the next step's first
key (`first_key(end, window, chunk)`; a request's next step starts at its
`end`, a resumed one is created again), so a sliding layer keeps about
window + one chunk mapped per request (Gemma 3 270M, window 512, 32-token
chunks: 17 of them, against a 4K request's 128) and a chunked layer (Llama 4)
its current attention chunk + one. The slots stay reserved behind a
placeholder (`VTensor.unmap_head`), so positions do not move.

Unmapping drops only the vTensor's references: the prefix trees still hold
every recorded chunk, so the memory comes back when they evict it (memory
pressure or idle release). A hit at token h needs only the chunks over
[h - window + 1, h) in a sliding layer, so a tree could keep just the last
window before each leaf. It does not, deliberately:

* The hit point is not known when a chunk is recorded. Any node can become
  one: a shared system prompt ends inside the first request that carries it
  and becomes a branch only when the second one arrives, by which time the
  first has moved past it. Trimmed there, the prefix sharing the trees exist
  for would miss in every sliding layer.
* A miss there cannot be patched by recomputing one window. A token's KV in
  layer l depends on the windows of every layer below (and on the full
  layers' whole history), so the gap from the last point where every window
  is whole is recomputed through all layers, and the full layers' chunks in
  that gap, shared through the tree, must not be written: the step is
  widened back to the sliding match, as for any shorter match.
* Matching would become "the deepest node whose window is whole" across
  layer groups, with hollow nodes (a key, no chunk) to keep the tree
  walkable, and the memory core, which decides hits, would need the same
  rule to keep its promises.

What is left to do is hollowing sliding chunks under memory pressure only,
before evicting leaves. Until then the memory core admits as if every layer
held the full history, minus room for chunk rounding (`core_budget`): what
the sliding layers unmap is memory the pool can lend to caches and head
starts, never memory admission counts on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F

from kvserve.models.paged_attention import first_key
from kvserve.physical.pool import AttentionShape
from kvserve.physical.vtensor import (
    ChunkPool,
    CpuBackend,
    OutOfPhysicalMemory,
    VTensorPool,
    VTensorStats,
    chunk_bytes_for,
)

T = TypeVar("T")
Rule = tuple[int, int]  # a layer's (window, attention chunk); (0, 0) is full attention

CHUNK_TARGET = 64 << 10  # small chunks suit CPU: little waste per request and layer


@dataclass
class VirtualSeq:
    """One request's part of a step; `prepare` may widen it (see the module docstring)."""

    request_id: str
    tokens: Sequence[int]  # every known token id of the request
    start: int  # first token computed this step
    num_new: int
    max_tokens: int  # the longest the request can grow: its virtual reservation


@dataclass
class _Plan:
    """What every layer needs about one request this step."""

    rows: slice  # its rows in the flattened batch
    start: int
    end: int
    first_key: dict[Rule, int]  # per layer rule
    bias: dict[Rule, torch.Tensor | None] = field(default_factory=dict)  # None: decode


def _bias(start: int, end: int, lo: int, rule: Rule, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [Q, end - lo]: causal, and inside the window or the query's own
    attention chunk; made once for all layers of a rule."""
    window, chunk = rule
    q = torch.arange(start, end)[:, None]
    k = torch.arange(lo, end)[None, :]
    visible = k <= q
    if window:
        visible &= k > q - window
    if chunk:
        visible &= k >= q // chunk * chunk
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


class VirtualAttention:
    """Attention backend over per-request, per-layer vTensors sharing one chunk pool."""

    def __init__(self, windows: Sequence[int], shape: AttentionShape, scale: float,
                 capacity_bytes: int, tokens_per_page: int,
                 chunk_target: int | None = None, ahead_tokens: int | None = None,
                 attention_chunks: Sequence[int] | None = None) -> None:
        """`ahead_tokens`: Extend ahead after each step by this many tokens (default: a
        chunk's worth, so a decoding request maps once per chunk, in `commit`); 0: never.
        `attention_chunks`: per layer, its chunked local attention's chunk (Llama 4), 0: none."""
        self.windows = list(windows)  # per layer; 0 for full attention
        self.attention_chunks = list(attention_chunks or [0] * len(self.windows))
        self.rules: list[Rule] = list(zip(self.windows, self.attention_chunks, strict=True))
        self.shape = shape
        self.scale = scale
        self.device = torch.device("cpu")
        bpt = shape.bytes_per_token()
        chunk = (chunk_bytes_for(bpt * tokens_per_page, chunk_target) if chunk_target
                 else chunk_bytes_of(shape, tokens_per_page))
        self.chunks = ChunkPool(CpuBackend(chunk, max(1, capacity_bytes // chunk)))
        self.pools = [VTensorPool(bpt, max_tokens=1, chunks=self.chunks, ahead_chunks=0)
                      for _ in self.windows]
        self.tokens_per_chunk = self.pools[0].tokens_per_chunk
        self.ahead_tokens = self.tokens_per_chunk if ahead_tokens is None else ahead_tokens
        self.window_unmap = True  # local layers unmap what left their reach (off: to compare)
        self.computed: dict[str, int] = {}  # tokens whose KV is written, per request
        self.recorded: dict[str, int] = {}  # chunks already in the prefix trees
        self.recomputed_tokens = 0  # gap tokens recomputed because a match fell short
        self.plans: list[_Plan] = []
        self.views: list[list[torch.Tensor]] = []

    # ------------------------------------------------------------ prepare

    def prepare(self, seqs: Sequence[VirtualSeq]) -> torch.Tensor:
        """Create / match / extend every request, then plan the step; returns positions.

        Widens `seqs` in place where a request's vTensor match is shorter than
        the memory core's hit.
        """
        for s in seqs:
            self._admit(s)
        for s in seqs:
            self._extend(s.request_id, s.start + s.num_new)
        self.seqs = list(seqs)
        self._plan(seqs)
        return torch.cat([torch.arange(s.start, s.start + s.num_new) for s in seqs])

    def _admit(self, s: VirtualSeq) -> None:
        """Give a new (or resumed) request its vTensors; recompute what they lack."""
        known = self.computed.get(s.request_id)
        if known is not None and s.start < known:
            # Preempted and resumed: its tail chunks may be recorded and shared by now.
            self.release(s.request_id)
            known = None
        if known is not None:
            # The core's hit may jump past what this request computed (another request
            # computed the prefix meanwhile): its own vTensor lacks the gap, recompute it.
            self._widen(s, known)
            return
        hit = self._create(s.request_id, s.tokens[:s.start], s.max_tokens)
        self._widen(s, hit)
        self.computed[s.request_id] = hit
        self.recorded[s.request_id] = hit // self.tokens_per_chunk

    def _widen(self, s: VirtualSeq, have: int) -> None:
        """Start the step at `have`, the tokens the vTensor holds, recomputing up to `s.start`."""
        self.recomputed_tokens += s.start - have
        s.num_new += s.start - have
        s.start = have

    def _create(self, rid: str, prefix: Sequence[int], max_tokens: int) -> int:
        """Create in every layer; the layers' trees may disagree, so keep their common match."""
        hits = []
        try:
            for pool in self.pools:
                hits.append(self._retry(lambda p=pool: p.create(rid, prefix, max_tokens)))
        except BaseException:
            for pool in self.pools[:len(hits)]:  # all layers or none: a retry starts clean
                pool.release(rid)
            raise
        common = min(hits)
        keep = common // self.tokens_per_chunk
        for pool in self.pools:
            pool.active[rid].unmap(keep)  # a longer match would be overwritten: not ours
        return common

    def _extend(self, rid: str, num_tokens: int) -> None:
        for pool in self.pools:
            self._retry(lambda p=pool: p.extend(rid, num_tokens))

    def _retry(self, op: Callable[[], T]) -> T:
        """Run a pool operation; when chunks run out, drop every layer's caches and head
        starts once and retry.

        A pool reclaims only its own caches, and the layers share one chunk pool.
        """
        try:
            return op()
        except OutOfPhysicalMemory:
            for pool in self.pools:
                pool.drop_ahead()
            self.trim()
            return op()

    def _plan(self, seqs: Sequence[VirtualSeq]) -> None:
        """Rows, key ranges and masks per request (shared by all layers), and the step's views."""
        H, D = self.shape.num_kv_heads, self.shape.head_dim
        self.plans, row = [], 0
        for s in seqs:
            end = s.start + s.num_new
            plan = _Plan(slice(row, row + s.num_new), s.start, end,
                         {r: first_key(s.start, *r) for r in set(self.rules)})
            for r, lo in plan.first_key.items():
                plan.bias[r] = None if s.num_new == 1 else _bias(
                    s.start, end, lo, r, self.shape.dtype)
            self.plans.append(plan)
            row += s.num_new
        self.views = [[pool.view(s.request_id, self.shape.dtype).view(-1, 2, H, D)
                       for s in seqs] for pool in self.pools]

    # ------------------------------------------------------------------ call

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        rule = self.rules[layer_idx]
        out = torch.empty_like(q)
        for plan, kv in zip(self.plans, self.views[layer_idx]):
            kv[plan.start:plan.end, 0] = k[plan.rows]
            kv[plan.start:plan.end, 1] = v[plan.rows]
            lo = plan.first_key[rule]
            out[plan.rows] = self._attend(q[plan.rows], kv[lo:plan.end], plan.bias[rule])
        return out

    def _attend(self, q: torch.Tensor, kv: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """q [Q, Hq, D] over kv [L, 2, Hkv, D] -> [Q, Hq, D]; K and V are read in place.

        Decode (no mask: the keys given are the ones it sees) folds the query
        heads sharing a KV head into query rows of that head: one SDPA row
        block, ~2.5x faster on CPU than SDPA's own GQA. Prefill uses SDPA's GQA
        instead, so the mask stays [Q, L] rather than growing with the group
        (folding is no faster there).
        """
        Q, Hq, D = q.shape
        Hkv = kv.shape[2]
        keys = kv[:, 0].transpose(0, 1)[None]  # [1, Hkv, L, D], a strided view
        values = kv[:, 1].transpose(0, 1)[None]
        if bias is None:
            qg = q.view(1, Hkv, (Hq // Hkv) * Q, D)  # Q == 1: the heads are the rows
            out = F.scaled_dot_product_attention(qg, keys, values, scale=self.scale)
            return out.view(Q, Hq, D)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values,
                                             attn_mask=bias, scale=self.scale,
                                             enable_gqa=Hq != Hkv)
        return out[0].transpose(0, 1)

    # ------------------------------------------------------------ after step

    def commit(self) -> None:
        """The step's KV is written: record newly complete chunks, drop the views, and
        Extend ahead for the next steps."""
        tpc = self.tokens_per_chunk
        seqs = self.seqs
        for s in seqs:
            end = s.start + s.num_new
            self.computed[s.request_id] = end
            full = end // tpc
            if full > self.recorded.get(s.request_id, 0):
                for pool in self.pools:
                    pool.record(s.request_id, s.tokens[:full * tpc])
                self.recorded[s.request_id] = full
        self.views, self.plans, self.seqs = [], [], []
        if self.window_unmap:
            for s in seqs:  # after the views are dropped: no placeholders needed for them
                self.unmap_window(s.request_id, s.start + s.num_new)
        if self.ahead_tokens:
            for s in seqs:
                self._map_ahead(s.request_id, s.start + s.num_new + self.ahead_tokens)

    def unmap_window(self, rid: str, end: int) -> int:
        """Unmap, in every sliding and chunked layer, `rid`'s chunks wholly before the keys
        a query at `end` (the next step's first) sees; returns the chunks unmapped.

        Later queries see no lower key (windows and attention chunks only move
        forward). A chunk is kept while any of its tokens is still visible, so
        up to window - 1 + one chunk of tokens stay mapped behind `end` in a
        sliding layer, and the current attention chunk + one in a chunked one.
        """
        gone = 0
        for rule, pool in zip(self.rules, self.pools):
            if rule != (0, 0):
                upto = first_key(end, *rule) // self.tokens_per_chunk
                gone += pool.active[rid].unmap_head(upto)
        return gone

    def _map_ahead(self, rid: str, num_tokens: int) -> None:
        """Extend ahead in every layer: map (best effort) the first `num_tokens` tokens of `rid`.

        The layers map in step, so one look at the last layer says whether any
        has something to do (a per-layer call on every step would cost more
        than the maps themselves).
        """
        want = -(-num_tokens // self.tokens_per_chunk)
        last = self.pools[-1].active[rid]
        if len(last.chunks) >= min(want, last.slots):
            return
        for pool in self.pools:
            pool.map_ahead(rid, num_tokens)

    def release(self, request_id: str) -> None:
        """Release (lazily) a finished, aborted or preempted request's vTensors."""
        if self.computed.pop(request_id, None) is None:
            return
        self.recorded.pop(request_id, None)
        for pool in self.pools:
            pool.release(request_id)

    def retain(self, running: Iterable[str]) -> None:
        """Release every request not in `running` (the scheduler preempted it)."""
        for rid in set(self.computed) - set(running):
            self.release(rid)

    def trim(self, idle_s: float = 0.0) -> int:
        """Drop caches idle for `idle_s` seconds in every layer; returns the bytes punched."""
        return sum(pool.trim(idle_s) for pool in self.pools)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, int]:
        """Memory across layers; `shared_chunks` are mapped by more than one request now."""
        per_layer: list[VTensorStats] = [pool.stats() for pool in self.pools]
        holders: dict[int, int] = {}
        for pool in self.pools:
            for vt in pool.active.values():
                for c in vt.mapped_chunks():
                    holders[c] = holders.get(c, 0) + 1
        return {
            "reserved_bytes": sum(s.reserved_bytes for s in per_layer),
            "mapped_bytes": sum(s.mapped_bytes for s in per_layer),
            "sliding_mapped_bytes": sum(s.mapped_bytes for s, w in zip(per_layer, self.windows)
                                        if w),
            "chunked_mapped_bytes": sum(s.mapped_bytes for s, c
                                        in zip(per_layer, self.attention_chunks) if c),
            "referenced_bytes": per_layer[0].referenced_bytes,  # the shared chunk pool's
            "physical_bytes": per_layer[0].physical_bytes,
            "active": per_layer[0].active,
            "prefix_nodes": sum(s.prefix_nodes for s in per_layer),
            "shared_chunks": sum(1 for n in holders.values() if n > 1),
            "chunk_bytes": self.chunks.chunk_bytes,
            "capacity_bytes": self.chunks.chunk_bytes * self.chunks.backend.num_chunks,
            "recomputed_tokens": self.recomputed_tokens,  # a counter: only ever grows
        }

    def close(self) -> None:
        for pool in self.pools:
            for rid in list(pool.active):
                pool.release(rid)
            pool.trim()
        self.chunks.backend.close()


def chunk_bytes_of(shape: AttentionShape, tokens_per_page: int) -> int:
    """The backend's chunk: whole memory-core pages of tokens, at most `CHUNK_TARGET`."""
    return chunk_bytes_for(shape.bytes_per_token() * tokens_per_page, CHUNK_TARGET)


def core_budget(kv_bytes: int, num_layers: int, chunk_bytes: int, page_bytes: int,
                max_seqs: int) -> int:
    """The memory core's budget when `kv_bytes` is the vTensor pool's physical ceiling.

    The core accounts every layer as full attention here (`attention_specs`
    with `full_history`), as the prefix trees hold every layer's whole history, so
    its pages count the tokens the chunks hold. What it cannot see is chunk
    rounding: a request's own KV starts and ends inside a chunk (a prefix hit
    ending mid-chunk is recomputed into its own chunk), up to two chunks per
    layer more than its pages. That slack is kept out of the core's budget for
    as many requests as can run: `max_seqs`, or as many as hold one page per
    layer each, whichever is fewer. Extend ahead's head starts need no slack:
    they come from free chunks only and are taken back first when a request
    needs one (`VTensorPool._reclaim`). Not covered: vTensor prefix trees trimmed
    (idle release) under the core's cache while several requests share that
    prefix at once; Extend then reclaims the vTensor caches, and a step that
    still finds no chunk fails with OutOfPhysicalMemory.
    """
    slack = 2 * chunk_bytes * num_layers
    by_seqs = kv_bytes - max_seqs * slack
    by_pages = kv_bytes * page_bytes // (page_bytes + slack // num_layers)
    return max(by_seqs, by_pages)
