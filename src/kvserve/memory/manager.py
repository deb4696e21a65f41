"""KVCacheManager: the one facade the scheduler and the simulator call.

Life of a request:
    add_request(id, tokens, images)   tokens is the engine's own list; it appends
    lookup(id) -> cached tokens       claims the hit pages of every spec at once
    allocate_slots(id, n)             slots for the next n tokens, all or nothing
    block_tables(id)                  per-spec page ids for the model runner
    advance(id, n)                    their KV is written: cache full blocks,
                                      release pages that left a window
    finish(id) / abort(id)            pages become evictable cache or empty
    flush(copy)                       with a host tier: make the copies the
                                      step's evictions and host hits need
The clock that orders LRU eviction is the engine step: call begin_step()
once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Sequence
from dataclasses import dataclass
from itertools import islice

from kvserve.memory.allocator import DEAD, OutOfPages, RequestId, TwoLevelAllocator
from kvserve.memory.baselines import POLICIES, policy_layout
from kvserve.memory.cut_prefixes import CutPrefixes
from kvserve.memory.host_tier import Copier, HostStats, HostTier
from kvserve.memory.layer_types import (
    NO_PAGE,
    RequestKV,
    ReusePoints,
    SpecManager,
    TextStream,
    make_spec_manager,
)
from kvserve.memory.prefix_cache import ImageInput, extend_block_hashes
from kvserve.memory.spec import KVSpec, LayerKind, Layout

# worth_loading(prompt tokens, device hit tokens, hit tokens with the host tier, bytes to
# load) -> whether to load them (MemServe Eq. 2) rather than recompute
LoadRule = Callable[[int, int, int, int], bool]


class Either(Container):
    """Block keys cached in either of two tiers."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container, b: Container) -> None:
        self.a, self.b = a, b

    def __contains__(self, h: Hashable) -> bool:
        return h in self.a or h in self.b


@dataclass
class SpecStats:
    name: str
    page_bytes: int
    used: int  # bytes of pages in use by requests
    evictable: int  # bytes reclaimable by eviction: cached pages nobody uses (and the
    # empty pages beside them in large pages that hold only cache)
    empty: int  # bytes of empty small pages inside large pages that requests use
    ideal: int  # bytes the requests' live tokens need, at byte granularity
    waste: int  # used + empty - ideal: unused pages in held large pages + unused slots


@dataclass
class Stats:
    policy: str
    pool_bytes: int
    free: int  # bytes of free large pages
    specs: list[SpecStats]
    queried_tokens: int
    hit_tokens: int
    host: HostStats | None = None  # the host tier, if there is one

    @property
    def used(self) -> int:
        return sum(s.used for s in self.specs)

    @property
    def ideal(self) -> int:
        return sum(s.ideal for s in self.specs)

    @property
    def waste(self) -> int:
        return sum(s.waste for s in self.specs)

    @property
    def evictable(self) -> int:
        return sum(s.evictable for s in self.specs)

    @property
    def waste_fraction(self) -> float:
        held = sum(s.used + s.empty for s in self.specs)
        return self.waste / held if held else 0.0


