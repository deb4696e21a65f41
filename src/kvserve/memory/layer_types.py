"""Per-layer-type rules: which pages are active, which prefixes hit, what is cached.

One small manager per spec (as vLLM v1 gives each layer type its own
manager), all behind KVCacheManager. Each follows Jenga's LayerProperty:

- page size: Layout.page_bytes[s];
- active pages: `window_start(c)` for the text stream, the live state for
  Mamba, the image pages for cross/vision; pages that stop being active are
  released at once (evictable if cached, else empty);
- possible prefixes: `possible_prefix(is_hit)` (the paper's interface) and
  `longest_hit(req, p)`, its fast form used by lookups;
- update_last_access: done lazily. A used page cannot be evicted, so its
  last access only matters from the moment its last user lets go; `free`
  stamps it with that step. Pages that leave a window early get early times,
  and all pages a request holds at finish get the same time (balanced rule);
- set_prefix_length: text pages carry the token count through their block,
  so among equal times the longest prefixes go first (aligned rule); all pages
  of one image share one random value, so an image is evicted whole.

Beyond the paper, admission by reuse likelihood (after Marconi, MLSys 2025):
a page that leaves a window or a Mamba checkpoint taken mid-prompt can only
ever serve a hit at a few prefix ends (the W tokens after it, the next
checkpoint interval). If one of the request's reuse points lies there
(`ReusePoints`), the request keeps holding it until it finishes, as it holds
its full-attention pages: a prefix is one unit, so a running request's
prefix stays servable in every spec (new requests cannot evict half of
it), and at finish its full-attention pages and its last window get one
time and leave together. Otherwise it is cached with the key DEAD and goes
before any page that can still serve a hit. Held pages are given up early
only when a running request would otherwise run out of memory.

Prefix lengths `p`, `q` here are in blocks of T tokens.
"""

from __future__ import annotations

import random
from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass, field

from kvserve.memory.allocator import DEAD, RequestId, TwoLevelAllocator
from kvserve.memory.prefix_cache import ImageInput, image_page_key
from kvserve.memory.spec import KVSpec, LayerKind

LOOP = -(1 << 61)  # keys of loop members' pages: LOOP - step, above DEAD, below any step

NO_PAGE = -1


@dataclass
class RequestKV:
    """What the memory core knows of one request."""

    req_id: RequestId
    tokens: Sequence[int]  # the request's token ids; the engine appends to it
    images: tuple[ImageInput, ...]
    hashes: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is written
    num_alloc: int = 0  # tokens that have slots
    tables: list[list[int]] = field(default_factory=list)  # per spec
    released: list[int] = field(default_factory=list)  # per spec: leading blocks let go
    pending: list[list[tuple[int, int]]] = field(default_factory=list)  # per spec
    num_hit: int = 0  # prefix tokens taken from the cache
    num_host_hit: int = 0  # of them, tokens loaded from the host tier
    prompt_len: int = 0  # tokens known at add_request
    # eviction key of everything it releases, instead of the step (ReusePoints.reuse_key)
    key: int | None = None
    gap: int = 0  # arrivals since its prefix was last used (0: first seen)
    loop: bool = False  # its prefix comes back at regular gaps: ReusePoints.reuse_key
    next_turn: bool = False  # a conversation's next turn: ReusePoints.next_turn
    # it keeps no windows or checkpoints for reuse points (they did not fit beside its
    # own pages: KVCacheManager.go_lean)
    lean: bool = False
    arrival: int = 0  # its place in arrival order: the clock of reuse gaps
    # per spec: (page, hash) of cached pages a reuse point needs; stamped at finish
    kept: dict[int, list[tuple[int, Hashable]]] = field(default_factory=dict)
    # per spec: pages out of the window or checkpoints a reuse point needs, still
    # referenced by the request; freed at finish with the rest
    held: dict[int, list[int]] = field(default_factory=dict)
    # per Mamba spec: the position whose state its tail page holds (MambaState._tail)
    tail: dict[int, int] = field(default_factory=dict)
    # DistAttention: leading tokens whose full-attention KV was lent to other instances
    # (their table entries are NO_PAGE here); a multiple of the block size
    lent: int = 0


def _put_newest(d: dict, key: Hashable, value: object, limit: int) -> None:
    """d[key] = value as d's newest entry; past `limit` entries the oldest goes."""
    d.pop(key, None)
    d[key] = value
    if len(d) > limit:
        del d[next(iter(d))]


class ReusePoints:
    """Prefix ends (in blocks) where a cached prefix is likely to be hit again.

    A request's reuse points are the end region of its prompt (the next turn
    or a repeated question extends it), its sequence end (the pages it holds
    at finish) and the marks: block hashes where a lookup found a hit, or
    found that the full-attention cache held a longer prefix than the other
    layer types could serve (a divergence point: another request shares the
    prefix up to there). A mark makes the next request that prefills
    through the point keep the pages a hit there needs (speculative
    insertion), so the request after it hits. Marks are few (one or two per
    lookup); the oldest are dropped past `limit`.
    """

    SAMPLE = 64  # blocks between the prefix hashes remembered at finish

    def __init__(self, block: int, limit: int = 1 << 16) -> None:
        self.T = block
        self.limit = limit
        self.marks: dict[Hashable, None] = {}
        # Hits on a prefix that is not where some request stopped: prompts sharing a
        # prefix, not a conversation's next turn or a preempted request coming back.
        self.branched = 0
        # Hits that continue a finished request's sequence or extend a whole answered
        # prompt with more: conversations' next turns.
        self.continued = 0
        # Prefixes finished requests had (blocks 1, 2, 4, .. SAMPLE/2, every SAMPLE-th
        # and the sequence end, so any prefix has one at least half as long) -> that
        # request's arrival, the gap (in arrivals) after which it had come back (0:
        # first seen) and whether it was a loop member; cached or not. Gaps counted in
        # arrivals, not steps or admissions, are the trace's own reuse distances: they
        # stay the same when a queue builds up or requests are admitted out of order.
        self.seen: dict[Hashable, tuple[int, int, bool]] = {}
        self.protect: bool | None = None  # fixes the loop rule for lost prefixes (tests)
        # Where requests stopped (finished, aborted or preempted after computing some
        # of their tokens) -> their prompt's end (blocks): a hit there extends that
        # sequence (the next turn of a conversation, or the preempted request itself).
        # It says nothing of another request stopping there (not a mark), and the
        # windows its prompt's end region kept serve no one any more (TextStream.retire).
        self.ends: dict[Hashable, int] = {}
        # Whole prompts of requests that generated, by their last full block -> the
        # prompt's tokens after it: a request that extends one is a conversation's next
        # turn too, whatever the client made of the reply (re-tokenized text need not
        # repeat the generated ids). The tail tells a whole prompt from a shared
        # document that merely ends in the same block.
        self.turns: dict[Hashable, tuple[int, ...]] = {}
        # Prompt heads (by their last block's hash) known to share no block with `ends`
        # or `turns`: a queued prompt is looked up every step, and the scan was most
        # of the simulator's time with 20K-token articles queued. Only new entries
        # there can change the answer, so they clear it.
        self.apart: set[Hashable] = set()

    def remember(self, r: RequestKV) -> None:
        hashes, seen, t = r.hashes, self.seen, r.arrival
        n = min(len(hashes), r.num_computed // self.T)  # blocks whose KV was written
        short = [1 << i for i in range(self.SAMPLE.bit_length() - 1) if 1 << i < n]
        turn = r.prompt_len // self.T if r.num_computed > r.prompt_len else 0
        if 0 < turn < n:
            _put_newest(self.turns, hashes[turn - 1], tuple(r.tokens[turn * self.T:r.prompt_len]),
                        self.limit)
        for e in [*short, *range(self.SAMPLE, n, self.SAMPLE), turn, n]:
            if e:
                seen.pop(hashes[e - 1], None)
                seen[hashes[e - 1]] = (t, r.gap, r.loop)
        while len(seen) > 2 * self.limit:
            del seen[next(iter(seen))]
        if n:
            _put_newest(self.ends, hashes[n - 1], r.prompt_len // self.T, self.limit)
        self.apart.clear()

    def reuse_key(self, r: RequestKV, p: int, q: int, now: int) -> int | None:
        """The eviction key of r's pages if r belongs to a loop, else None (the step).

        A loop over more prefixes than fit defeats LRU: the prefix used
        longest ago is the next one needed, so every request misses. A prefix
        is taken for a loop member when it was lost (cached once, now gone) or
        was a loop member already, and it comes back either after a gap (in
        arrivals) within 2x of its previous one, or for the first time,
        branching off (not continuing a finished request's sequence: a
        conversation's next turn keeps LRU). Chat sessions with random think
        times rarely pass the gap test, and plain LRU serves them better.
        Without the first-return case the loop rule started only on a prefix's
        third use, after LRU had emptied the cache of the loop once more (32
        Gemma 3 articles round-robin, 8192-token steps, 1/s: 53.5% -> 59.8%).

        Loop members' pages get LOOP - now: below every step, so they leave
        before pages of other traffic, and the latest first among themselves
        (MRU, Belady's choice in a loop: the prefix just used is the one
        needed furthest ahead). A miss in a loop then evicts the prefix that
        just hit, not the one about to, and a stable set keeps hitting.
        (Set dueling between prefix groups was tried first and dropped: the
        groups share one pool, so a protected group's old keys always lost to
        the other groups' new ones and the duel picked the wrong rule.)
        """
        lost = True
        # A lost system prompt alone says little about the request: half its prompt.
        found = self._last_use(r.hashes, p, max(q, p // 2))
        if found is None and q:  # a hit: how its prefix was last used
            lost = False
            found = self._last_use(r.hashes, q, q // 2)
        if found is None:
            return None
        then, gap_before, loop_before, e = found
        gap = r.gap = max(1, r.arrival - then)
        regular = gap_before * 2 >= gap >= gap_before / 2
        first = not gap_before and not self.continues(r, e)
        r.loop = (regular or first) and (lost or loop_before)
        if self.protect is not None:
            r.loop = self.protect and lost
        return LOOP - now if r.loop else None

    def continues(self, r: RequestKV, e: int) -> bool:
        """Whether r's first e blocks end a finished request's sequence or a whole
        answered prompt: r goes on with that request's conversation."""
        return r.hashes[e - 1] in self.ends or self.is_turn(r, e)

    def next_turn(self, r: RequestKV, p: int) -> bool:
        """Whether r's first p blocks extend a finished request's answered sequence or a
        whole answered prompt, cached or not: a conversation's next turn, hit again where
        it ends rather than in its prompt's end region. (A request that stopped inside
        its prompt, preempted, left no answer: another one sharing its prefix is none.)"""
        ends, hashes = self.ends, r.hashes
        if p < 2 or hashes[p - 2] in self.apart:
            return False
        head = hashes[:p - 1]
        if ends.keys().isdisjoint(head) and self.turns.keys().isdisjoint(head):
            if len(self.apart) < self.limit:
                self.apart.add(hashes[p - 2])
            return False  # most prompts: one pass in C, not a loop per block
        for e in range(p - 1, 0, -1):
            pe = ends.get(hashes[e - 1])
            if pe is not None and pe < e or self.is_turn(r, e):
                return True
        return False

    def is_turn(self, r: RequestKV, e: int) -> bool:
        """Whether r's first e blocks and the tokens after them are a whole prompt that
        was answered (r continues that conversation)."""
        tail = self.turns.get(r.hashes[e - 1])
        return tail is not None and tuple(r.tokens[e * self.T:e * self.T + len(tail)]) == tail

    def _last_use(self, hashes: list[int], hi: int, lo: int) -> tuple[int, int, bool, int] | None:
        """What `seen` holds of the longest prefix of hi..lo+1 blocks, if any, and its
        length."""
        seen = self.seen
        for e in range(hi, lo, -1):
            found = seen.get(hashes[e - 1])
            if found is not None:
                return (*found, e)
        return None

    def mark(self, h: Hashable) -> None:
        _put_newest(self.marks, h, None, self.limit)

    # Tokens before the prompt's end that count as its end region: a question or an
    # instruction after a shared document usually fits; a longer one is found as a
    # divergence by the next lookup.
    PROMPT_TAIL = 256

    def points(self, r: RequestKV, lo: int, hi: int) -> list[int]:
        """Reuse points e with lo <= e <= hi (blocks, ascending); PROMPT_TAIL tokens
        before the prompt's end count as its end region."""
        if r.lean:
            return []
        hashes, marks = r.hashes, self.marks
        end = r.prompt_len // self.T
        # a next turn is hit again where it ends: no end region (-1)
        margin = -1 if r.next_turn else self.PROMPT_TAIL // self.T
        hi = min(hi, len(hashes))
        return [e for e in range(max(lo, 1), hi + 1)
                if end - margin <= e <= end or hashes[e - 1] in marks]


class SpecManager:
    """Rules of one spec over the shared allocator."""

    def __init__(
        self, s: int, spec: KVSpec, alloc: TwoLevelAllocator | None, block: int
    ) -> None:
        self.s = s
        self.spec = spec
        self.alloc = alloc
        self.T = block
        self.reuse: ReusePoints | None = None  # None: every released page is admitted

    def page_size(self) -> int:
        return self.alloc.layout.page_bytes[self.s]

    # lookup
    def possible_prefix(self, is_hit: Sequence[bool]) -> set[int]:
        """Every prefix length (in blocks, >= 1) this spec can serve."""
        raise NotImplementedError

    def longest_hit(self, r: RequestKV, p: int, cached: Container | None = None) -> int:
        """The longest prefix q <= p this spec can serve from the cache (or from
        `cached`, the block keys of several tiers)."""
        raise NotImplementedError

    # Specs whose cached pages a lower tier keeps: the text stream and Mamba states.
    # Image pages are re-encoded instead (their hits need no prefix to match).
    swappable = True

    def hit_keys(self, r: RequestKV, q: int) -> list[Hashable]:
        """Block keys of the cached pages claim_hit(r, q) takes."""
        raise NotImplementedError

    def claim_hit(self, r: RequestKV, q: int) -> None:
        raise NotImplementedError

    # allocation
    def num_new_pages(self, r: RequestKV, upto: int) -> int:
        raise NotImplementedError

    def install(self, r: RequestKV, pids: list[int], upto: int) -> None:
        raise NotImplementedError

    def advance(self, r: RequestKV, done: int, now: int) -> None:
        """KV of tokens [.., done) is written: cache it, release what left."""
        raise NotImplementedError

    def release_inactive(self, r: RequestKV, c: int, now: int) -> None:
        """Let go of pages no query at position >= c needs."""

    def retire(self, r: RequestKV, q: int, prompt_end: int) -> None:
        """r hits at q, continuing a finished request's sequence or branching off a cached
        one: cached pages that only served that request's other reuse points may go
        first (TextStream)."""

    def peak_pages(self, num_tokens: int, chunk: int, images: Sequence[ImageInput]) -> int:
        """Most pages one request of num_tokens holds when prefilled in chunks."""
        raise NotImplementedError

    def free_all(self, r: RequestKV, now: int) -> None:
        kept = r.kept.pop(self.s, None)
        if kept:  # pages let go early for a reuse point leave with the rest
            hashes = self.alloc.specs[self.s].hash
            self.alloc.touch(self.s, [p for p, h in kept if hashes[p] == h], now)
        table = r.tables[self.s]
        # Tail first: equal times evict the longest prefix first, so this order
        # reaches the eviction queue already sorted.
        self.alloc.free(self.s, [p for p in reversed(table) if p != NO_PAGE], now)
        table.clear()
        self.drop_held(r, now)
        for _, pid in r.pending[self.s]:
            self.alloc.free(self.s, [pid], now)
        r.pending[self.s].clear()

    def take_back(self, r: RequestKV, key: int) -> None:
        """Undo claim_hit: the hit pages keep the eviction keys they had, or `key` where
        that is later."""
        table, pending = r.tables[self.s], r.pending[self.s]
        pids = [p for p in table if p != NO_PAGE] + [p for _, p in pending]
        self.alloc.unclaim(self.s, pids[::-1], key)  # tail first, as free_all
        table.clear()
        pending.clear()

    def drop_held(self, r: RequestKV, now: int) -> None:
        """Let go of the pages r holds only for its reuse points (they stay cached)."""
        held = r.held.pop(self.s, None)
        if held:  # longest prefix first, as free_all's order (aligned rule)
            plen = self.alloc.specs[self.s].plen
            self.alloc.free(self.s, sorted(held, key=plen.__getitem__, reverse=True), now)

    def early_pages(self, r: RequestKV) -> list[int]:
        """Pages the step in flight writes only for r's reuse points (none but under
        TextStream.window_only)."""
        return []

    def live_slots(self, r: RequestKV) -> list[tuple[object, int]]:
        """(key, slots) of the tokens this request needs now; shared blocks share a key.

        Computed from the request alone, not from pages held, so it gives the
        byte-exact ideal of the model's specs under any policy.
        """
        raise NotImplementedError


class TextStream(SpecManager):
    """Full, sliding-window and chunked-local attention over the text tokens."""

    # Whether the attention reads a step's own keys from its activations, so that a
    # windowed spec needs pages only for the keys later steps read (`_written`).
    window_only = False

    def free_all(self, r: RequestKV, now: int) -> None:
        # What r generated serves only a next turn of its conversation: while no
        # request has continued a finished one (ReusePoints.continued), its pages go
        # before any page that can hit. Gemma 3 12B, 32 articles round-robin, 1/s:
        # 39.1% -> 41.7%; chat keeps them (its next turns count from the first one).
        if self.reuse is not None and not self.reuse.continued:
            table, cut = r.tables[self.s], r.prompt_len // self.T
            self.alloc.free(self.s, [p for p in reversed(table[cut:]) if p != NO_PAGE], DEAD)
            del table[cut:]
        super().free_all(r, now)

    def window_start(self, c: int) -> int:
        """First token a query at position c (or later) may read."""
        kind = self.spec.kind
        if kind is LayerKind.SLIDING:
            return max(0, c - self.spec.window)
        if kind is LayerKind.CHUNKED:
            return c - c % self.spec.chunk
        return 0

    def _first_block(self, q: int) -> int:
        return self.window_start(q * self.T) // self.T

    def possible_prefix(self, is_hit: Sequence[bool]) -> set[int]:
        return {
            q for q in range(1, len(is_hit) + 1)
            if all(is_hit[b] for b in range(self._first_block(q), q))
        }

    def longest_hit(self, r: RequestKV, p: int, cached: Container | None = None) -> int:
        hashes = r.hashes
        if cached is None:
            cached = self.alloc.specs[self.s].cached
        if self.spec.kind is LayerKind.FULL:  # every block counts: the first miss ends it
            for b in range(p):
                if hashes[b] not in cached:
                    return b
            return p
        q = p
        b = q - 1
        # Scan down; a miss at b makes b the next candidate, whose window
        # reaches further back. b only decreases, so this is O(p).
        while b >= self._first_block(q):
            if hashes[b] in cached:
                b -= 1
            else:
                q = b
                b = q - 1
        return q

    def hit_keys(self, r: RequestKV, q: int) -> list[Hashable]:
        return r.hashes[self._first_block(q):q]

    def claim_hit(self, r: RequestKV, q: int) -> None:
        first = self._first_block(q)
        cached, hashes = self.alloc.specs[self.s].cached, r.hashes
        pids = [cached[hashes[b]] for b in range(first, q)]
        self.alloc.claim(self.s, pids)
        r.tables[self.s] = [NO_PAGE] * first + pids
        r.released[self.s] = first

    @property
    def _unpaged_keys(self) -> bool:
        """Whether some of a step's keys may get no page: window_only, a windowed spec."""
        return self.window_only and self.spec.kind is not LayerKind.FULL

    def _written(self, r: RequestKV, upto: int) -> list[bool] | None:
        """For r's new blocks up to token `upto`: whether each gets a page (None: all).

        Every block does, unless `window_only`: then a windowed spec's block does
        only if a later step reads it, i.e. it lies in the window at `upto` or in
        the window before one of r's reuse points. The step's queries read the
        others from the step's own keys, so a prompt prefilled in one step never
        holds more than a window of pages per layer outside its reuse points:
        Gemma 3 12B's 40 sliding layers hold 1K tokens of a 20K-token prompt.
        """
        if not self._unpaged_keys:
            return None
        lo, hi = len(r.tables[self.s]), -(-upto // self.T)
        keep = max(lo, min(hi, self.window_start(upto) // self.T))
        if keep == lo:
            return None
        useful = ([False] * (keep - lo) if self.reuse is None
                  else self._serves_reuse_point(r, lo, keep))
        return useful + [True] * (hi - keep)

    def num_new_pages(self, r: RequestKV, upto: int) -> int:
        written = self._written(r, upto)
        if written is None:
            return max(0, -(-upto // self.T) - len(r.tables[self.s]))
        return sum(written)

    def early_pages(self, r: RequestKV) -> list[int]:
        if not self._unpaged_keys:
            return []
        lo, hi = -(-r.num_computed // self.T), self.window_start(r.num_alloc) // self.T
        return [p for p in r.tables[self.s][lo:hi] if p != NO_PAGE]

    def peak_pages(self, num_tokens: int, chunk: int, images: Sequence[ImageInput]) -> int:
        full = -(-num_tokens // self.T)
        if self.spec.kind is LayerKind.FULL:
            return full
        reach = self.spec.window if self.spec.kind is LayerKind.SLIDING else self.spec.chunk
        if self.window_only:  # the window held from before the step, and the one at its end
            chunk = min(chunk, reach + self.T)
        return min(full, -(-(reach + chunk) // self.T) + 1)

    def install(self, r: RequestKV, pids: list[int], upto: int) -> None:
        written = self._written(r, upto)
        if written is None:
            r.tables[self.s].extend(pids)
            return
        it = iter(pids)
        r.tables[self.s].extend(next(it) if w else NO_PAGE for w in written)

    def advance(self, r: RequestKV, done: int, now: int) -> None:
        table, T, s = r.tables[self.s], self.T, self.s
        insert = self.alloc.insert
        for b in range(r.num_computed // T, min(done // T, len(r.hashes))):
            pid = table[b]
            if pid != NO_PAGE:
                insert(s, pid, r.hashes[b], (b + 1) * T)
        self.release_inactive(r, done, now)

    def release_inactive(self, r: RequestKV, c: int, now: int) -> None:
        if self.spec.kind is LayerKind.FULL:
            return
        table = r.tables[self.s]
        upto = min(self.window_start(c) // self.T, len(table))
        start = r.released[self.s]
        if upto <= start:
            return
        gone = table[start:upto]
        table[start:upto] = [NO_PAGE] * (upto - start)
        r.released[self.s] = upto
        if self.reuse is None:
            self.alloc.free(self.s, [p for p in reversed(gone) if p != NO_PAGE], now)
            return
        useful = self._serves_reuse_point(r, start, upto)
        keep = [p for p, u in zip(reversed(gone), reversed(useful)) if u and p != NO_PAGE]
        dead = [p for p, u in zip(reversed(gone), reversed(useful)) if not u and p != NO_PAGE]
        self.alloc.free(self.s, dead, DEAD)
        hashes = self.alloc.specs[self.s].hash
        # Uncached pages (a block another page already caches) serve no hit: let go.
        self.alloc.free(self.s, [p for p in keep if hashes[p] is None], now)
        held = [p for p in keep if hashes[p] is not None]
        if held:
            r.held.setdefault(self.s, []).extend(held)

    def _reach(self) -> int:
        """Blocks before a prefix end that a hit there needs, at most."""
        span = self.spec.window if self.spec.kind is LayerKind.SLIDING else self.spec.chunk
        return -(-span // self.T) + 1

    def _serves_reuse_point(self, r: RequestKV, start: int, upto: int) -> list[bool]:
        """For blocks [start, upto): whether a hit at one of r's reuse points needs it.

        Block b serves a hit at e iff first_block(e) <= b < e; first_block grows
        with e, so the nearest reuse point after b decides.
        """
        reach = self._reach()
        points = self.reuse.points(r, start + 1, upto + reach)
        out = [False] * (upto - start)
        i = 0
        for b in range(start, upto):
            while i < len(points) and points[i] <= b:
                i += 1
            out[b - start] = i < len(points) and self._first_block(points[i]) <= b
        return out

    def retire(self, r: RequestKV, q: int, prompt_end: int) -> None:
        """r hits at q, the sequence end of a finished request whose prompt ended at block
        prompt_end: it continues that sequence. The pages that request kept for hits in
        its prompt's end region, before the window r claims, serve no one now unless a
        mark needs them: cache them DEAD (evicted first). A branch at q passes q as
        prompt_end: the prompts it branched from ended within an end region after q."""
        if self.spec.kind is LayerKind.FULL:
            return
        hi, reach = self._first_block(q), self._reach()
        lo = max(0, prompt_end - self.reuse.PROMPT_TAIL // self.T - reach)
        if lo >= hi:
            return
        marks, hashes = self.reuse.marks, r.hashes
        cached = self.alloc.specs[self.s].cached
        # Marked points e serve blocks [first_block(e), e): keep those.
        keep = [e for e in range(lo + 1, min(hi + reach, q) + 1) if hashes[e - 1] in marks]
        out = []
        for b in range(lo, hi):
            h = hashes[b]
            if h in cached and not any(self._first_block(e) <= b < e for e in keep):
                out.append(cached[h])
        if out:
            self.alloc.demote(self.s, out)

    def live_slots(self, r: RequestKV) -> list[tuple[object, int]]:
        T, n = self.T, r.num_alloc
        lo = self.window_start(r.num_computed)
        # Keys of the step in flight that no later step reads need no slot (_written).
        gap_lo, gap_hi = r.num_computed, 0
        if self.spec.kind is LayerKind.FULL:
            lo = max(lo, r.lent)  # lent blocks live on other instances
        elif self.window_only:
            gap_hi = self.window_start(n)
        out: list[tuple[object, int]] = []
        for b in range(lo // T, -(-n // T)):
            a, e = max(lo, b * T), min(n, b * T + T)
            slots = e - a - max(0, min(e, gap_hi) - max(a, gap_lo))
            if slots <= 0:
                continue
            key = r.hashes[b] if slots == T and b < len(r.hashes) else (r.req_id, b)
            out.append((key, slots))
        return out


class MambaState(SpecManager):
    """One live recurrent state per request; checkpoints every N tokens are cached.

    Table: [live state page, tail page once decoding]. `pending` holds (token position,
    page) pairs: checkpoints the runner must snapshot the live state into once the
    request has computed exactly that many tokens, and (0-position) a cached
    checkpoint to restore the live state from after a prefix hit.

    The tail page takes the state at every block boundary past the prompt, so when the
    request ends it holds the state at its sequence's last full block: where a next
    turn of its conversation hits (Marconi caches states at sequence ends). A grid
    checkpoint alone leaves that turn the grid's multiple below, up to a whole
    interval (512 tokens) short of what its attention pages serve.
    """

    def _every(self) -> int:
        return self.spec.checkpoint_every // self.T

    def possible_prefix(self, is_hit: Sequence[bool]) -> set[int]:
        # Any cached state serves a hit where it was taken: the grid's and tails'.
        return {q for q in range(1, len(is_hit) + 1) if is_hit[q - 1]}

    def longest_hit(self, r: RequestKV, p: int, cached: Container | None = None) -> int:
        """p itself (a sequence end's tail state, where the other specs' hit ends when a
        turn continues a conversation), else the grid below it."""
        m = self._every()
        if cached is None:
            cached = self.alloc.specs[self.s].cached
        if p and r.hashes[p - 1] in cached:
            return p
        q = p - p % m
        while q > 0 and r.hashes[q - 1] not in cached:
            q -= m
        return q

    def hit_keys(self, r: RequestKV, q: int) -> list[Hashable]:
        return [r.hashes[q - 1]] if q else []

    def claim_hit(self, r: RequestKV, q: int) -> None:
        if q == 0:
            return
        pid = self.alloc.specs[self.s].cached[r.hashes[q - 1]]
        self.alloc.claim(self.s, [pid])
        r.pending[self.s].append((0, pid))

    # Checkpoints a prompt takes at most: its end region's (one or two grid points) and
    # the latest marked branch points'.
    PROMPT_POINTS = 4

    def _checkpoints(self, r: RequestKV, lo: int, hi: int) -> list[int]:
        """Checkpoint positions in (lo, hi]. In the prompt, only where a hit can use
        them (`_prompt_points`): a state on the grid between them would be cached DEAD
        at once, and a prompt prefilled in one step took one per grid point, a whole
        large page each (Jamba 1.5 Mini: 40 of 8.7 MB for a 20K-token article, as much
        as its attention pages), out of the cache of other prefixes."""
        n = self.spec.checkpoint_every
        grid = range((lo // n + 1) * n, hi + 1, n)
        if self.spec.checkpoint_last_only:
            return list(grid[-1:])
        if self.reuse is None or not grid or grid[0] > r.prompt_len:
            return list(grid)
        keep = self._prompt_points(r)
        return [p for p in grid if p > r.prompt_len or p in keep]

    def _prompt_points(self, r: RequestKV) -> set[int]:
        """Grid positions in r's prompt whose state serves one of its reuse points (a hit
        at q restores the state at q - q % every), the last PROMPT_POINTS of them."""
        m = self._every()
        e = sorted({q - q % m for q in self.reuse.points(r, 1, r.prompt_len // self.T)})
        return {q * self.T for q in e[-self.PROMPT_POINTS:] if q}

    def _keeps_tails(self) -> bool:
        """Only once some request has continued a finished one (ReusePoints.continued: a
        tail serves a next turn only, and costs a page while its request decodes), and
        not in vLLM's align mode, whose last checkpoint is its own tail."""
        return (self.reuse is not None and bool(self.reuse.continued)
                and not self.spec.checkpoint_last_only)

    def _tail(self, r: RequestKV, lo: int, hi: int) -> range:
        """Block boundaries in (lo, hi] past r's prompt, where its tail page takes the
        state (none while `_keeps_tails` is false)."""
        if not self._keeps_tails():
            return range(0)
        return range((max(lo, r.prompt_len) // self.T + 1) * self.T, hi + 1, self.T)

    def peak_pages(self, num_tokens: int, chunk: int, images: Sequence[ImageInput]) -> int:
        if self.spec.checkpoint_last_only:
            return 2
        if self.reuse is None:  # every grid point of a step's chunk
            return 1 + self._keeps_tails() + -(-chunk // self.spec.checkpoint_every)
        # The live state, the tail, the prompt's held checkpoints, one past the prompt.
        points = min(self.PROMPT_POINTS, num_tokens // self.spec.checkpoint_every)
        return 2 + self._keeps_tails() + points

    def num_new_pages(self, r: RequestKV, upto: int) -> int:
        table = r.tables[self.s]
        live = 0 if table else 1
        tail = 1 if len(table) < 2 and self._tail(r, r.num_alloc, upto) else 0
        return live + tail + len(self._checkpoints(r, r.num_alloc, upto))

    def install(self, r: RequestKV, pids: list[int], upto: int) -> None:
        table = r.tables[self.s]
        if not table:
            table.append(pids.pop(0))
        tail = self._tail(r, r.num_alloc, upto)
        if tail and len(table) < 2:
            table.append(pids.pop(0))
        r.pending[self.s].extend(zip(self._checkpoints(r, r.num_alloc, upto), pids))
        r.pending[self.s].extend((pos, table[1]) for pos in tail)

    def advance(self, r: RequestKV, done: int, now: int) -> None:
        keep, s = [], self.s
        tail = r.tables[s][1] if len(r.tables[s]) > 1 else None
        for pos, pid in r.pending[s]:
            if pos > done:
                keep.append((pos, pid))
                continue
            if pid == tail:  # overwritten at the next boundary; cached at the end
                r.tail[s] = pos
                continue
            h = None
            if pos > 0 and pos // self.T <= len(r.hashes):
                h = r.hashes[pos // self.T - 1]
                if not self.alloc.insert(s, pid, h, pos):
                    h = None
            if pos == 0 and r.next_turn and self.reuse is not None:
                # The state this turn restored from: its conversation goes on past it, so
                # it serves only an edit of this turn's message, and goes before every
                # state a next turn could hit, 8.9 MB each on Jamba (its chat, 400 sessions
                # at 2/s: 76.4% -> 79.8%; docs/benchmarks.md). vLLM's align mode (the
                # baseline) keeps the key the state had.
                if self.spec.checkpoint_last_only:
                    self.alloc.unclaim(s, [pid])
                else:
                    self.alloc.free(s, [pid], DEAD)
            elif h is None or self.reuse is None:
                self.alloc.free(s, [pid], now)
            elif self._serves_reuse_point(r, pos // self.T):
                self._hold(r, pid, pos, now)
            else:  # cached, but evicted first
                self.alloc.free(s, [pid], DEAD)
        r.pending[s] = keep

    def _hold(self, r: RequestKV, pid: int, pos: int, now: int) -> None:
        """Hold the state at pos for a reuse point. Past the prompt only the latest one
        (peak_pages counts one there, and the wait and feasibility rules plan by it): a
        decode passing several marked points lets the one before go, cached by recency."""
        held = r.held.setdefault(self.s, [])
        if pos > r.prompt_len:
            plen = self.alloc.specs[self.s].plen
            past = [p for p in held if plen[p] > r.prompt_len]
            if past:
                held[:] = [p for p in held if plen[p] <= r.prompt_len]
                self.alloc.free(self.s, past, now)
        held.append(pid)

    def release_inactive(self, r: RequestKV, c: int, now: int) -> None:
        """Prefix caching off: no lookup will restore a checkpoint, so each one goes as
        soon as its position is computed (they would pile up until the request ends)."""
        pending = r.pending[self.s]
        self.alloc.free(self.s, [pid for pos, pid in pending if pos <= c], now)
        r.pending[self.s] = [(pos, pid) for pos, pid in pending if pos > c]

    def free_all(self, r: RequestKV, now: int) -> None:
        # The sequence end is a reuse point: the checkpoint a hit there would use stays.
        # Past the prompt it serves only a next turn, so, as TextStream's answer pages,
        # only once some request has continued a finished one.
        q = r.num_computed // self.T
        q -= q % self._every()
        if q and self.reuse is not None and q <= len(r.hashes) and (
                q <= r.prompt_len // self.T or self.reuse.continued):
            pid = self.alloc.specs[self.s].cached.get(r.hashes[q - 1])
            if pid is not None:
                r.kept.setdefault(self.s, []).append((pid, r.hashes[q - 1]))
        self._cache_tail(r, now)
        super().free_all(r, now)

    def _cache_tail(self, r: RequestKV, now: int) -> None:
        """The tail page joins the cache as the state at its block boundary (unless a
        state is cached there already), kept by recency once some request has continued
        a finished one and evicted first before that, as the grid checkpoint past the
        prompt above."""
        table, pos = r.tables[self.s], r.tail.pop(self.s, 0)
        if len(table) < 2:
            return
        pid, e = table.pop(), pos // self.T
        r.pending[self.s] = [(q, p) for q, p in r.pending[self.s] if p != pid]
        cached = 0 < e <= len(r.hashes) and self.alloc.insert(self.s, pid, r.hashes[e - 1],
                                                              pos)
        self.alloc.free(self.s, [pid], now if cached and self.reuse.continued else DEAD)

    def retire(self, r: RequestKV, q: int, prompt_end: int) -> None:
        """r continues, at q, the sequence of a finished request whose prompt ended at
        block prompt_end (a conversation's next turn). The states that request kept for
        hits in its prompt's end region (`_prompt_points`: a conversation's first turn)
        then serve only a regenerated answer, as the windows of TextStream.retire: cache
        them DEAD unless a mark needs them. Not for branches: a second question on a
        document restores from those very states."""
        if not r.next_turn or self.spec.checkpoint_last_only:
            return
        m, hashes = self._every(), r.hashes
        lo = max(1, prompt_end - self.reuse.PROMPT_TAIL // self.T)
        ends = range(lo, min(prompt_end, len(hashes)) + 1)  # ReusePoints.points' region
        keep = {e - e % m for e in ends if hashes[e - 1] in self.reuse.marks}
        cached = self.alloc.specs[self.s].cached
        out = [cached[hashes[g - 1]] for g in {e - e % m for e in ends} - keep
               if 0 < g < q and hashes[g - 1] in cached]
        if out:
            self.alloc.demote(self.s, out)

    def _serves_reuse_point(self, r: RequestKV, e: int) -> bool:
        """A hit at q uses the checkpoint at q - q % every: the one at e serves [e, e + every)."""
        m = self._every()
        return bool(self.reuse.points(r, e, e + m - 1))

    def live_slots(self, r: RequestKV) -> list[tuple[object, int]]:
        # The model needs the live state only; the tail, as a checkpoint, is for caching.
        return [((r.req_id, "state"), 1)] if r.num_alloc > r.num_hit else []


class ImageCache(SpecManager):
    """Cross-attention KV or vision embeddings of a request's images.

    Pages are keyed by (image hash, index), so an image cached by one request
    serves any later request that shows it. Cross-attention needs every image
    for the whole request; vision embeddings are needed only until prefill has
    passed the image, then released to the cache (Jenga §6.2).
    Table: the pages of image 0, then image 1, ... (NO_PAGE where absent).
    """

    def __init__(
        self, s: int, spec: KVSpec, alloc: TwoLevelAllocator | None, block: int
    ) -> None:
        super().__init__(s, spec, alloc, block)
        self.rng = random.Random(s)

    def _npages(self, im: ImageInput) -> int:
        return -(-im.num_tokens // self.T)

    def _span(self, r: RequestKV, i: int) -> slice:
        start = sum(self._npages(im) for im in r.images[:i])
        return slice(start, start + self._npages(r.images[i]))

    def _needed(self, r: RequestKV, lo: int, hi: int) -> list[int]:
        """Images whose pages must be present for queries at positions [lo, hi)."""
        if self.spec.kind is LayerKind.CROSS:
            return list(range(len(r.images)))
        return [
            i for i, im in enumerate(r.images)
            if im.offset < hi and im.offset + im.num_tokens > lo
        ]

    def possible_prefix(self, is_hit: Sequence[bool]) -> set[int]:
        # Image KV depends on the image alone; a missing image is re-encoded
        # without invalidating any text prefix.
        return set(range(1, len(is_hit) + 1))

    def longest_hit(self, r: RequestKV, p: int, cached: Container | None = None) -> int:
        return p

    swappable = False

    def hit_keys(self, r: RequestKV, q: int) -> list[Hashable]:
        return []

    def _ensure_table(self, r: RequestKV) -> list[int]:
        table = r.tables[self.s]
        if not table and r.images:
            table.extend([NO_PAGE] * sum(self._npages(im) for im in r.images))
        return table

    def claim_hit(self, r: RequestKV, q: int) -> None:
        table = self._ensure_table(r)
        cached = self.alloc.specs[self.s].cached
        for i in self._needed(r, q * self.T, max(len(r.tokens), q * self.T + 1)):
            im = r.images[i]
            keys = [image_page_key(im, j) for j in range(self._npages(im))]
            if all(k in cached for k in keys):
                pids = [cached[k] for k in keys]
                self.alloc.claim(self.s, pids)
                table[self._span(r, i)] = pids

    def _missing(self, r: RequestKV, upto: int) -> list[int]:
        table = self._ensure_table(r)
        return [
            i for i in self._needed(r, r.num_alloc, upto)
            if table[self._span(r, i)][0] == NO_PAGE
        ]

    def peak_pages(self, num_tokens: int, chunk: int, images: Sequence[ImageInput]) -> int:
        return sum(self._npages(im) for im in images)

    def num_new_pages(self, r: RequestKV, upto: int) -> int:
        return sum(self._npages(r.images[i]) for i in self._missing(r, upto))

    def install(self, r: RequestKV, pids: list[int], upto: int) -> None:
        table = r.tables[self.s]
        for i in self._missing(r, upto):
            span = self._span(r, i)
            n = span.stop - span.start
            table[span], pids = pids[:n], pids[n:]
            r.pending[self.s].append((i, 0))

    def advance(self, r: RequestKV, done: int, now: int) -> None:
        # Pages allocated for an image hold its KV once the step that encoded
        # it has run: publish them, one random prefix length per image.
        table = r.tables[self.s]
        for i, _ in r.pending[self.s]:
            im, plen = r.images[i], self.rng.randrange(1 << 30)
            for j, pid in enumerate(table[self._span(r, i)]):
                self.alloc.insert(self.s, pid, image_page_key(im, j), plen)
        r.pending[self.s].clear()
        self.release_inactive(r, done, now)

    def release_inactive(self, r: RequestKV, c: int, now: int) -> None:
        if self.spec.kind is LayerKind.CROSS:
            return
        table = r.tables[self.s]
        for i, im in enumerate(r.images):
            span = self._span(r, i)
            if im.offset + im.num_tokens <= c and table[span] and table[span][0] != NO_PAGE:
                self.alloc.free(self.s, table[span], now)
                table[span] = [NO_PAGE] * (span.stop - span.start)

    def free_all(self, r: RequestKV, now: int) -> None:
        r.pending[self.s].clear()  # (image, 0) markers, not pages
        super().free_all(r, now)

    def live_slots(self, r: RequestKV) -> list[tuple[object, int]]:
        if r.num_alloc <= r.num_hit:
            return []
        out: list[tuple[object, int]] = []
        for i in self._needed(r, r.num_computed, r.num_alloc):
            im = r.images[i]
            for j in range(self._npages(im)):
                out.append((image_page_key(im, j), min(self.T, im.num_tokens - j * self.T)))
        return out


def make_spec_manager(
    s: int, spec: KVSpec, alloc: TwoLevelAllocator | None, block: int
) -> SpecManager:
    """The manager of spec `s`; alloc=None gives one that only does accounting."""
    if spec.kind in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED):
        return TextStream(s, spec, alloc, block)
    if spec.kind is LayerKind.MAMBA:
        return MambaState(s, spec, alloc, block)
    return ImageCache(s, spec, alloc, block)
