"""Upper bounds on the prefix hit rate of a trace, for judging an eviction policy.

- `infinite_pool`: every block any earlier request computed is still
  cached. No policy can hit more (with requests admitted in arrival order).
- `belady`: a pool of the policy's own size, holding nothing but cache
  (running requests take no room), and an offline clairvoyant keeping whole
  prefix units: each request's `prefix_id` names a unit, and between two
  requests of a unit the cache may hold what the second one can hit, at the
  bytes the policy's layout needs for that hit. On a miss the unit is
  cached if it is reused sooner than some cached unit; units reused furthest
  in the future (or never) are evicted first (Belady's MIN, with bypass).
  With units of different sizes MIN is a heuristic rather than a proof, but
  with no running requests and no timing it is the ceiling we compare to.
- `belady` with `peak`: the same, but the requests run one at a time and
  each holds, while it runs, the pages it hit and those computing its
  uncached tokens take at their peak (`peak_bytes`: for a sliding window
  the window plus a prefill chunk, the whole chunk being written at once),
  whether or not its unit stays cached after it. Any policy needs that room
  beside its cache at that moment, more with requests running together, so
  this is the tighter ceiling where prompts are long.
- `belady` with `peak` and `busy`: the same, and each other request the run had
  running at that moment (`busy`: its first token to its finish, so it has its
  whole prompt) holds the least room any layout needs beside the cache to go on
  (`run_bytes`: its full-attention pages past its hit, a window's worth of
  sliding pages, its live Mamba state). Any policy serving the trace with the
  run's concurrency needs that room too, so this is the ceiling where many
  requests run at once (a chat's answers: dozens of turns decode together).

- `belady` with `order_blind`: not a bound but a reference for shuffled
  traces, where MIN's knowledge of *when* each unit comes back is what no
  online policy has. Units are kept by how many more times they will be
  used (known), not when: the fewest remaining uses go first. On a trace
  whose order is random this is about the best an online policy can expect;
  on a loop (every unit used as often) it keeps an arbitrary set.
- `belady` with `recency`: not a bound either, but what recency alone gets in
  the same idealised pool: units kept by their last use (LRU), each cached
  after its request whether or not it comes back (no policy knows that a
  conversation ended or that an article's last question was asked), at
  the size of what a next request could hit: its shared prefix (an
  article), else its whole sequence (a conversation so far). Where jenga is
  far below MIN but close to this, the rest is knowing the future.

All count as the simulator does: hit tokens over prompt tokens at each
request's first lookup, a hit of at most (prompt_len - 1) // T blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from kvserve.memory import KVCacheManager, LayerKind
from kvserve.memory.prefix_cache import extend_block_hashes
from kvserve.sim.traces import OUTPUT_TOKEN, TokenSynth, TraceRequest


def _hits(trace: Sequence[TraceRequest], T: int) -> list[int]:
    """Per request (arrival order): tokens an infinite cache would serve it."""
    synth, seen, out = TokenSynth(), set(), []
    for tr in sorted(trace, key=lambda r: r.arrival):
        prompt = synth.prompt_ids(tr)
        hashes: list[int] = []
        extend_block_hashes(hashes, prompt, T)
        q = 0
        for h in hashes[:(len(prompt) - 1) // T]:
            if h not in seen:
                break
            q += 1
        out.append(q * T)
        # The KV of the prompt and every output token but the last is computed.
        seq = prompt + [OUTPUT_TOKEN] * (tr.output_len - 1)
        extend_block_hashes(hashes, seq, T)
        seen.update(hashes)
    return out


def infinite_pool(trace: Sequence[TraceRequest], T: int = 16) -> float:
    """The hit rate with an unbounded cache."""
    ordered = sorted(trace, key=lambda r: r.arrival)
    total = sum(r.prompt_len for r in ordered)
    return sum(_hits(ordered, T)) / total if total else 0.0


def hit_bytes(kv: KVCacheManager) -> Callable[[int], int]:
    """Bytes the manager's layout holds so that a prefix of n tokens hits in every spec."""
    T = kv.T

    def size(n: int) -> int:
        total = 0
        for m in kv.managers:
            spec, pages = m.spec, -(-n // T)
            if spec.kind is LayerKind.SLIDING:
                pages = min(pages, -(-spec.window // T) + 1)
            elif spec.kind is LayerKind.CHUNKED:
                pages = min(pages, spec.chunk // T + 1)
            elif spec.kind is LayerKind.MAMBA:
                pages = 1
            elif spec.kind is not LayerKind.FULL:
                pages = 0  # image pages: not part of a text prefix
            total += pages * kv.layout.page_bytes[m.s]
        return total

    return size


def peak_bytes(kv: KVCacheManager, chunk: int) -> Callable[[int], int]:
    """Bytes one request computing n tokens holds at its peak, prefilled `chunk` at a time."""

    def size(n: int) -> int:
        return sum(m.peak_pages(n, chunk, ()) * kv.layout.page_bytes[m.s] for m in kv.managers)

    return size


def run_bytes(kv: KVCacheManager) -> Callable[[int, int], int]:
    """Bytes a running request with n tokens computed, h of them hit, holds beside what
    its hit's cached unit holds, at the least any layout needs to go on computing."""
    T = kv.T

    def size(h: int, n: int) -> int:
        total, new = 0, -(-(n - h) // T)
        for m in kv.managers:
            spec = m.spec
            if spec.kind is LayerKind.FULL:
                pages = new
            elif spec.kind is LayerKind.SLIDING:
                pages = min(new, -(-spec.window // T))
            elif spec.kind is LayerKind.CHUNKED:
                pages = min(new, -(-(n % spec.chunk) // T))
            elif spec.kind is LayerKind.MAMBA:
                pages = 1  # the live state: a cached checkpoint is not updated in place
            else:
                pages = 0  # image pages: not part of a text prefix
            total += pages * kv.layout.page_bytes[m.s]
        return total

    return size


def belady(trace: Sequence[TraceRequest], capacity: int, size: Callable[[int], int],
           T: int = 16, peak: Callable[[int], int] | None = None,
           order_blind: bool = False, recency: bool = False,
           busy: dict[str, tuple[float, float]] | None = None,
           room: Callable[[int, int], int] | None = None) -> float:
    """The hit rate of offline MIN over prefix units in `capacity` bytes (see module doc);
    with `peak`, each request's own peak room is kept free while it runs; with `busy`
    (request id -> the run's first token and finish), also `room(hit, prompt_len)` for
    each other request running then; with `order_blind`, units are ranked by their
    remaining uses instead of their next one; with `recency`, by their last use, and
    cached as an online cache would (LRU)."""
    ordered = sorted(trace, key=lambda r: r.arrival)
    hits = _hits(ordered, T)
    nxt: list[int] = [len(ordered)] * len(ordered)  # next request of the same unit
    left: list[int] = [0] * len(ordered)  # later requests of the same unit
    last: dict[str, int] = {}
    for i, tr in reversed(list(enumerate(ordered))):
        if tr.prefix_id is not None:
            if tr.prefix_id in last:
                nxt[i], left[i] = last[tr.prefix_id], left[last[tr.prefix_id]] + 1
            last[tr.prefix_id] = i
    cached: dict[str, tuple[int, int, int]] = {}  # unit -> (rank, bytes, tokens)
    heap: list[tuple[int, str]] = []  # (rank, unit), lowest first out; stale entries skipped
    used = got = 0
    # The others' room (busy): requests yet to reach their first token by (first token,
    # finish, room), those past it by (finish, room); `others` is the latter's sum.
    starts: list[tuple[float, float, int]] = []
    ends: list[tuple[float, int]] = []
    others = 0
    for i, tr in enumerate(ordered):
        u = tr.prefix_id  # None: shares nothing, but takes room while it runs
        h = 0  # tokens hit
        if u in cached:
            _, nbytes, kept = cached.pop(u)
            h = min(hits[i], kept)
            used -= nbytes
        got += h
        while starts and starts[0][0] <= tr.arrival:
            _, end, nbytes = heapq.heappop(starts)
            heapq.heappush(ends, (end, nbytes))
            others += nbytes
        while ends and ends[0][0] <= tr.arrival:
            others -= heapq.heappop(ends)[1]
        j = nxt[i]
        if recency:  # what a next request could hit, whether or not one comes
            keeps = u is not None
            keep = (tr.prefix_len or tr.prompt_len + tr.output_len - 1) // T * T
        else:
            keeps = j < len(ordered)
            keep = hits[j] if keeps else 0
        need = size(keep) if keeps else 0
        # Room the request holds while it runs: its peak for what it computes, and the
        # pages it hit. Kept cached, its unit's bytes are part of that room, not added
        # to it; evicted (MIN bypasses a unit needed later than the rest), it still
        # holds all of it until it finishes.
        held = 0
        if peak is not None:
            held = peak(tr.prompt_len - h + tr.output_len) + (size(h) if h else 0)
        extra = held
        if keeps and max(need, held) + others <= capacity:
            # fewest uses left / least recently used / furthest next use
            rank = left[i] if order_blind else i if recency else -j
            cached[u] = (rank, need, keep)
            used += need
            heapq.heappush(heap, (rank, u))
            extra = max(0, held - need)
        while used + extra + others > capacity and heap:
            rank, v = heapq.heappop(heap)
            if cached.get(v, (None,))[0] == rank:
                used -= cached.pop(v)[1]
                if v == u:
                    extra = held
        if busy is not None and room is not None and tr.id in busy:
            # From its first token to its end it has its prompt. What its unit keeps
            # cached for the next request (a conversation so far) is that same KV: only
            # the rest is room beside the cache (the unit may go later: a lower bound).
            first, end = busy[tr.id]
            kept_bytes = cached[u][1] if u in cached else 0
            heapq.heappush(starts, (first, end, max(0, room(h, tr.prompt_len) - kept_bytes)))
    total = sum(r.prompt_len for r in ordered)
    return got / total if total else 0.0
