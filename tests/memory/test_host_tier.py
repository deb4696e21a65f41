"""The host tier: evicted pages kept in host memory, loaded back on a hit.

The state machine of test_properties runs with a host tier: every copy the
memory core logs is played on the fake page contents (device and host), so a
hit served from the host tier is checked slot by slot against the request's
own tokens, as a device hit is.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from test_properties import SPECS, MemoryCore, T

from kvserve.memory import KVCacheManager, KVSpec, LayerKind, OutOfPages
from kvserve.memory.allocator import DEAD
from kvserve.memory.baselines import policy_layout
from kvserve.memory.host_tier import DUPLICATE as HOST_DUPLICATE
from kvserve.memory.host_tier import HostTier
from kvserve.memory.prefix_cache import extend_block_hashes


class Tiers:
    """Fake bytes of both tiers: (spec, page) -> content, moved by the logged copies."""

    def __init__(self, device: dict) -> None:
        self.device, self.host = device, {}
        self.calls = 0

    def copy(self, to_host: bool, s: int, src: list[int], dst: list[int]) -> None:
        assert len(src) == len(dst) == len(set(dst)), "a run writes a page twice"
        self.calls += 1
        frm, to = (self.device, self.host) if to_host else (self.host, self.device)
        for a, b in zip(src, dst):
            data = frm.get((s, a))  # (the examples below write no content)
            to[(s, b)] = dict(data) if isinstance(data, dict) else data


def check_host(mgr: KVCacheManager) -> None:
    """After a flush: nothing pinned, bytes conserved, the index names its pages."""
    host = mgr.host
    alloc = host.alloc
    assert not host.log and not host.pinned and not host.ahead
    held = sum((sp.n_used + sp.n_evictable + sp.n_empty) * pb
               for sp, pb in zip(alloc.specs, mgr.layout.page_bytes))
    assert held + alloc.num_free_large() * mgr.layout.large_page_bytes == host.pool_bytes
    for s, sp in enumerate(alloc.specs):
        assert sp.n_used == 0, "a host page stayed pinned after the flush"
        assert all(sp.hash[pid] == h for h, pid in sp.cached.items())
        assert Counter(sp.cached.values()).most_common(1)[0][1] == 1 if sp.cached else True
        assert not mgr.layout.specs[s].kind.over_images or not sp.cached, "image pages in host"


class TieredCore(MemoryCore):
    @initialize(policy=st.sampled_from(["jenga", "jenga", "static"]),
                large_pages=st.integers(8, 24), host_pages=st.integers(7, 40))
    def setup(self, policy, large_pages, host_pages):
        probe = policy_layout(policy, self.specs, T)[0]
        large = probe.large_page_bytes
        self.begin(KVCacheManager(self.specs, large * large_pages, tokens_per_page=T,
                                  policy=policy, host_bytes=large * host_pages))
        self.tiers = Tiers(self.content)

    def flush(self):
        self.mgr.flush(self.tiers.copy)
        check_host(self.mgr)

    def check_hit(self, rid, hit):
        self.flush()  # the engine flushes before the forward reads the hit
        super().check_hit(rid, hit)

    def write(self, rid, lo, hi):
        self.flush()  # ... and before it overwrites pages just evicted
        super().write(rid, lo, hi)

    @rule(n=st.integers(1, 40))
    def swap_out(self, n):
        out = self.mgr.swap_out(n)
        assert out >= 0
        self.flush()

    @precondition(lambda self: not self.mgr.host.log and not self.mgr.host.ahead)
    @invariant()
    def host_is_consistent(self):
        check_host(self.mgr)

    @invariant()
    def host_hits_are_hits(self):
        st_ = self.mgr.stats()
        assert st_.host.hit_tokens <= st_.hit_tokens


TieredCore.TestCase.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTieredCore = TieredCore.TestCase


class TieredText(TieredCore):
    """Text specs only: whole prefixes reach the host tier more often, so loads
    (and loads racing evictions in one step) are common."""

    specs = [s for s in SPECS if s.kind in (LayerKind.FULL, LayerKind.SLIDING)]

    @initialize(policy=st.sampled_from(["jenga", "static"]),
                large_pages=st.integers(4, 10), host_pages=st.integers(4, 30))
    def setup(self, policy, large_pages, host_pages):
        TieredCore.setup(self, policy, large_pages, host_pages)


TieredText.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTieredText = TieredText.TestCase


# ------------------------------------------------------------------- examples

FULL = KVSpec("full", LayerKind.FULL, 1, 64)
SWA = KVSpec("swa", LayerKind.SLIDING, 1, 64, window=16)


def run(mgr: KVCacheManager, rid, tokens, tiers: Tiers | None = None) -> int:
    """Admit, prefill and finish one request; returns its hit."""
    mgr.begin_step()
    mgr.add_request(rid, tokens)
    hit = mgr.lookup(rid)
    assert mgr.allocate_slots(rid, len(tokens) - hit)
    if tiers is not None:
        mgr.flush(tiers.copy)
    mgr.advance(rid, len(tokens) - hit)
    mgr.finish(rid)
    return hit


def doc(i: int, n: int = 64) -> list[int]:
    return [1000 * (i + 1) + j for j in range(n)]


def small_pool(pages: int, host_pages: int, specs=(FULL,)) -> KVCacheManager:
    probe = policy_layout("jenga", specs, 8)[0]
    large = probe.large_page_bytes
    return KVCacheManager(specs, pages * large, tokens_per_page=8, host_bytes=host_pages * large)


def test_an_evicted_prefix_hits_from_the_host_tier():
    mgr = small_pool(pages=20, host_pages=64, specs=(FULL, SWA))
    tiers = Tiers({})
    run(mgr, "a", doc(0) + [1], tiers)
    for i in range(1, 4):  # push doc 0 out of the device pool
        run(mgr, i, doc(i) + [1], tiers)
    assert mgr.stats().host.pages_out > 0
    hit = run(mgr, "b", doc(0) + [2, 3], tiers)
    st_ = mgr.stats()
    assert hit == 64 and 0 < st_.host.hit_tokens <= hit
    assert st_.host.pages_in > 0 and tiers.calls > 0


def test_without_a_host_tier_the_same_trace_misses():
    probe = policy_layout("jenga", (FULL, SWA), 8)[0]
    mgr = KVCacheManager((FULL, SWA), 20 * probe.large_page_bytes, tokens_per_page=8)
    for i in range(4):
        run(mgr, i, doc(i) + [1])
    assert run(mgr, "b", doc(0) + [2, 3]) < 64


def block_keys(i: int) -> set:
    hashes: list[int] = []
    extend_block_hashes(hashes, doc(i) + [1], 8)
    return set(hashes)


def test_a_full_host_tier_drops_its_oldest_pages_only():
    # The device holds one document (9 pages); the host two (16 pages).
    mgr = small_pool(pages=9, host_pages=16)
    tiers = Tiers({})
    for i in range(12):
        run(mgr, i, doc(i) + [1], tiers)
    assert set(mgr.host.cached(0)) == block_keys(9) | block_keys(10)
    assert set(mgr.alloc.specs[0].cached) == block_keys(11)
    assert mgr.stats().host.spec_bytes == {"full": 16 * FULL.page_bytes(8)}


def test_dead_pages_are_not_written_back():
    host = HostTier(small_pool(pages=4, host_pages=8).layout, 8)
    assert not host.store(0, 0, "h", 8, DEAD) and host.pages_out == 0 and not host.log
    assert host.store(0, 0, "h", 8, 5) and host.pages_out == 1 and host.log


def test_a_load_that_does_not_fit_changes_nothing():
    mgr = small_pool(pages=10, host_pages=64)
    tiers = Tiers({})
    for i in range(4):
        run(mgr, i, doc(i) + [1], tiers)
    # fill the device with running requests so nothing can be evicted for a load
    mgr.begin_step()
    running = []
    for i in range(10, 30):
        mgr.add_request(i, doc(i) + [1])
        mgr.lookup(i)
        if not mgr.allocate_slots(i, 65):
            mgr.abort(i)
            break
        running.append(i)
    mgr.flush(tiers.copy)
    assert running and block_keys(0) <= set(mgr.host.cached(0))
    before = (_alloc_state(mgr.alloc), _alloc_state(mgr.host.alloc))
    mgr.add_request("late", doc(0) + [7])
    assert mgr.lookup("late") == 0
    mgr.abort("late")
    mgr.flush(tiers.copy)
    assert (_alloc_state(mgr.alloc), _alloc_state(mgr.host.alloc)) == before


def _alloc_state(alloc):
    specs = [(list(sp.ref), list(sp.hash), dict(sp.cached), list(sp.last)) for sp in alloc.specs]
    return specs, sorted(sum(alloc.free_large, []))


def test_worth_loading_can_refuse_and_is_told_the_bytes():
    seen = []

    def refuse(n, have, could, nbytes):
        seen.append((n, have, could, nbytes))
        return False

    probe = policy_layout("jenga", (FULL,), 8)[0]
    large = probe.large_page_bytes
    mgr = KVCacheManager((FULL,), 9 * large, tokens_per_page=8, host_bytes=64 * large,
                         worth_loading=refuse)
    tiers = Tiers({})
    for i in range(4):
        run(mgr, i, doc(i) + [1], tiers)
    assert run(mgr, "b", doc(0) + [2], tiers) == 0
    n, have, could, nbytes = seen[-1]
    assert (n, have, could) == (65, 0, 64) and nbytes == 8 * FULL.page_bytes(8)


def test_swap_out_moves_lru_pages_to_the_host():
    mgr = small_pool(pages=32, host_pages=64)
    tiers = Tiers({})
    for i in range(3):
        run(mgr, i, doc(i) + [1], tiers)
    cached = set(mgr.alloc.specs[0].cached)
    moved = mgr.swap_out(8)
    mgr.flush(tiers.copy)
    left = cached - set(mgr.alloc.specs[0].cached)
    assert moved >= 8 and len(left) == moved and left <= set(mgr.host.cached(0))
    assert run(mgr, "b", doc(0) + [5], tiers) == 64  # the oldest doc, now from the host


def test_host_tier_needs_a_large_page():
    with pytest.raises(ValueError, match="host tier"):
        KVCacheManager((FULL,), 1 << 20, tokens_per_page=8, host_bytes=10)


def test_out_of_pages_is_still_raised_by_the_host_allocator():
    probe = policy_layout("jenga", (FULL,), 8)[0]
    host = HostTier(probe, 1)
    k = probe.pages_per_large[0]
    host.alloc.allocate("x", [(0, k)])  # pinned by someone: nothing left to evict
    assert not host.store(0, 0, "h", 8, 5) and host.dropped == 1
    with pytest.raises(OutOfPages):
        host.alloc.allocate("y", [(0, 1)])


def test_a_page_evicted_while_written_behind_keeps_its_device_key():
    """Write-behind copies are duplicates (lowest key) until the device evicts the page;
    an eviction while the copy is still under way gives it the device key at once."""
    mgr = small_pool(pages=9, host_pages=32)
    assert mgr.write_behind
    tiers = Tiers({})
    run(mgr, 0, doc(0) + [1], tiers)  # finish queues doc 0's pages behind
    assert len(mgr.host.ahead) == 8
    mgr.begin_step()
    mgr.add_request(1, doc(1) + [1])
    mgr.lookup(1)
    assert mgr.allocate_slots(1, 65)  # evicts doc 0 while its copies are queued
    mgr.flush(tiers.copy)
    sp = mgr.host.alloc.specs[0]
    keys = {sp.last[hp] for h, hp in sp.cached.items() if h in block_keys(0)}
    assert len(keys) == 1 and keys.pop() > HOST_DUPLICATE
    assert mgr.host.pages_out == 8  # written once, behind; the eviction copied nothing
