"""Jenga's two-level allocator: LCM large pages cut into per-spec small pages.

Small page ids are per spec: page `pid` of spec `s` lies in large page
`pid // k[s]` at slot `pid % k[s]`, so a spec's pages form one array
`[num_large * k[s], page_bytes[s]]` over the shared byte pool.

Small page states: empty (no valid KV, not used), evictable (valid cached KV,
no user) and used (ref count > 0). A large page is owned by one spec or free;
it is *unused* when none of its small pages is used (it then holds at least
one evictable page: a large page whose pages are all empty is returned to the
free list at once). Each large page is associated with the request it was
first handed to, and that request's later pages come from it first (§4.3),
so a request's pages tend to be freed together and whole large pages return.

Allocation order for one small page (§5.4):
  1. an empty small page associated with the request;
  2. an empty large page;
  3. evict an unused large page, least recently used first;
  4. any empty small page of the spec;
  5. evict an evictable small page of the spec, LRU (ties: longest prefix).

Everything here is integers and lists: no torch, so it is fast to test and
the simulator can run it at paper scale. The hot paths (a request's next
page, a new request's first page, freeing a request's pages) are written to
touch as few Python objects as possible: a large page's empty small pages
are one bitmask, a page's state follows from its ref count and hash, and a
request's own large pages are kept as a list checked when used rather than
updated on every free.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable, Sequence

from kvserve.memory.spec import Layout

EMPTY, EVICTABLE, USED = 0, 1, 2
# Eviction key of cached pages that can serve no hit in sight: below any step, so
# they go before every page that can.
DEAD = -(1 << 62)

RequestId = Hashable


class OutOfPages(RuntimeError):
    """Raised when an allocation cannot be satisfied; nothing was changed."""


class LRUQueue:
    """Min-queue of eviction entries (key..., id, stamp), stale ones skipped by the caller.

    Release times only grow, so most entries arrive in key order: those go to
    a deque in O(1); the few that arrive out of order go to a heap.
    """

    def __init__(self) -> None:
        self.fifo: deque[tuple] = deque()
        self.heap: list[tuple] = []

    def __bool__(self) -> bool:
        return bool(self.fifo or self.heap)

    def push(self, entry: tuple) -> None:
        if not self.fifo or entry >= self.fifo[-1]:
            self.fifo.append(entry)
        else:
            heapq.heappush(self.heap, entry)

    def peek(self) -> tuple:
        heap, fifo = self.heap, self.fifo
        if heap and (not fifo or heap[0] < fifo[0]):
            return heap[0]
        return fifo[0]

    def pop(self) -> tuple:
        heap, fifo = self.heap, self.fifo
        if heap and (not fifo or heap[0] < fifo[0]):
            return heapq.heappop(heap)
        return fifo.popleft()


class SpecPages:
    """Small-page state of one spec. Owned and mutated by TwoLevelAllocator.

    A page is used when ref > 0, evictable when ref == 0 and it has a hash,
    and empty otherwise.
    """

    __slots__ = ("k", "full", "ref", "hash", "last", "plen", "stamp", "cached", "lru", "holes",
                 "idle", "by_req", "n_used", "n_evictable", "n_large", "n_unused_large",
                 "n_idle_empty")

    def __init__(self, k: int, num_large: int) -> None:
        n = k * num_large
        self.k = k
        self.full = (1 << k) - 1  # empty-page mask of a large page with every page empty
        self.ref = [0] * n
        self.hash: list[Hashable | None] = [None] * n
        self.last = [0] * n  # last access time (LRU key)
        self.plen = [0] * n  # prefix length (tie-break: evict longest first)
        self.stamp = [0] * n  # bumps whenever a queue entry for the page goes stale
        self.cached: dict[Hashable, int] = {}
        self.lru = LRUQueue()  # evictable pages: (last, -plen, pid, stamp)
        self.holes: dict[int, None] = {}  # large pages with empty AND used pages
        self.idle: dict[int, None] = {}  # unused large pages with empty pages, oldest first
        # request -> large pages it may hold empty pages in (checked when used)
        self.by_req: dict[RequestId, list[int]] = {}
        self.n_used = 0
        self.n_evictable = 0
        self.n_large = 0
        self.n_unused_large = 0
        self.n_idle_empty = 0  # empty pages inside unused large pages

    @property
    def n_empty(self) -> int:
        """Empty pages inside owned large pages."""
        return self.n_large * self.k - self.n_used - self.n_evictable

    @property
    def state(self) -> bytearray:
        """EMPTY / EVICTABLE / USED per page (computed; for stats and tests)."""
        return bytearray(USED if r else EMPTY if h is None else EVICTABLE
                         for r, h in zip(self.ref, self.hash))

    def spare_in_used_large(self) -> int:
        """Empty + evictable pages inside large pages that also hold used pages."""
        return (self.n_large - self.n_unused_large) * self.k - self.n_used


class TwoLevelAllocator:
    """LCM large-page allocator with request-aware small-page allocators.

    `partitioned=True` gives the static baseline: the large pages are split
    equally between specs up front and never move between them.
    """

    __slots__ = ("layout", "num_large", "specs", "owner", "assoc", "used", "emask", "ltime",
                 "lplen", "lstamp", "part", "free_large", "lru_large", "_pushes", "group",
                 "grouped", "on_evict", "evicted_keys", "lgroup", "restoring")

    def __init__(self, layout: Layout, num_large: int, partitioned: bool = False) -> None:
        if num_large <= 0:
            raise ValueError("the pool must hold at least one large page")
        nspec = len(layout.specs)
        if partitioned and num_large < nspec:
            raise ValueError(f"static partition needs >= {nspec} large pages, got {num_large}")
        self.layout = layout
        self.num_large = num_large
        self.specs = [SpecPages(k, num_large) for k in layout.pages_per_large]
        self.owner = [-1] * num_large
        self.assoc: list[RequestId | None] = [None] * num_large
        self.used = [0] * num_large  # used small pages per large page
        self.emask = [0] * num_large  # bit i set: small page i is empty (owned pages only)
        self.ltime = [DEAD] * num_large  # latest last-access among its small pages
        # the shortest prefix among its cached pages of that latest time: ties between
        # large pages (of any spec) evict the longest prefix first (aligned rule)
        self.lplen = [0] * num_large
        self.lstamp = [0] * num_large
        self.part = list(range(nspec)) if partitioned else [0] * nspec
        nparts = nspec if partitioned else 1
        self.free_large: list[list[int]] = [[] for _ in range(nparts)]
        for lp in range(num_large - 1, -1, -1):
            self.free_large[lp % nparts if partitioned else 0].append(lp)
        # Unused large pages per partition: (time, release, -prefix length, push order, lp,
        # stamp). A release is one free() call, or every call between begin_release() and
        # end_release() (a finished request's pages of every spec): within one, equal
        # times evict the longest prefix first across specs (aligned rule); releases of
        # equal times go in their order.
        self.lru_large = [LRUQueue() for _ in range(nparts)]
        self._pushes = itertools.count()
        self.group = 0
        self.grouped = False
        self.lgroup = [0] * num_large  # the release of each large page's queue entry
        self.restoring = False  # unclaim: pages go back to their place in the queue
        # Called as on_evict(s, pids) just before cached pages lose their KV (their
        # hash, last and plen still readable): a lower tier may keep a copy.
        self.on_evict: Callable[[int, list[int]], None] | None = None
        # If set, the eviction keys of the pages evicted are added to it (those of a
        # large page's empty slots too: a superset, cheaper than a call per page).
        self.evicted_keys: set[int] | None = None

    # ---------------------------------------------------------------- queries

    def lookup(self, s: int, h: Hashable) -> int | None:
        return self.specs[s].cached.get(h)

    def num_free_large(self) -> int:
        return sum(len(f) for f in self.free_large)

    def supply_below(self, key: int) -> list[int]:
        """Per partition: free large pages plus unused ones whose key is below `key`.

        A scan of every large page: for rare decisions (a loop member's admission),
        not for the allocation paths.
        """
        supply = [len(f) for f in self.free_large]
        part = self.part
        for s, u, t in zip(self.owner, self.used, self.ltime):
            if s >= 0 and not u and t < key:
                supply[part[s]] += 1
        return supply

    # ------------------------------------------------------------- allocation

    def allocate(self, req: RequestId, needs: Sequence[tuple[int, int]]) -> list[list[int]]:
        """Allocate `n` small pages of spec `s` for each `(s, n)`, all or nothing.

        Raises OutOfPages (with nothing changed) when the pool cannot hold them
        even after evicting every evictable page.
        """
        if len(needs) == 1:  # fast paths: the request's own large page, or a fresh one
            s, n = needs[0]
            sp = self.specs[s]
            mine = sp.by_req.get(req)
            if mine:
                lp = mine[-1]
                m = self.emask[lp]
                # decode: the next page of the request's large page in use (inlined: hot)
                if n == 1 and m and self.used[lp] and self.owner[lp] == s and self.assoc[lp] == req:
                    low = m & -m
                    self.emask[lp] = m ^ low
                    self.used[lp] += 1
                    sp.n_used += 1
                    if m == low:
                        sp.holes.pop(lp, None)
                    pid = lp * sp.k + low.bit_length() - 1
                    sp.ref[pid] = 1
                    return [[pid]]
                lp = self._own_page(sp, s, req)
                if lp >= 0 and 0 < n <= self.emask[lp].bit_count():
                    out: list[int] = []
                    self._take_from(sp, lp, n, out)
                    return [out]
            elif n > 0 and self.free_large[self.part[s]] and not (n < sp.k and sp.idle):
                # a new request (step 2); a part of a large page adopts an unused one
                free = self.free_large[self.part[s]]
                if n < sp.k:  # part of one large page; the rest stays with the request
                    out = []
                    self._assign(sp, s, free.pop(), req, n, out)
                    return [out]
                if n == 1:  # k == 1: the page is a whole large page
                    lp = free.pop()
                    self._take_single(sp, s, lp)
                    return [[lp]]
                whole, rest = divmod(n, sp.k)
                if whole + (rest > 0) <= len(free):
                    out = []
                    self._take_whole(s, req, whole, out)
                    if rest:
                        self._assign(sp, s, free.pop(), req, rest, out)
                    return [out]
        tight = self._plan(req, needs)
        return [self._take(s, req, n, tight) for s, n in needs]

    def _own_page(self, sp: SpecPages, s: int, req: RequestId) -> int:
        """A large page of `req` with an empty page (step 1), or -1; drops stale entries."""
        mine = sp.by_req[req]
        owner, assoc, emask = self.owner, self.assoc, self.emask
        while mine:
            lp = mine[-1]
            if emask[lp] and owner[lp] == s and assoc[lp] == req:
                return lp
            mine.pop()
        return -1

    # Unused large pages _adopt looks at, newest first.
    ADOPT_SCAN = 8

    def _adopt(self, sp: SpecPages, req: RequestId, want: int) -> int:
        """Step 1 for a request with no large page of its own and fewer than k pages to
        take: an unused large page with `want` empty pages (one of the last ADOPT_SCAN
        to become unused) becomes its own, or -1.

        A finished request's last large page keeps its empty pages until the whole
        large page is evicted, since steps 2 and 3 come before them. A request that hit
        a long prefix computes a few pages and left most of a fresh large page empty:
        Jamba 1.5 Mini's 34-page large page, a question of 9 pages after its article,
        0.27 GB of a 9.2 GB pool on average (round-robin 32 articles, 1/s). Adopted,
        the large page keeps its cached pages and takes the request's key when they
        are released, as any page the request holds (the latest of its pages').
        """
        if want >= sp.k:  # an unused large page has fewer than k empty pages
            return -1
        for i, lp in enumerate(reversed(sp.idle)):
            if i == self.ADOPT_SCAN:
                break
            if self.emask[lp].bit_count() >= want:
                self.assoc[lp] = req
                sp.by_req.setdefault(req, []).append(lp)
                return lp
        return -1

    def _own_pages(self, sp: SpecPages, s: int, req: RequestId) -> list[int]:
        """Every large page of `req` with an empty page."""
        mine = sp.by_req.get(req)
        if not mine:
            return []
        owner, assoc, emask = self.owner, self.assoc, self.emask
        valid = {lp: None for lp in mine if emask[lp] and owner[lp] == s and assoc[lp] == req}
        mine[:] = valid
        return mine

    def _plan(self, req: RequestId, needs: Sequence[tuple[int, int]]) -> bool:
        """Decide how to allocate; returns True for the hole-filling 'tight' mode.

        The normal five-step order may spend a whole large page on one small
        page, so it is only used when the supply of whole large pages covers
        the worst case. Otherwise the tight mode first fills holes in large
        pages that are in use, which succeeds exactly when the pool can hold
        the request at all.
        """
        nparts = len(self.free_large)
        worst, exact = [0] * nparts, [0] * nparts
        used = self.used
        for s, n in needs:
            if n <= 0:
                continue
            sp = self.specs[s]
            p = self.part[s]
            own_unused = sum(1 for lp in self._own_pages(sp, s, req) if used[lp] == 0)
            worst[p] += -(-n // sp.k) + own_unused
            short = max(0, n - sp.spare_in_used_large())
            exact[p] += -(-short // sp.k)
        if all(worst[p] <= len(self.free_large[p]) for p in range(nparts)):
            return False
        supply = self._supply()
        if all(worst[p] <= supply[p] for p in range(nparts)):
            return False
        if all(exact[p] <= supply[p] for p in range(nparts)):
            return True
        need = {self.layout.specs[s].name: n for s, n in needs}
        raise OutOfPages(f"cannot allocate {need} small pages: pool exhausted")

    def _supply(self) -> list[int]:
        """Whole large pages each partition can hand out: free or evictable."""
        supply = [len(f) for f in self.free_large]
        for s, sp in enumerate(self.specs):
            supply[self.part[s]] += sp.n_unused_large
        return supply

    def _take(self, s: int, req: RequestId, n: int, tight: bool) -> list[int]:
        out: list[int] = []
        if n <= 0:
            return out
        sp = self.specs[s]
        if tight:  # holes first, then only whole large pages (k pages per unit of supply)
            self._take_holes(s, n, out)
        while len(out) < n:
            if not tight:  # step 1: the request's own large pages
                lp = self._own_page(sp, s, req) if req in sp.by_req else -1
                if lp < 0:
                    lp = self._adopt(sp, req, n - len(out))
                if lp >= 0:
                    self._take_from(sp, lp, n - len(out), out)
                    continue
            self._take_whole(s, req, (n - len(out)) // sp.k, out)
            if len(out) < n and not self._fresh_large(s, req, n - len(out), out):
                break
        if len(out) < n:  # steps 4 and 5: no whole large page is left
            self._take_holes(s, n, out)
        assert len(out) == n, "allocation plan was wrong"
        return out

    def _take_from(self, sp: SpecPages, lp: int, want: int, out: list[int]) -> None:
        """Mark up to `want` empty pages of large page `lp` used, lowest first."""
        m = self.emask[lp]
        if self.used[lp] == 0:  # an unused large page comes back into use
            sp.n_unused_large -= 1
            sp.n_idle_empty -= m.bit_count()
            sp.idle.pop(lp, None)
            self.lstamp[lp] += 1
        base, ref, cnt = lp * sp.k, sp.ref, 0
        while m and cnt < want:
            low = m & -m
            m ^= low
            pid = base + low.bit_length() - 1
            ref[pid] = 1
            out.append(pid)
            cnt += 1
        self.emask[lp] = m
        self.used[lp] += cnt
        sp.n_used += cnt
        if m:
            sp.holes[lp] = None
        else:
            sp.holes.pop(lp, None)

    def _take_whole(self, s: int, req: RequestId, m: int, out: list[int]) -> None:
        """Steps 2 and 3 in bulk: up to m whole large pages, every small page used."""
        if m <= 0:
            return
        p = self.part[s]
        free = self.free_large[p]
        take = min(m, len(free))
        lps = free[len(free) - take:]
        del free[len(free) - take:]
        if len(lps) < m:
            lps += self._evict_lru_large(p, m - len(lps))
        sp = self.specs[s]
        k = sp.k
        ref, owner, used, assoc = sp.ref, self.owner, self.used, self.assoc
        if k == 1:  # small page = large page: nothing is left over to associate
            for lp in lps:
                ref[lp] = used[lp] = 1
                owner[lp] = s
            out.extend(lps)
        else:
            ones = [1] * k
            for lp in lps:
                base = lp * k
                ref[base:base + k] = ones
                out.extend(range(base, base + k))
                owner[lp] = s
                used[lp] = k
                assoc[lp] = req
        sp.n_large += len(lps)
        sp.n_used += len(lps) * k

    def _take_single(self, sp: SpecPages, s: int, lp: int) -> None:
        """Use the one small page of a cleared large page (k == 1)."""
        sp.ref[lp] = 1
        self.owner[lp] = s
        self.used[lp] = 1
        sp.n_large += 1
        sp.n_used += 1

    def _fresh_large(self, s: int, req: RequestId, want: int, out: list[int]) -> bool:
        """Steps 2 and 3: a free large page, else evict the LRU unused one."""
        p = self.part[s]
        free = self.free_large[p]
        if free:
            lp = free.pop()
        else:
            evicted = self._evict_lru_large(p, 1)
            if not evicted:
                return False
            lp = evicted[0]
        self._assign(self.specs[s], s, lp, req, want, out)
        return True

    def _evict_lru_large(self, p: int, m: int) -> list[int]:
        """Step 3 in bulk: evict up to m unused large pages, least recently used first."""
        queue, lstamp, used, owner = self.lru_large[p], self.lstamp, self.used, self.owner
        out: list[int] = []
        while len(out) < m and queue:
            _, _, _, _, lp, stamp = queue.pop()
            if stamp == lstamp[lp] and used[lp] == 0 and owner[lp] >= 0:
                self._evict_large(lp)
                out.append(lp)
        return out

    def _evict_large(self, lp: int) -> None:
        """Drop every cached page of an unused large page and make it free."""
        s = self.owner[lp]
        sp = self.specs[s]
        base = lp * sp.k
        hashes, cached, stamp = sp.hash, sp.cached, sp.stamp
        if self.evicted_keys is not None:
            self.evicted_keys.update(sp.last[base:base + sp.k])
        if self.on_evict is not None:
            self.on_evict(s, [p for p in range(base, base + sp.k) if hashes[p] is not None])
        for pid in range(base, base + sp.k):
            h = hashes[pid]
            if h is not None:
                del cached[h]
                hashes[pid] = None
                stamp[pid] += 1
        empty = self.emask[lp].bit_count()
        sp.n_evictable -= sp.k - empty
        sp.n_idle_empty -= empty
        sp.n_unused_large -= 1
        sp.idle.pop(lp, None)
        self._detach(sp, lp)

    def _assign(self, sp: SpecPages, s: int, lp: int, req: RequestId, want: int,
                out: list[int]) -> None:
        """Hand a cleared large page to spec s for `req`; take `want` pages of it."""
        k = sp.k
        base = lp * k
        take = want if want < k else k
        if take == 1:
            sp.ref[base] = 1
            out.append(base)
        else:
            sp.ref[base:base + take] = [1] * take
            out.extend(range(base, base + take))
        self.owner[lp] = s
        self.assoc[lp] = req
        self.used[lp] = take
        sp.n_large += 1
        sp.n_used += take
        if take < k:  # the rest stays with the request (§4.3)
            self.emask[lp] = sp.full ^ ((1 << take) - 1)
            sp.holes[lp] = None
            sp.by_req.setdefault(req, []).append(lp)

    def _detach(self, sp: SpecPages, lp: int) -> None:
        """The spec gives up a large page whose small pages are all cleared."""
        sp.n_large -= 1
        self.owner[lp] = -1
        self.assoc[lp] = None
        self.emask[lp] = 0
        self.ltime[lp] = DEAD
        self.lstamp[lp] += 1  # drops its stale LRU entries

    def _take_holes(self, s: int, n: int, out: list[int]) -> None:
        """Steps 4 and 5 restricted to large pages that hold used pages.

        In normal mode this runs only when no whole large page is left, so
        the restriction removes nothing; in tight mode it keeps unused large
        pages whole for the other specs of the same allocation.
        """
        sp = self.specs[s]
        while len(out) < n and sp.holes:
            self._take_from(sp, next(iter(sp.holes)), n - len(out), out)
        skipped = []
        while len(out) < n and sp.lru:
            entry = sp.lru.pop()
            pid = entry[2]
            if entry[3] != sp.stamp[pid]:
                continue
            lp = pid // sp.k
            if self.used[lp] == 0:
                skipped.append(entry)
                continue
            if self.evicted_keys is not None:
                self.evicted_keys.add(sp.last[pid])
            if self.on_evict is not None:
                self.on_evict(s, [pid])
            self._uncache(sp, pid)
            sp.n_evictable -= 1
            sp.n_used += 1
            sp.ref[pid] = 1
            self.used[lp] += 1
            out.append(pid)
        for entry in skipped:
            sp.lru.push(entry)

    # ----------------------------------------------------------- claim / free

    def claim(self, s: int, pids: Sequence[int]) -> None:
        """Take one more reference on cached pages (a prefix hit)."""
        sp = self.specs[s]
        ref, used = sp.ref, self.used
        for pid in pids:
            if ref[pid] == 0:
                if sp.hash[pid] is None:
                    raise ValueError(f"page {pid} of spec {s} holds no cached KV")
                sp.stamp[pid] += 1
                sp.n_evictable -= 1
                sp.n_used += 1
                lp = pid // sp.k
                if used[lp] == 0:
                    m = self.emask[lp]
                    sp.n_unused_large -= 1
                    sp.n_idle_empty -= m.bit_count()
                    self.lstamp[lp] += 1
                    if m:
                        sp.holes[lp] = None
                        sp.idle.pop(lp, None)
                used[lp] += 1
            ref[pid] += 1

    def unclaim(self, s: int, pids: Sequence[int], key: int = DEAD) -> None:
        """Undo claim(s, pids): the pages keep the eviction keys they had, and their
        place among equal keys (their release), or get `key` where that is later."""
        last = self.specs[s].last
        try:
            for pid in pids:
                self.restoring = last[pid] >= key
                self.free(s, [pid], max(last[pid], key))
        finally:
            self.restoring = False

    def free(self, s: int, pids: Sequence[int], now: int) -> None:
        """Drop one reference per page; last users leave pages evictable or empty.

        `now` is the step of the release; steps only grow, so the last
        release is the page's last access. Pages that become empty are
        handed back per large page: a request's pages come in runs.
        """
        if not self.grouped:
            self.group += 1
        sp = self.specs[s]
        if sp.k == 1:
            self._free_whole_pages(s, sp, pids, now)
            return
        ref, hashes, k = sp.ref, sp.hash, sp.k
        run_lp, bits, cnt = -1, 0, 0
        for pid in pids:
            r = ref[pid] - 1
            if r:
                if r < 0:
                    if cnt:
                        self._to_empty(s, sp, run_lp, bits, cnt)
                    raise ValueError(f"double free of page {pid} of spec {s}")
                ref[pid] = r
                continue
            ref[pid] = 0
            if hashes[pid] is not None:
                sp.last[pid] = now
                self._to_evictable(s, sp, pid)
                continue
            lp = pid // k
            if lp != run_lp:
                if cnt:
                    self._to_empty(s, sp, run_lp, bits, cnt)
                run_lp, bits, cnt = lp, 0, 0
            bits |= 1 << (pid - lp * k)
            cnt += 1
        if cnt:
            self._to_empty(s, sp, run_lp, bits, cnt)

    def begin_release(self) -> None:
        """The frees and touches until end_release() are one release: their large pages
        of equal times are evicted longest prefix first across specs."""
        self.group += 1
        self.grouped = True

    def end_release(self) -> None:
        self.grouped = False

    def _free_whole_pages(self, s: int, sp: SpecPages, pids: Sequence[int], now: int) -> None:
        """free() for a spec whose small page is a whole large page: an empty page goes
        straight back to the free list (nothing else of its large page to track).

        Of _detach's resets only the owner's is needed here: such a page never has an
        empty-page mask or a request association, its time is set anew when it becomes
        evictable, and a page becoming unused again gets a fresh stamp.
        """
        ref, hashes, used, owner = sp.ref, sp.hash, self.used, self.owner
        free = self.free_large[self.part[s]]
        released = len(free)
        try:
            for pid in pids:
                r = ref[pid] - 1
                if r:
                    if r < 0:
                        raise ValueError(f"double free of page {pid} of spec {s}")
                    ref[pid] = r
                elif hashes[pid] is None:
                    ref[pid] = used[pid] = 0
                    owner[pid] = -1
                    free.append(pid)
                else:
                    ref[pid] = 0
                    sp.last[pid] = now
                    self._to_evictable(s, sp, pid)
        finally:
            released = len(free) - released
            sp.n_used -= released
            sp.n_large -= released

    def _to_evictable(self, s: int, sp: SpecPages, pid: int) -> None:
        lp = pid // sp.k
        sp.n_used -= 1
        self.used[lp] -= 1
        sp.n_evictable += 1
        sp.stamp[pid] += 1
        t = sp.last[pid]
        if sp.k > 1:  # with one page per large page, the large-page LRU covers it
            sp.lru.push((t, -sp.plen[pid], pid, sp.stamp[pid]))
        if sp.k == 1 or self.ltime[lp] < t:  # one page: its key, whatever the last one's
            self.ltime[lp] = t
            self.lplen[lp] = sp.plen[pid]
        elif self.ltime[lp] == t and sp.plen[pid] < self.lplen[lp]:
            self.lplen[lp] = sp.plen[pid]
        if self.used[lp] == 0:
            self._became_unused(s, sp, lp)

    def _to_empty(self, s: int, sp: SpecPages, lp: int, bits: int, cnt: int) -> None:
        """`cnt` pages of one large page (mask `bits`) lost their last user, no cached KV."""
        sp.n_used -= cnt
        left = self.used[lp] - cnt
        self.used[lp] = left
        old = self.emask[lp]
        m = old | bits
        if m == sp.full:  # every page empty: hand the large page back (_detach, inlined)
            if old:
                sp.holes.pop(lp, None)
                self.emask[lp] = 0
            sp.n_large -= 1
            self.owner[lp] = -1
            self.assoc[lp] = None
            self.ltime[lp] = DEAD
            self.lstamp[lp] += 1
            self.free_large[self.part[s]].append(lp)
            return
        self.emask[lp] = m
        if not old:  # its request may use the pages again (§4.3)
            mine = sp.by_req.get(self.assoc[lp])
            if mine is not None:
                mine.append(lp)
        if left:
            sp.holes[lp] = None
        else:
            self._became_unused(s, sp, lp)

    def _became_unused(self, s: int, sp: SpecPages, lp: int) -> None:
        """No used page left, some cached: the large page can be evicted whole."""
        k = sp.k
        if k > 1:  # its key: the latest of its cached pages' now (keys can go down), and
            # the shortest prefix among the pages of that time
            t, n = _large_key(sp, lp)
            self.ltime[lp], self.lplen[lp] = DEAD if t is None else t, n
        sp.holes.pop(lp, None)
        sp.n_unused_large += 1
        sp.n_idle_empty += self.emask[lp].bit_count()
        if self.emask[lp]:
            sp.idle[lp] = None
        self.lstamp[lp] += 1
        g = self.lgroup[lp] if self.restoring else self.group
        self.lgroup[lp] = g
        entry = (self.ltime[lp], g, -self.lplen[lp], next(self._pushes), lp, self.lstamp[lp])
        self.lru_large[self.part[s]].push(entry)

    def touch(self, s: int, pids: Sequence[int], now: int) -> None:
        """Give evictable pages the eviction key `now`, as if last used now.

        Pages a request let go of early but that serve the same reuse point
        as the pages it holds to the end get the same time (balanced rule), so
        a cached prefix is evicted as one unit. Used pages are left alone:
        their last user stamps them.
        """
        if not self.grouped:
            self.group += 1
        sp = self.specs[s]
        ref, hashes, last, k = sp.ref, sp.hash, sp.last, sp.k
        for pid in pids:
            if ref[pid] or hashes[pid] is None or last[pid] >= now:
                continue
            last[pid] = now
            sp.stamp[pid] += 1
            if k > 1:
                sp.lru.push((now, -sp.plen[pid], pid, sp.stamp[pid]))
            lp = pid // k
            if self.ltime[lp] < now or k == 1:
                self.ltime[lp], self.lplen[lp] = now, sp.plen[pid]
            elif self.ltime[lp] == now and sp.plen[pid] < self.lplen[lp]:
                self.lplen[lp] = sp.plen[pid]
            else:
                continue
            if self.used[lp] == 0:  # re-queue the unused large page under its new key
                self.lstamp[lp] += 1
                self.lgroup[lp] = self.group
                entry = (now, self.group, -self.lplen[lp], next(self._pushes), lp,
                         self.lstamp[lp])
                self.lru_large[self.part[s]].push(entry)

    def demote(self, s: int, pids: Sequence[int]) -> None:
        """Give unused cached pages the key DEAD: they go before every page that can hit.
        Used pages are left alone."""
        if not self.grouped:
            self.group += 1
        sp = self.specs[s]
        ref, hashes, last, plen, k = sp.ref, sp.hash, sp.last, sp.plen, sp.k
        changed = {}
        for pid in pids:
            if ref[pid] or hashes[pid] is None or last[pid] == DEAD:
                continue
            last[pid] = DEAD
            sp.stamp[pid] += 1
            if k > 1:
                sp.lru.push((DEAD, -plen[pid], pid, sp.stamp[pid]))
            changed[pid // k] = None
        for lp in changed:
            if self.used[lp]:
                continue
            t, n = _large_key(sp, lp)
            if t is None or (t, n) == (self.ltime[lp], self.lplen[lp]):
                continue
            self.ltime[lp], self.lplen[lp] = t, n
            self.lstamp[lp] += 1
            self.lgroup[lp] = self.group
            entry = (t, self.group, -n, next(self._pushes), lp, self.lstamp[lp])
            self.lru_large[self.part[s]].push(entry)

    def evict_before(self, key: int) -> int:
        """Evict every unused large page whose eviction key is below `key` onto the free
        list (cache idle that long, whose memory is to go back); returns the cached
        pages that went."""
        before = sum(len(sp.cached) for sp in self.specs)
        lstamp, used, owner = self.lstamp, self.used, self.owner
        for queue, free in zip(self.lru_large, self.free_large):
            while queue and queue.peek()[0] < key:
                *_, lp, stamp = queue.pop()
                if stamp == lstamp[lp] and used[lp] == 0 and owner[lp] >= 0:
                    self._evict_large(lp)
                    free.append(lp)
        return before - sum(len(sp.cached) for sp in self.specs)

    def withdraw(self, n: int) -> list[int]:
        """Take up to n free large pages out of use (lent to a shared ceiling, their memory
        given back): the longest free first, which are the least likely to hold memory."""
        out: list[int] = []
        for free in self.free_large:
            k = min(n - len(out), len(free))
            out += free[:k]
            del free[:k]
        return out

    def deposit(self, pages: Sequence[int]) -> None:
        """Large pages withdrawn earlier come back free."""
        nparts = len(self.free_large)
        for lp in pages:
            if self.owner[lp] >= 0:
                raise ValueError(f"large page {lp} is in use, not withdrawn")
            self.free_large[lp % nparts].append(lp)

    def free_large_pages(self) -> list[int]:
        """Every large page no spec owns: they hold no KV."""
        return [lp for free in self.free_large for lp in free]

    def evict(self, m: int) -> int:
        """Evict up to m unused large pages per partition, least recently used first, onto
        the free list (a swap-out ahead of need); returns how many cached pages went."""
        before = sum(len(sp.cached) for sp in self.specs)
        for p, free in enumerate(self.free_large):
            free.extend(self._evict_lru_large(p, m))
        return before - sum(len(sp.cached) for sp in self.specs)

    def discard(self, s: int, pids: Sequence[int], now: int) -> None:
        """Forget the cached KV of pages (a delete): unused ones become empty, used ones
        stay with their users and become empty when freed."""
        sp = self.specs[s]
        for pid in pids:
            if sp.hash[pid] is None:
                continue
            unused = sp.ref[pid] == 0
            if unused:
                self.claim(s, [pid])
            self._uncache(sp, pid)
            if unused:
                self.free(s, [pid], now)

    def forget_request(self, req: RequestId) -> None:
        """The request is gone: its large pages' empty pages serve anyone now."""
        for sp in self.specs:
            sp.by_req.pop(req, None)

    # ---------------------------------------------------------------- caching

    def insert(self, s: int, pid: int, h: Hashable, plen: int) -> bool:
        """Publish a used page's KV under block hash `h`.

        An unused page caching `h` already is replaced: it was left by an
        earlier request past what a lookup could serve (a prefix whose other
        layer types were evicted), and keeping it would keep its old eviction
        key inside a prefix now in use. Returns False when a used page caches
        `h` (this page then stays private and becomes empty when freed).
        """
        sp = self.specs[s]
        if sp.hash[pid] is not None:
            return False
        old = sp.cached.get(h)
        if old is not None:
            if sp.ref[old]:
                return False
            self.discard(s, [old], DEAD)
        sp.cached[h] = pid
        sp.hash[pid] = h
        sp.plen[pid] = plen
        return True

    def _uncache(self, sp: SpecPages, pid: int) -> None:
        del sp.cached[sp.hash[pid]]
        sp.hash[pid] = None
        sp.stamp[pid] += 1


def _large_key(sp: SpecPages, lp: int) -> tuple[int | None, int]:
    """A large page's eviction key from its cached pages: the latest last use, and the
    shortest prefix among the pages of that time (None: no cached page)."""
    hashes, last, plen = sp.hash, sp.last, sp.plen
    t, n = None, 0
    for p in range(lp * sp.k, (lp + 1) * sp.k):
        if hashes[p] is not None:
            u = last[p]
            if t is None or u > t or u == t and plen[p] < n:
                t, n = u, plen[p]
    return t, n