class KVCacheManager:
    """Heterogeneous paged KV cache with per-layer-type prefix caching."""

    def __init__(
        self,
        specs: Sequence[KVSpec],
        pool_bytes: int,
        tokens_per_page: int = 16,
        policy: str = "jenga",
        enable_caching: bool = True,
        host_bytes: int = 0,
        worth_loading: LoadRule | None = None,
        window_only: bool = False,
    ) -> None:
        """`host_bytes`: a host tier of that size keeps what the device pool evicts;
        `worth_loading` decides, per lookup, whether loading from it beats recomputing
        (default: always); `window_only`: the attention reads a step's own keys from
        its activations, so windowed specs get pages only for keys later steps read
        (TextStream._written)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
        self.model_specs = tuple(specs)
        self.policy = policy
        self.layout: Layout
        self.layout, partitioned, members = policy_layout(policy, self.model_specs, tokens_per_page)
        num_large = pool_bytes // self.layout.large_page_bytes
        if num_large < 1:
            raise ValueError(
                f"pool of {pool_bytes} B holds no large page of {self.layout.large_page_bytes} B"
            )
        self.pool_bytes = num_large * self.layout.large_page_bytes
        self.T = self.layout.tokens_per_page  # a policy may enlarge the block (vllm_align)
        self.enable_caching = enable_caching
        self.alloc = TwoLevelAllocator(self.layout, num_large, partitioned)
        self.host: HostTier | None = None
        self.write_behind = False  # copy finished requests' pages ahead: see HostTier
        if host_bytes and enable_caching:
            num_host = host_bytes // self.layout.large_page_bytes
            if num_host < (len(self.layout.specs) if partitioned else 1):
                raise ValueError(f"host tier of {host_bytes} B holds no large page of "
                                 f"{self.layout.large_page_bytes} B per partition")
            self.host = HostTier(self.layout, num_host, partitioned)
            self.write_behind = num_host * self.layout.large_page_bytes >= 2 * self.pool_bytes
        self.worth_loading = worth_loading
        self.managers: list[SpecManager] = [
            make_spec_manager(s, spec, self.alloc, self.T)
            for s, spec in enumerate(self.layout.specs)
        ]
        self.reuse = ReusePoints(self.T)
        if enable_caching:
            for m in self.managers:
                m.reuse = self.reuse
        # Full-attention specs hold every block of a prefix: how far they match shows
        # where a lookup diverges from a cached request.
        self._full_specs = [m for m in self.managers
                            if isinstance(m, TextStream) and m.spec.kind is LayerKind.FULL]
        self._full = self._full_specs
        if len(self._full) == len(self.managers):
            self._full = []  # every spec serves what the full ones hold: no divergence
        # Lookups ask the full-attention specs first: they bring p down to where a
        # cached sequence ends, which is where a Mamba tail state can serve (it is
        # found at p itself, not on the grid below).
        self._lookup_order = sorted(self.managers, key=lambda m: m not in self._full_specs)
        # Only where another layer type can cut a prefix the full-attention pages hold.
        self.cuts: CutPrefixes | None = None
        if enable_caching and self._full:
            most = max(self.layout.pages_per_large) * num_large
            self.cuts = CutPrefixes(2 * most)
            self.alloc.evicted_keys = self.cuts.touched
        if self.host is not None:
            self.alloc.on_evict = self._write_back
        # The model's own rules, used only to account what the tokens need.
        self._ideal_rules = [make_spec_manager(-1, spec, None, self.T) for spec in specs]
        self._members = {
            name: [i for i, s in enumerate(specs) if s.name in names]
            for name, names in members.items()
        }
        self.reqs: dict[RequestId, RequestKV] = {}
        self.set_window_only(window_only)
        self._waits: dict[RequestId, int] = {}  # deferred loop misses: num_admitted then
        self.now = 0
        self._arrivals = 0
        self.num_admitted = 0  # first allocations: how long a deferred loop miss waited
        self.queried_tokens = 0
        self.hit_tokens = 0
        # Running requests still computing their prompt: waits_for_running.
        self.computing: dict[RequestId, RequestKV] = {}

    def set_window_only(self, on: bool) -> None:
        """Whether windowed specs get pages only for the keys later steps read (the
        attention takes a step's own keys from its activations); before any request."""
        if self.reqs:
            raise RuntimeError("set_window_only: requests hold pages already")
        for m in (*self.managers, *self._ideal_rules):
            if isinstance(m, TextStream):
                m.window_only = on

    @property
    def num_large_pages(self) -> int:
        return self.alloc.num_large

    def begin_step(self) -> int:
        self._demote_cut()
        self.now += 1
        return self.now

    def idle_pages(self, before: int | None) -> list[int]:
        """Evict the cached pages whose eviction key is below step `before` (idle that
        long; None: none); returns every large page no one holds now, whose memory can
        go back."""
        if before is not None:
            self.alloc.evict_before(before)
        return self.alloc.free_large_pages()

    def drop_cache(self) -> int:
        """Evict every cached page no request holds; returns how many went. For a request
        alone in the pool that finds no room beside them (Scheduler._admit_waiting)."""
        return self.alloc.evict_before(self.now + 1)

    def go_lean(self, req_id: RequestId) -> bool:
        """The request lets go of what it holds for its own reuse points and keeps
        nothing for them from now on (`RequestKV.lean`); False if it has nothing to
        give up (already lean, or no reuse rules).

        For a request alone in the pool that is out of pages (Scheduler._allocate).
        Those windows and checkpoints only serve later requests, and can pass the peak
        that fits_alone admits by and the wait rules plan with: a window kept at a
        marked branch point, or a prompt end region longer than the window (256 tokens
        against 8 on the tiny test model). A request that needed them to fit the pool
        alone was failed, or preempted and recomputed without end
        (tests/sim/test_liveness.py, tests/engine/test_engine_properties.py).
        """
        r = self._req(req_id)
        if r.lean or self.reuse is None:
            return False
        for m in self.managers:
            m.drop_held(r, self._key(r))
        r.lean = True
        return True

    # --------------------------------------------------------------- requests

    def add_request(
        self,
        req_id: RequestId,
        tokens: Sequence[int],
        images: Sequence[ImageInput] = (),
        arrival: int | None = None,
        hashes: list[int] | None = None,
    ) -> None:
        """`arrival`: the request's place in arrival order (the scheduler's; by default
        the order of add_request calls), the clock of prefix reuse distances.
        `hashes`: the caller's block hashes of tokens, extended here in place and kept
        between calls. A queued request is added and taken back each step it waits,
        and hashing a long prompt again each time was most of a step: 73% of the
        simulator's time with 20K-token articles queued (docs/benchmarks.md)."""
        if req_id in self.reqs:
            raise ValueError(f"request {req_id!r} is already known")
        if not tokens:
            raise ValueError(f"request {req_id!r} has no tokens")
        n = len(self.managers)
        self.reqs[req_id] = RequestKV(
            req_id, tokens, tuple(images),
            tables=[[] for _ in range(n)], released=[0] * n, pending=[[] for _ in range(n)],
            prompt_len=len(tokens), arrival=self._arrivals if arrival is None else arrival,
            hashes=[] if hashes is None else hashes,
        )
        self._arrivals += 1

    def _req(self, req_id: RequestId) -> RequestKV:
        try:
            return self.reqs[req_id]
        except KeyError:
            raise KeyError(f"unknown request {req_id!r}") from None

    def lookup(self, req_id: RequestId) -> int:
        """Take the longest cached prefix valid for every spec; returns its tokens.

        Must come before the request's first allocation. The hit pages of
        every spec are claimed here, so no later allocation can evict them.
        """
        r = self._req(req_id)
        if r.num_alloc or any(r.tables):
            raise RuntimeError(f"lookup of {req_id!r} after its first allocation")
        q = 0
        if self.enable_caching:
            extend_block_hashes(r.hashes, r.tokens, self.T, r.images)
            p = (len(r.tokens) - 1) // self.T
            q = self._longest_common_hit(r, p)
            if self.host is not None and q < p:
                q = self._load_from_host(r, p, q)
            self._mark_reuse(r, p, q)
            r.key = self.reuse.reuse_key(r, p, q, self.now)
        for m in self.managers:
            m.claim_hit(r, q)
        r.num_hit = r.num_computed = r.num_alloc = q * self.T
        return r.num_hit

    def _mark_reuse(self, r: RequestKV, p: int, q: int) -> None:
        """The hit point, and a longer prefix only the full-attention pages hold, are
        reuse points: this request keeps what a hit there needs as it prefills past.
        Not for a conversation's next turn: both are points of its own history, and the
        conversation goes on from where this turn ends (chat, Gemma 3 12B, 6.5 GB,
        100 sessions at 1/s: 40.4% -> 41.9%).

        A hit that branches off (a second question on a document: the cache's sequence
        and r part at q in every spec, r goes on) or continues a finished sequence (a
        next turn) retires the windows older prompts' end regions kept before the
        window it claims: the next such request hits where this one did. A prompt that
        repeats a cached one, or whose full-attention hit goes past q, parts nowhere
        yet: the windows stay for whoever branches earlier. For branches, Gemma 3 12B,
        1/s: 32 articles shuffled 51.0% -> 52.1%, 64 shuffled 23.7% -> 24.2%, 64
        round-robin with 8192-token steps 31.8% -> 32.8%."""
        continues = False
        r.next_turn = self.reuse.next_turn(r, p)
        d = min((m.longest_hit(r, p) for m in self._full), default=0)
        if q:
            pe = self.reuse.ends.get(r.hashes[q - 1])
            if pe is None:
                self.reuse.branched += 1
                if not r.next_turn:
                    self.reuse.mark(r.hashes[q - 1])
                if not r.next_turn and d == q < p:  # every spec's cache and r part at q
                    for m in self.managers:  # the next sibling hits here too
                        m.retire(r, q, q)
            else:  # r continues a finished request's sequence
                for m in self.managers:
                    m.retire(r, q, pe)
            # not a preempted request coming back whole
            continues = q < p and self.reuse.continues(r, q)
        if d > q:
            if not r.next_turn:
                self.reuse.mark(r.hashes[d - 1])
            # A next turn whose previous sequence only the attention pages serve whole
            # (the Mamba states it needs stand on the grid below) continues it all the same.
            continues = continues or d < p and self.reuse.continues(r, d)
        self.reuse.continued += continues

    def cached_prefix(self, tokens: Sequence[int], hashes: list[int],
                      images: Sequence[ImageInput] = ()) -> int:
        """Tokens of the longest prefix of tokens (less its last) every spec could
        serve now from either tier, nothing taken; `hashes` keeps the block hashes
        between calls (the scheduler asks each step while a request waits)."""
        if not self.enable_caching:
            return 0
        extend_block_hashes(hashes, tokens, self.T, images)
        r = RequestKV(None, tokens, tuple(images), hashes=hashes)
        p = (len(tokens) - 1) // self.T
        return self._longest_common_hit(r, p, tiers=self.host is not None) * self.T

    def _longest_common_hit(self, r: RequestKV, p: int, tiers: bool = False) -> int:
        """Intersect every spec's possible prefixes: shrink p to a fixed point.
        With `tiers`, a block counts as cached on the device or in the host tier."""
        views = [Either(m.alloc.specs[m.s].cached, self.host.cached(m.s)) if tiers
                 and m.swappable else None for m in self._lookup_order]
        while True:
            q = p
            for m, view in zip(self._lookup_order, views):
                q = m.longest_hit(r, q, view)
            if q == p:
                return q
            p = q

    def _demote_cut(self) -> None:
        """Demote what eviction left of cut prefixes (CutPrefixes): the pages of each
        sequence past the longest prefix every spec still serves that still carry the
        key the sequence's request gave them."""
        cuts = self.cuts
        if cuts is None or not cuts.touched:
            return
        tiers = self.host is not None
        for key, seqs in cuts.take():
            for hashes in list(seqs):
                r = RequestKV(None, (), (), hashes=hashes)
                v = self._longest_common_hit(r, len(hashes), tiers)
                for s, sp in enumerate(self.alloc.specs):
                    last = sp.last
                    pids = [p for p in map(sp.cached.get, hashes[v:])
                            if p is not None and last[p] == key]
                    if pids:
                        self.alloc.demote(s, pids)
                if not v:
                    cuts.drop(key, hashes)

    # ------------------------------------------------------------- host tier

    def _write_back(self, s: int, pids: list[int]) -> None:
        """The allocator evicts cached pages of spec s: the host tier keeps them."""
        if not self.managers[s].swappable:
            return
        sp, store = self.alloc.specs[s], self.host.store
        for pid in pids:
            store(s, pid, sp.hash[pid], sp.plen[pid], sp.last[pid])

    def _write_ahead(self, r: RequestKV) -> None:
        """Queue the finished request's cached pages for write-behind (HostTier)."""
        n = min(len(r.hashes), r.num_computed // self.T)
        for m in self.managers:
            if not m.swappable:
                continue
            sp, ahead = self.alloc.specs[m.s], self.host.write_ahead
            for h in m.hit_keys(r, n) if n else ():
                pid = sp.cached.get(h)
                if pid is not None and not sp.ref[pid] and sp.last[pid] > DEAD:
                    ahead(m.s, pid, h, sp.plen[pid])

    def take_ahead(self) -> list[tuple[bool, int, int, int]]:
        """Write-behind copies queued since the last call, in the flush log's form; make
        them (`host_tier.play`) before the next flush, then call ahead_done."""
        return self.host.take_ahead() if self.host is not None else []

    def ahead_done(self, batch: list[tuple[bool, int, int, int]]) -> None:
        if batch:
            self.host.ahead_done(batch)

    def _load_from_host(self, r: RequestKV, p: int, q: int) -> int:
        """Extend a device hit of q blocks with pages from the host tier; the new hit.

        The pages the longer hit needs that only the host holds get device
        pages now (logged copies, made by the next flush) and are cached there,
        so claim_hit takes them like any other. Their sources and the device
        pages of the hit are pinned first: the allocation may evict, and an
        eviction may push the host tier's oldest pages out. If the device
        cannot hold them, or `worth_loading` says recompute, q stands.
        """
        u = self._longest_common_hit(r, p, tiers=True)
        if u <= q:
            return q
        host, now = self.host, self.now
        plan, pinned = [], []
        for m in self.managers:
            cached = self.alloc.specs[m.s].cached
            keys = m.hit_keys(r, u)
            here = [cached[h] for h in keys if h in cached]
            self.alloc.claim(m.s, here)
            pinned.append((m.s, here))
            missing = [h for h in keys if h not in cached]
            plan.append((m.s, missing, [host.pin(m.s, h) for h in missing]))
        nbytes = sum(len(hs) * self.layout.page_bytes[s] for s, hs, _ in plan)
        pages = None
        if self.worth_loading is None or self.worth_loading(len(r.tokens), q * self.T,
                                                            u * self.T, nbytes):
            try:
                pages = self.alloc.allocate(r.req_id, [(s, len(hs)) for s, hs, _ in plan])
            except OutOfPages:
                pass
        for (s, hs, hps), pids in zip(plan, pages or [[]] * len(plan)):
            plen = host.alloc.specs[s].plen
            for h, hp, pid in zip(hs, hps, pids):
                self.alloc.insert(s, pid, h, plen[hp])
                host.load(s, hp, pid)
            if pages is None:
                for hp in hps:
                    host.unpin(s, hp)
            self.alloc.free(s, pids, now)  # cached now: claim_hit takes them
        for s, here in pinned:
            self.alloc.unclaim(s, here)
        if pages is None:
            return q
        r.num_host_hit = (u - q) * self.T
        return u

    def flush(self, copy: Copier) -> int:
        """Make the copies between the tiers logged since the last flush (the engine
        calls it before each forward, the first moment their data is needed)."""
        return self.host.flush(copy, self.now) if self.host is not None else 0

    def swap_out(self, num_pages: int) -> int:
        """Evict about num_pages cached device pages, least recently used large pages
        first, freeing them; those that can serve a hit stay in the host tier (written
        now, or behind earlier). Returns the pages that left the device."""
        if self.host is None:
            return 0
        gone = 0
        while gone < num_pages:
            out = self.alloc.evict(1)
            if not out:
                break
            gone += out
        return gone

    def allocate_slots(self, req_id: RequestId, num_new_tokens: int) -> bool:
        """Give the next `num_new_tokens` tokens slots; False (and no change) if full."""
        r = self._req(req_id)
        upto = r.num_computed + num_new_tokens
        if num_new_tokens <= 0 or upto > len(r.tokens):
            raise ValueError(
                f"request {req_id!r}: cannot allocate {num_new_tokens} tokens at position "
                f"{r.num_computed} of {len(r.tokens)} known tokens"
            )
        if upto <= r.num_alloc:
            return True
        needs = [(m.s, m.num_new_pages(r, upto)) for m in self.managers]
        try:
            pages = self.alloc.allocate(req_id, needs)
        except OutOfPages:
            # A new request waits for the running ones, so admissions never split a
            # running prefix; a running one takes what others hold for their reuse
            # points, else the scheduler preempts another (or, alone, it goes lean).
            pages = self._allocate_dropping_held(r, needs) if r.num_alloc > r.num_hit else None
            if pages is None:
                return False
        self._demote_cut()
        for m, pids in zip(self.managers, pages):
            m.install(r, pids, upto)
        if r.num_alloc == r.num_hit:
            # The first allocation takes the lookup. Counting here, not in lookup,
            # leaves out admissions the scheduler retried while memory was full.
            self.queried_tokens += len(r.tokens)
            self.hit_tokens += r.num_hit
            self.num_admitted += 1
            self._compute_prompt(r, True)
            if r.num_host_hit:
                self.host.hit_tokens += r.num_host_hit
        r.num_alloc = upto
        return True

    def advance(self, req_id: RequestId, num_tokens: int) -> None:
        """The KV of the next `num_tokens` tokens has been written."""
        r = self._req(req_id)
        done = r.num_computed + num_tokens
        if num_tokens <= 0 or done > r.num_alloc:
            raise ValueError(
                f"request {req_id!r}: advance by {num_tokens} past its {r.num_alloc} slots"
            )
        if self.enable_caching:
            extend_block_hashes(r.hashes, r.tokens, self.T, r.images, upto=done)
            for m in self.managers:
                m.advance(r, done, self._key(r))
        else:
            for m in self.managers:
                m.release_inactive(r, done, self.now)
        r.num_computed = done
        if done >= r.prompt_len:
            self._compute_prompt(r, False)

    def finish(self, req_id: RequestId) -> None:
        """Release every page; those holding hashed KV stay as evictable cache."""
        r = self.reqs.pop(req_id, None)
        if r is None:
            raise KeyError(f"unknown request {req_id!r}")
        self._compute_prompt(r, False)
        # Taken back after lookup, nothing allocated (the scheduler retries it soon): its
        # hit pages get its key only where that is later. A loop member's key is the
        # oldest: a loop miss retried while another one prefilled lost its hit to that
        # one, a little more at each retry.
        taken_back = r.num_alloc == r.num_hit
        key = self._key(r)
        # One release: equal keys evict the longest prefix first across specs, so a
        # prefix shrinks from its tail in every layer type at once (aligned rule).
        self.alloc.begin_release()
        try:
            for m in self.managers:
                if taken_back:
                    m.take_back(r, key)
                else:
                    m.free_all(r, key)
        finally:
            self.alloc.end_release()
        if not taken_back:
            if self.write_behind:
                self._write_ahead(r)
            # An admission taken back after allocating computed nothing: no use to remember.
            if self.enable_caching and r.num_computed > r.num_hit:
                self.reuse.remember(r)
                if self.cuts is not None:
                    self.cuts.add(key, r.hashes[:r.num_computed // self.T])
        self.alloc.forget_request(req_id)

    abort = finish  # an abort keeps what was computed: it is valid KV

    def _compute_prompt(self, r: RequestKV, computing: bool) -> None:
        """r starts (True) or stops computing its prompt."""
        if not self.enable_caching:
            return
        if computing:
            self.computing[r.req_id] = r
        else:
            self.computing.pop(r.req_id, None)

    def waits_for_running(self, req_id: RequestId, num_new_tokens: int,
                          waiting: int = 0) -> bool:
        """After lookup: whether the request should wait for a running request, even
        last in the queue (the engine does not idle: the other one runs), with
        `waiting` others queued. Three cases:

        - most of its prompt is being computed right now: a step or a few later it
          hits that prefix instead of computing it a second time beside it (two
          questions on one new document arriving together cost one document);
        - it is a loop miss, other loop misses compute their prompts, and the
          rest of all of them (`num_new_tokens` a step) would peak above the free
          and dead pages: their prefills, each evicting for its peak, would take
          the set that keeps hitting (loop pages too: they are that set); one
          after the other, the next one reuses the room the last one left. At
          32 Gemma 3 articles round-robin, 8192-token steps, this took 1/s from
          59.8% to 62.5% and 4/s from 43.1% to 51.8%, with lower TTFT (p99 1.9 ->
          1.0 s and 41 -> 22 s): misses compute less. Where they fit (short
          prompts), waiting would only leave the step's budget unused;
        - it is a loop miss over a document (more than LONG_PROMPT tokens) and
          other such loop misses run, prefilling or decoding: one other if more
          than SHORT_QUEUE others wait, MAX_LOOP_MISSES others if not, and
          below that cap any other if its peak does not fit in the pages the
          loop rule gives up (free, dead, loop members'). Each holds a whole
          document's pages to its end and, once finished, is the loop's first
          victim, so every document computed beside it costs the set that
          keeps hitting one more: the room a burst of misses takes from that
          set stays the loop's afterwards. With a backlog they go one at a
          time, and the hits queued behind start meanwhile. Gemma 3 12B at
          4/s: 32 articles round-robin 56.3% -> 65.2%, shuffled 56.9% ->
          66.4%, 64 articles 51.4% -> 58.9% and 58.5% -> 64.5%. Without one,
          one at a time made waits stack into a queue at 1/s (64 articles:
          ten times the mean TTFT for no hits); the cap only trims the bursts
          of Poisson arrivals (docs/benchmarks.md has both), and below it they
          go together only where they fit beside the set (Jamba 1.5 Mini,
          round-robin 64 at 1/s, 28.2% -> 31.3% for a mean TTFT of 0.28 ->
          0.43 s; Gemma 3 12B round-robin 32 at 1/s 45.4% -> 49.5% for 0.47
          -> 0.81 s).
          Shorter prompts (chat turns) are left out: there the wait lasted
          whole answers (from 2,048 tokens up: ShareGPT chat, 200 sessions at
          2/s, 21.0% -> 20.6% with a higher TTFT; with no length limit 25.3%
          for 5x the mean TTFT).
        """
        r = self._req(req_id)
        if _loop_miss(r):
            if r.prompt_len > self.LONG_PROMPT:
                # Allocated past its hit: admitted, this step or before. Counted up to
                # the limit only: this runs for every queued document miss each step.
                limit = 1 if waiting > self.SHORT_QUEUE else self.MAX_LOOP_MISSES
                misses = (o for o in self.reqs.values()
                          if o is not r and o.num_alloc > o.num_hit and _loop_miss(o)
                          and o.prompt_len > self.LONG_PROMPT)
                running = list(islice(misses, limit))
                if running and (len(running) == limit or not self._fits([r], num_new_tokens, 0)):
                    return True
            others = [o for o in self.computing.values() if o is not r and _loop_miss(o)]
            if others and not self._fits([r, *others], num_new_tokens, DEAD + 1):
                return True
        hashes = r.hashes
        q = r.num_hit // self.T
        shared = max((_common_blocks(hashes, o.hashes, q) for o in self.computing.values()
                      if o is not r), default=q)
        return 2 * (shared - q) * self.T >= r.prompt_len

    def can_start(self, req_id: RequestId, num_new_tokens: int) -> bool:
        """After lookup: whether the request should start now (False: it waits, and the
        scheduler admits the requests behind it first; the last request in the
        queue starts regardless, so waiting only reorders a backlog).

        A loop member that missed waits while other requests run, until no other
        loop miss runs and its prefill (`num_new_tokens` a step) fits in memory the
        loop rule gives up anyway: free pages, dead pages, other loop members'. It
        waits at most one loop period of admissions. Otherwise several misses
        prefill at once, each evicting a prefix of the set that keeps hitting, and
        the set shrinks with every burst: at 32 Gemma 3 articles round-robin, 4/s,
        it kept none of the ~20 that fit (50% hits with this rule). With no
        backlog (1/s) there is nothing to reorder and the rule does nothing;
        idling the engine for it there bought hits for seconds of TTFT on chat.
        """
        r = self._req(req_id)
        waits = self._waits
        if _loop_miss(r) and len(self.reqs) > 1 and not self._miss_fits(r, num_new_tokens):
            since = waits.setdefault(req_id, self.num_admitted)
            while len(waits) > self.reuse.limit:  # requests cancelled while they waited
                del waits[next(iter(waits))]
            if self.num_admitted - since < r.gap:
                return False
        waits.pop(req_id, None)
        return True

    # A loop miss over more tokens than this waits while another such loop miss runs if
    # there is a backlog, while MAX_LOOP_MISSES run if not (waits_for_running):
    # documents, not chat turns. 3, not 2 or 4: Gemma 3 12B, 1/s,
    # 64 articles round-robin 15.9% -> 16.9 / 18.0 / 16.5% hits for 0.72 -> 2.00 /
    # 1.06 / 0.93 s mean TTFT; with 8192-token steps 28.3% -> 33.2 / 30.7 / 30.6%
    # for 0.56 -> 1.46 / 0.84 / 0.67 s.
    LONG_PROMPT = 8192
    MAX_LOOP_MISSES = 3

    # A miss prefills at most this many tokens a step while the queue is short: at
    # most SHORT_QUEUE others wait. 2, not 4: Jamba 1.5 Mini, 32 articles round-robin
    # at 4/s, 15.1% -> 19.2% (its queue stays short, and the cap slowed it), Gemma 3
    # shuffled 32 at 4/s 53.4% -> 54.9%; Gemma 3's 1/s loops keep the cap's gain but
    # for 0.9 points at two of them (docs/benchmarks.md).
    MISS_CHUNK = 2048
    SHORT_QUEUE = 2

    def max_chunk(self, req_id: RequestId, waiting: int) -> int | None:
        """The most prompt tokens the request may compute this step (None: the step's
        budget), with `waiting` requests queued.

        A miss's prefill evicts for its peak; in 2048-token chunks a 20K-token
        prompt peaks at a fifth of the sliding-window pages (and of the Mamba
        checkpoints taken inside one step). That costs steps, so only where a
        smaller step lowers some spec's peak, and only while few requests wait:
        with a backlog, the budget is what clears it (and the reordered backlog is
        where its hits come from). A loop miss is capped so regardless of the room
        (what it would evict is the set that keeps hitting): Gemma 3 12B, 32
        articles round-robin, 1/s, 18.9% -> 38.9% of prompt tokens (mean TTFT 0.57
        -> 0.41 s); at 4/s unchanged (55.6% -> 55.4%), where a cap at every queue
        length cost 12 points. Another miss is capped only where its prefill in
        one step would not fit in free and dead pages, i.e. would evict cache that
        can still hit, and once prompts have shared a prefix (the cache serves
        hits): 32 articles shuffled, 1/s, 40.9% -> 48.8%. Capping it regardless
        cost 4.5 points at 8192-token steps, 32 round-robin, 4/s; before any shared
        hit, Ministral's unshared long documents lost decode batch (5.44 -> 5.34,
        3.88 -> 3.39) to steps and preemptions that protected nothing. Before
        any shared hit, only a step that would not fit even in the evictable
        pages is cut, to the largest that fits (`_fitting_chunk`).
        """
        r = self._req(req_id)
        if waiting > self.SHORT_QUEUE or not _miss(r):
            return None
        chunk = self.MISS_CHUNK
        rest, n = len(r.tokens) - r.num_computed, len(r.tokens)
        # The peak of a step of the rest: a window held from before counts (a step of
        # all n tokens and one that ends there hold the same window).
        if rest <= chunk or all(
                m.peak_pages(n, chunk, r.images) == m.peak_pages(n, rest, r.images)
                for m in self.managers):
            return None  # smaller steps would lower no spec's peak (no window in the way)
        if r.loop or self.reuse.branched and not self._fits([r], rest, DEAD + 1):
            return chunk
        return self._fitting_chunk(r, rest)

    def _fitting_chunk(self, r: RequestKV, rest: int) -> int | None:
        """The largest step of r's prompt that fits in free and evictable pages, where
        all of the rest does not and MISS_CHUNK does (else None).

        A step past them takes the windows running requests hold for their reuse
        points. With no hit seen yet, every request a miss, nothing capped them:
        Gemma 3 12B, 16 articles round-robin, 4/s, a first question prefilled with
        others in one step took the windows of the articles before it, and every
        second question missed (74.3% -> 87.3% of prompt tokens, mean TTFT 1.41 ->
        0.20 s). Other prompts part computed count with their rest.
        """
        reqs = [r, *(o for o in self.reqs.values()
                     if o is not r and o.num_hit < o.num_alloc < o.prompt_len)]
        supply = self.alloc.supply_below(-DEAD)  # one scan of the large pages for all probes
        if (self._within(reqs, rest, supply)
                or not self._within(reqs, self.MISS_CHUNK, supply)):
            return None
        T = self.T
        lo, hi = self.MISS_CHUNK // T, -(-rest // T)  # blocks a step: lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._within(reqs, mid * T, supply) else (lo, mid)
        return lo * T

    def _miss_fits(self, r: RequestKV, chunk: int) -> bool:
        """Whether loop miss r may prefill beside the requests that run now."""
        return (not any(_loop_miss(o) for o in self.reqs.values() if o is not r)
                and self._fits([r], chunk, 0))

    def _fits(self, reqs: list[RequestKV], chunk: int, below: int) -> bool:
        """Whether the rest of these requests' prompts (past the slots they hold), in steps
        of `chunk` tokens, peak within free pages and cached ones whose key is below
        `below` (0: dead and loop pages, which the loop rule gives up; DEAD + 1: dead)."""
        return self._within(reqs, chunk, self.alloc.supply_below(below))

    def _within(self, reqs: list[RequestKV], chunk: int, supply: list[int]) -> bool:
        """_fits against a supply of large pages per partition (supply_below's)."""
        need = [0] * len(supply)
        for r in reqs:
            for m in self.managers:
                pages = m.peak_pages(len(r.tokens) - r.num_alloc, chunk, r.images)
                need[self.alloc.part[m.s]] += -(-pages // self.layout.pages_per_large[m.s])
        return all(n <= have for n, have in zip(need, supply))

    def _allocate_dropping_held(
        self, r: RequestKV, needs: list[tuple[int, int]]
    ) -> list[list[int]] | None:
        """r's pages, taken after other requests let go of their held pages (they
        stay cached), least valuable first, until r's allocation fits; None, and
        nothing changes, if it never does.

        One request at a time, not all at once: letting every held window go at
        the first shortage made each question arriving while its article's
        previous question decoded miss (Gemma 3 12B, 32 articles round-robin,
        4/s, 8192-token steps: 19.0%, below uniform's 32.5%; one at a time by
        value: 43.4%). The value of a request's held pages is the prefill a hit
        at its reuse points saves per byte they hold (Marconi's compute saved
        per byte): its prompt's tokens over the bytes.
        """
        pb = self.layout.page_bytes
        held = [o for o in self.reqs.values() if o.held]
        held.sort(key=lambda o: o.prompt_len / sum(len(v) * pb[s] for s, v in o.held.items()))
        dropped = []
        for o in held:
            for m in self.managers:
                if m.s in o.held:
                    dropped.append((o, m.s, o.held[m.s]))
                    m.drop_held(o, self._key(o))
            try:
                return self.alloc.allocate(r.req_id, needs)
            except OutOfPages:
                pass
        for other, s, pids in dropped:  # still short: nothing changes after all
            self.alloc.claim(s, pids)
            other.held[s] = pids
        return None

    def _key(self, r: RequestKV) -> int:
        """Eviction key of the pages r releases now: the step, unless it is in a loop."""
        return self.now if r.key is None else min(r.key, self.now)

    def fits_alone(
        self, num_tokens: int, chunk: int, images: Sequence[ImageInput] = (),
        limit: int | None = None,
    ) -> bool:
        """Whether one request of num_tokens fits an otherwise empty pool (chunked prefill)
        of at most `limit` large pages (None: the whole pool)."""
        large = 0
        for m in self.managers:
            pages = m.peak_pages(num_tokens, chunk, images)
            large += -(-pages // self.layout.pages_per_large[m.s])
        return large <= (self.num_large_pages if limit is None else
                         min(limit, self.num_large_pages))

    # ------------------------------------------------ MemPool index (no claims)

    def block_keys(self, tokens: Sequence[int]) -> list[Hashable]:
        """The prefix-cache key of every full block of tokens."""
        hashes: list[Hashable] = []
        extend_block_hashes(hashes, tokens, self.T)
        return hashes

    def match(self, tokens: Sequence[int]) -> tuple[int, list[list[tuple[bool, int] | None]]]:
        """The longest prefix of tokens every spec can serve from either tier, untaken:
        (tokens, per spec and block of it (in host tier, page), None where the spec
        needs no page: out of a window, between Mamba checkpoints)."""
        r = RequestKV(None, tokens, (), hashes=self.block_keys(tokens))
        q = self._longest_common_hit(r, len(r.hashes), tiers=self.host is not None)
        out = []
        for m in self.managers:
            needed = set(m.hit_keys(r, q))
            dev = self.alloc.specs[m.s].cached
            host = self.host.cached(m.s) if self.host is not None else {}
            out.append([None if h not in needed else (False, dev[h]) if h in dev
                        else (True, host[h]) for h in r.hashes[:q]])
        return q * self.T, out

    def hold(self, tokens: Sequence[int]) -> tuple[dict[str, set[int]], list[tuple[int, int]]]:
        """Per spec, the full blocks of tokens cached on the device, pinned there (a sender
        skips them, so they must outlive the transfer): ({spec: blocks}, pins), until
        `release(pins)`."""
        keys, out, pins = self.block_keys(tokens), {}, []
        for m in self.managers:
            dev = self.alloc.specs[m.s].cached
            out[m.spec.name] = {b for b, h in enumerate(keys) if h in dev}
            pins += [(m.s, dev[keys[b]]) for b in out[m.spec.name]]
        for s, pid in pins:
            self.alloc.claim(s, [pid])
        return out, pins

    def release(self, pins: Sequence[tuple[int, int]]) -> None:
        """Undo hold(): the pages go back to what they were (evictable, same LRU place)."""
        for s, pid in pins:
            self.alloc.unclaim(s, [pid])

    def cached_keys(self) -> dict[str, set[Hashable]]:
        """Per tier ("device", "host"), the block keys a prefix's every block is kept
        under: a full-attention spec's (the first spec's when none), what routers index."""
        m = (self._full_specs or self.managers)[0]
        out = {"device": set(self.alloc.specs[m.s].cached)}
        if self.host is not None:
            out["host"] = set(self.host.cached(m.s))
        return out

    def delete(self, tokens: Sequence[int]) -> int:
        """Forget every cached block of tokens in both tiers; returns the pages forgotten.
        Pages in use stay with their requests, uncached."""
        n = 0
        for h in self.block_keys(tokens):
            for m in self.managers:
                pid = self.alloc.specs[m.s].cached.get(h)
                if pid is not None:
                    self.alloc.discard(m.s, [pid], self.now)
                    n += 1
                if self.host is not None and self.host.discard(m.s, h, self.now):
                    n += 1
        return n

    # ------------------------------------------------------ DistAttention

    def lendable_blocks(self, req_id: RequestId) -> int:
        """Full-attention blocks of a request written here and not lent yet: what `lend`
        can move. Specs without full attention (sliding windows, Mamba) never spread:
        their KV is bounded, so it stays with the request."""
        r = self._req(req_id)
        if not self.full_specs():
            return 0
        return max(0, r.num_computed // self.T - r.lent // self.T)

    def lend(self, req_id: RequestId, num_blocks: int) -> dict[str, list[int]]:
        """Hand the request's next `num_blocks` full-attention blocks (after those lent
        before) to another instance's memory: per full spec, the pages holding them.
        Their slots here are let go now (cached ones stay evictable cache), so the caller
        copies them out before anything else allocates."""
        r = self._req(req_id)
        if not 0 < num_blocks <= self.lendable_blocks(req_id):
            raise ValueError(f"request {req_id!r}: cannot lend {num_blocks} blocks of "
                             f"{self.lendable_blocks(req_id)} written and not lent")
        first = r.lent // self.T
        out = {}
        for m in self.full_specs():
            table = r.tables[m.s]
            pages = table[first:first + num_blocks]
            table[first:first + num_blocks] = [NO_PAGE] * num_blocks
            r.released[m.s] = first + num_blocks
            self.alloc.free(m.s, [p for p in reversed(pages) if p != NO_PAGE], self._key(r))
            out[m.spec.name] = pages
        r.lent += num_blocks * self.T
        return out

    def lent(self, req_id: RequestId) -> int:
        """Leading tokens whose full-attention KV lives on other instances."""
        return self._req(req_id).lent

    def full_specs(self) -> list[SpecManager]:
        return self._full_specs

    def full_block_bytes(self) -> int:
        """Bytes of one block of every full-attention spec: what lending a block moves."""
        return sum(self.layout.page_bytes[m.s] for m in self._full_specs)

    # ------------------------------------------------------------ model runner

    def block_tables(self, req_id: RequestId) -> dict[str, list[int]]:
        """Per-spec page ids (NO_PAGE = -1 where a page was released)."""
        r = self._req(req_id)
        return {m.spec.name: list(r.tables[m.s]) for m in self.managers}

    def pending_copies(self, req_id: RequestId, spec_name: str) -> list[tuple[int, int]]:
        """Mamba: (token position, page) snapshots to take; position 0 = restore."""
        r = self._req(req_id)
        return list(r.pending[self.layout.index(spec_name)])

    def num_computed(self, req_id: RequestId) -> int:
        return self._req(req_id).num_computed

    # ------------------------------------------------------------------ stats

    def stats(self) -> Stats:
        """Bytes per spec; the ideal is what the model's own rules need, per policy alike."""
        ideal = self._ideal_by_model_spec()
        out = []
        for m in self.managers:
            sp, pb = self.alloc.specs[m.s], self.layout.page_bytes[m.s]
            need = sum(ideal[i] for i in self._members[m.spec.name])
            # Empty pages of large pages that only hold cache come back whole when
            # the large page is evicted: count them as reclaimable, not as waste.
            idle = sp.n_idle_empty
            # Pages held only for a reuse point are cache that running requests can
            # take back (_drop_held): count them as evictable, not as used; so are
            # those a step writes only for a reuse point, held once it ends.
            held = sum(1 for r in self.reqs.values()
                       for p in (*r.held.get(m.s, ()), *m.early_pages(r)) if sp.ref[p] == 1)
            used, empty = (sp.n_used - held) * pb, (sp.n_empty - idle) * pb
            out.append(SpecStats(m.spec.name, pb, used, (sp.n_evictable + idle + held) * pb,
                                 empty, need, used + empty - need))
        free = self.alloc.num_free_large() * self.layout.large_page_bytes
        host = self.host.stats() if self.host is not None else None
        return Stats(self.policy, self.pool_bytes, free, out, self.queried_tokens,
                     self.hit_tokens, host)

    def _ideal_by_model_spec(self) -> list[int]:
        out = []
        for rules in self._ideal_rules:
            slots: dict[object, int] = {}
            for r in self.reqs.values():
                slots.update(rules.live_slots(r))
            spec = rules.spec
            per_slot = spec.token_bytes() or spec.page_bytes(self.T)
            out.append(sum(slots.values()) * per_slot)
        return out


def _miss(r: RequestKV) -> bool:
    """A request that hit less than half its prompt."""
    return r.num_hit < r.prompt_len // 2


def _loop_miss(r: RequestKV) -> bool:
    """A loop member that missed."""
    return r.loop and _miss(r)


def _common_blocks(a: list[int], b: list[int], lo: int) -> int:
    """How many leading blocks two hash chains share, knowing it is not below lo.

    A block's hash covers its whole prefix, so the chains agree up to some
    block and differ from there on: a binary search finds it.
    """
    hi = min(len(a), len(b))
    if lo >= hi or a[lo] != b[lo]:
        return lo
    lo += 1
    while lo < hi:  # a[:lo] == b[:lo]; find the first block that differs
        mid = (lo + hi) // 2
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo
