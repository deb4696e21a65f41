"""Several elastic KV pools under one ceiling (KVShare), over random interleavings.

Two memory cores of different layouts (a Gemma-like full + sliding model and a
Llama-like full-attention one) run requests while the share moves large pages
between them. Pages are really written through the pools, so what the OS holds
(the memfds' extents) is checked against the grants, not only the books.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from invariants import check_invariants

from kvserve.memory import NO_PAGE, KVCacheManager, KVSpec, LayerKind
from kvserve.physical.pool import KVPool
from kvserve.physical.share import KVShare

T = 16
MODELS = [
    [KVSpec("full", LayerKind.FULL, 1, 1024), KVSpec("swa", LayerKind.SLIDING, 5, 1024,
                                                      window=48)],
    [KVSpec("full", LayerKind.FULL, 3, 2048)],
]
STEP_TOKENS = 32


def member_core(specs: list[KVSpec], nbytes: int) -> tuple[KVCacheManager, KVPool]:
    kv = KVCacheManager(specs, nbytes, tokens_per_page=T)
    return kv, KVPool(kv.layout, kv.num_large_pages, {})


class Shared(RuleBasedStateMachine):
    @initialize(ceiling_large=st.integers(6, 40), own_large=st.integers(4, 40))
    def setup(self, ceiling_large, own_large):
        self.cores = []
        for specs in MODELS:
            probe = KVCacheManager(specs, 1 << 30, tokens_per_page=T).layout.large_page_bytes
            self.cores.append(member_core(specs, own_large * probe))
        unit = max(kv.layout.large_page_bytes for kv, _ in self.cores)
        self.share = KVShare(ceiling_large * unit)
        self.members = [self.share.join(kv.alloc, pool, STEP_TOKENS * sum(kv.layout.page_bytes)
                                        // T) for kv, pool in self.cores]
        self.next_id = 0

    def running(self, m: int) -> list:
        return sorted(self.cores[m][0].reqs)

    @rule(m=st.integers(0, 1), base=st.integers(0, 2), n=st.integers(2, 120))
    def arrive(self, m, base, n):
        kv = self.cores[m][0]
        rid = self.next_id
        self.next_id += 1
        kv.add_request(rid, [(base * 31 + i) % 97 + 1 for i in range(n)])
        kv.lookup(rid)

    @precondition(lambda self: any(self.cores[m][0].reqs for m in range(2)))
    @rule(m=st.integers(0, 1), pick=st.integers(0, 1 << 16), chunk=st.integers(1, STEP_TOKENS))
    def step(self, m, pick, chunk):
        kv, pool = self.cores[m]
        if not kv.reqs:
            return
        self.share.draw(self.members[m])
        rid = self.running(m)[pick % len(kv.reqs)]
        r = kv.reqs[rid]
        kv.begin_step()
        c = r.num_computed
        n = min(chunk, len(r.tokens) - c) if c < len(r.tokens) else 0
        if n == 0:
            r.tokens.append(7)
            n = 1
        if kv.allocate_slots(rid, n):
            for s in range(len(kv.layout.specs)):  # write the pages, as the runner would
                rows = pool.pages(s)
                for pid in set(r.tables[s][c // T:(c + n - 1) // T + 1]) - {NO_PAGE}:
                    rows[pid, ::4096].fill_(1)
            kv.advance(rid, n)
        self.share.settle(self.members[m])

    @precondition(lambda self: any(self.cores[m][0].reqs for m in range(2)))
    @rule(m=st.integers(0, 1), pick=st.integers(0, 1 << 16))
    def finish(self, m, pick):
        kv = self.cores[m][0]
        if kv.reqs:
            kv.begin_step()
            kv.finish(self.running(m)[pick % len(kv.reqs)])
            self.share.settle(self.members[m])

    @rule(m=st.integers(0, 1))
    def idle(self, m):
        kv, pool = self.cores[m]
        pool.give_back(kv.idle_pages(kv.now + 1))

    @invariant()
    def grants_stay_under_the_ceiling(self):
        assert self.share.granted_bytes() <= self.share.ceiling
        held = sum(pool.physical_bytes() for _, pool in self.cores)
        assert held <= self.share.ceiling

    @invariant()
    def lent_pages_are_out_of_use_and_hold_no_memory(self):
        for member, (kv, pool) in zip(self.members, self.cores):
            check_invariants(kv, len(member.lent))
            lent = set(member.lent)
            assert len(lent) == len(member.lent)
            assert not lent & set(kv.alloc.free_large_pages())
            assert all(kv.alloc.owner[lp] < 0 for lp in lent)
            assert not lent & pool.memory.written(kv.layout.large_page_bytes)


Shared.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
TestShared = Shared.TestCase


def test_memory_moves_to_the_member_that_needs_it():
    cores = [member_core(specs, 64 << 20) for specs in MODELS[::-1]]  # a: 6 KiB a token
    share = KVShare(16 << 20)
    a, b = (share.join(kv.alloc, pool, 1 << 20) for kv, pool in cores)
    (kva, poola), (kvb, _) = cores
    assert share.granted_bytes() == 0 and kva.alloc.num_free_large() == 0
    share.draw(a)
    kva.add_request("x", [t % 97 + 1 for t in range(4000)])
    kva.lookup("x")
    while kva.allocate_slots("x", 16):  # a grows until the ceiling stops it
        kva.advance("x", 16)
        share.draw(a)
    assert share.granted_bytes() > (16 << 20) - 2 * kva.layout.large_page_bytes
    assert share.draw(b) == 0  # nothing free anywhere: b waits
    kva.finish("x")
    kva.begin_step()
    poola.give_back(kva.idle_pages(kva.now + 1))  # a's cache goes idle...
    assert share.draw(b) > 0  # ...and its free pages move to b, punched on the way
    assert share.granted_bytes() <= 16 << 20
    assert kvb.alloc.num_free_large() == b.watermark


def test_a_share_needs_elastic_pools_that_hold_nothing_yet():
    kv, pool = member_core(MODELS[1], 8 << 20)
    share = KVShare(8 << 20)
    kv.add_request("x", [1, 2, 3])
    kv.lookup("x")
    kv.allocate_slots("x", 3)
    with pytest.raises(ValueError, match="before it holds anything"):
        share.join(kv.alloc, pool, 1 << 20)
    with pytest.raises(ValueError, match="> 0 bytes"):
        KVShare(0)


def test_an_idle_members_cache_gives_way_to_a_busy_one():
    cores = [member_core(specs, 64 << 20) for specs in MODELS[::-1]]
    (kva, poola), (kvb, poolb) = cores
    share = KVShare(16 << 20)
    flushed = []
    a = share.join(kva.alloc, poola, 1 << 20, flush=lambda: flushed.append(1))
    b = share.join(kvb.alloc, poolb, 1 << 20)

    def run(kv, member, rid, n):
        kv.add_request(rid, [(t * 7) % 89 + 1 for t in range(n)])
        kv.lookup(rid)
        while kv.reqs[rid].num_computed < n:
            share.draw(member)
            if not kv.allocate_slots(rid, min(16, n - kv.reqs[rid].num_computed)):
                return False
            kv.advance(rid, min(16, n - kv.reqs[rid].num_computed))
        kv.finish(rid)
        return True

    assert run(kva, a, "x", 2000)  # a's prefix stays cached: 12 MiB of the 16
    cached = kva.stats().evictable
    assert cached > 8 << 20 and share.granted_bytes() > 12 << 20
    room = share.ceiling - share.granted_bytes()
    assert run(kvb, b, "y", 4000)  # b needs more than is free: a's cache makes way
    assert b.granted_bytes() > room
    assert kva.stats().evictable < cached and flushed  # copies out before the punch
    assert share.granted_bytes() <= 16 << 20
    assert not set(a.lent) & poola.memory.written(kva.layout.large_page_bytes)
