"""The two-level allocator's five-step order, request awareness and out-of-memory paths."""

import pytest
from invariants import check_invariants

from kvserve.memory import KVCacheManager, KVSpec, LayerKind, OutOfPages, make_layout
from kvserve.memory.allocator import EVICTABLE, TwoLevelAllocator

# Large page = LCM(48, 64) = 192 B = 4 pages of "a" = 3 pages of "b".
A = KVSpec("a", LayerKind.FULL, 3, 16)
B = KVSpec("b", LayerKind.FULL, 4, 16)
LAYOUT = make_layout([A, B], tokens_per_page=1)


def make(num_large=4, partitioned=False):
    return TwoLevelAllocator(LAYOUT, num_large, partitioned)


def cache(alloc, s, pids, now, key):
    """Publish pages under fresh hashes and drop the user's reference."""
    for i, pid in enumerate(pids):
        assert alloc.insert(s, pid, (key, i), i + 1)
    alloc.free(s, pids, now)


def test_layout_ratios():
    assert LAYOUT.large_page_bytes == 192 and LAYOUT.pages_per_large == (4, 3)


def test_request_aware_pages_share_large_pages_per_request():
    alloc = make()
    got = {"r1": [], "r2": []}
    for _ in range(4):  # interleaved single-page allocations
        for r in got:
            got[r] += alloc.allocate(r, [(0, 1)])[0]
    larges = {r: {p // 4 for p in pids} for r, pids in got.items()}
    assert all(len(v) == 1 for v in larges.values())
    assert larges["r1"] != larges["r2"]
    alloc.free(0, got["r1"], 1)  # r1 done: its whole large page goes back
    assert alloc.num_free_large() == 3
    check_invariants_alloc(alloc)


def test_step1_own_empty_pages_before_new_large_page():
    alloc = make()
    first = alloc.allocate("r", [(0, 1)])[0]
    second = alloc.allocate("r", [(0, 3)])[0]
    assert {p // 4 for p in first + second} == {first[0] // 4}
    assert alloc.num_free_large() == 3


def test_a_finished_requests_empty_pages_go_to_the_next_small_allocation():
    """A request that cached 1 page of a 4-page large page left 3 empty ones beside it.
    The next request taking at most 3 pages adopts that large page rather than a free
    one (steps 2 and 3 would leave the 3 empty until the cached page is evicted); one
    taking more than the large page has empty gets a fresh one."""
    alloc = make()
    done = alloc.allocate("done", [(0, 1)])[0]
    alloc.forget_request("done")
    cache(alloc, 0, done, now=1, key="q")
    got = alloc.allocate("next", [(0, 2)])[0]
    assert {p // 4 for p in got} == {done[0] // 4}
    assert alloc.num_free_large() == 3 and alloc.lookup(0, ("q", 0)) == done[0]
    more = alloc.allocate("big", [(0, 3)])[0]  # one empty page left there: too few
    assert {p // 4 for p in more} != {done[0] // 4}
    alloc.free(0, got, 2)  # the adopted large page's pages leave with their own key
    check_invariants_alloc(alloc)


def test_step3_evicts_least_recently_used_large_page():
    alloc = make(num_large=3)
    old = alloc.allocate("x", [(0, 4)])[0]
    new = alloc.allocate("y", [(0, 4)])[0]
    cache(alloc, 0, old, now=1, key="old")
    cache(alloc, 0, new, now=5, key="new")
    busy = alloc.allocate("z", [(1, 2)])[0]  # the last free large page
    assert alloc.num_free_large() == 0
    got = alloc.allocate("w", [(1, 2)])[0]  # spec b takes a whole large page of spec a
    assert {p // 3 for p in got} == {old[0] // 4}
    assert alloc.lookup(0, ("old", 0)) is None and alloc.lookup(0, ("new", 0)) is not None
    assert busy


def test_step4_takes_other_requests_empty_pages_when_no_large_page_left():
    alloc = make(num_large=2)
    mine = alloc.allocate("r1", [(0, 1)])[0]
    alloc.allocate("r2", [(1, 2)])  # the other large page, fully used
    got = alloc.allocate("r3", [(0, 3)])[0]
    assert {p // 4 for p in got} == {mine[0] // 4}


def test_step5_evicts_small_pages_lru_then_longest_prefix():
    alloc = make(num_large=2)
    pages = alloc.allocate("r1", [(0, 4)])[0]
    alloc.allocate("r2", [(1, 2)])
    keep = pages[0]
    for pid, (t, plen) in zip(pages[1:], [(3, 1), (2, 1), (2, 7)]):
        alloc.insert(0, pid, ("h", pid), plen)
        alloc.free(0, [pid], t)
    # The large page still holds a used page, so only small pages can go:
    # time 2 first, and among time 2 the longer prefix (7) first.
    assert alloc.allocate("r3", [(0, 1)])[0] == [pages[3]]
    assert alloc.allocate("r3", [(0, 1)])[0] == [pages[2]]
    assert alloc.allocate("r3", [(0, 1)])[0] == [pages[1]]
    assert keep not in alloc.specs[0].cached.values()


def test_claimed_pages_are_not_evicted():
    alloc = make(num_large=1)
    pages = alloc.allocate("r", [(0, 4)])[0]
    cache(alloc, 0, pages, now=1, key="k")
    alloc.claim(0, pages[:2])
    got = alloc.allocate("s", [(0, 2)])[0]
    assert set(got) == set(pages[2:])
    assert alloc.specs[0].state[pages[0]] != EVICTABLE
    with pytest.raises(OutOfPages):
        alloc.allocate("s", [(0, 1)])


@pytest.mark.parametrize("needs", [[(0, 17)], [(1, 10)], [(0, 9), (1, 5)]])
def test_out_of_pages_changes_nothing(needs):
    alloc = make()
    alloc.allocate("r", [(0, 3)])
    before = snapshot(alloc)
    with pytest.raises(OutOfPages):
        alloc.allocate("s", needs)
    assert snapshot(alloc) == before


def test_tight_mode_fills_holes_so_a_mixed_allocation_fits():
    # One free large page left plus 3 holes in spec a's page: a needs 3, b needs 2.
    alloc = make(num_large=2)
    alloc.allocate("r", [(0, 1)])
    a, b = alloc.allocate("s", [(0, 3), (1, 2)])
    assert len(a) == 3 and len(b) == 2 and alloc.num_free_large() == 0
    check_invariants_alloc(alloc)


def test_static_partition_never_lends_pages():
    alloc = make(num_large=4, partitioned=True)
    alloc.allocate("r", [(0, 8)])  # spec a's two large pages
    with pytest.raises(OutOfPages):
        alloc.allocate("r", [(0, 1)])
    assert len(alloc.allocate("r", [(1, 6)])[0]) == 6


def test_double_free_is_an_error():
    alloc = make()
    (pids,) = alloc.allocate("r", [(0, 1)])
    alloc.free(0, pids, 1)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(0, pids, 1)


def snapshot(alloc):
    return (
        [(list(sp.ref), bytes(sp.state), dict(sp.cached), sp.n_used, sp.n_empty, sp.n_evictable)
         for sp in alloc.specs],
        list(alloc.owner), list(alloc.used), list(alloc.emask),
        [sorted(f) for f in alloc.free_large],
    )


def check_invariants_alloc(alloc):
    """Bytes conservation (pages here belong to no request tables)."""
    held = sum((sp.n_used + sp.n_evictable + sp.n_empty) * pb
               for sp, pb in zip(alloc.specs, alloc.layout.page_bytes))
    pool = alloc.num_large * alloc.layout.large_page_bytes
    assert held + alloc.num_free_large() * alloc.layout.large_page_bytes == pool


def test_manager_invariants_after_oom():
    mgr = KVCacheManager([A, B], pool_bytes=192 * 2, tokens_per_page=1)
    mgr.add_request("r", list(range(20)))
    mgr.lookup("r")
    assert not mgr.allocate_slots("r", 20)
    assert mgr.allocate_slots("r", 2)
    check_invariants(mgr)


def test_single_type_pool_fast_paths_run_out_cleanly():
    # One spec: a small page is a whole large page, the path vLLM's BlockPool covers.
    alloc = TwoLevelAllocator(make_layout([A], tokens_per_page=1), 3)
    got = [alloc.allocate("r", [(0, 1)])[0] for _ in range(2)] + [alloc.allocate("s", [(0, 1)])[0]]
    assert sorted(p for g in got for p in g) == [0, 1, 2]
    for needs in ([(0, 1)], [(0, 2)]):
        before = snapshot(alloc)
        with pytest.raises(OutOfPages):
            alloc.allocate("t", needs)
        assert snapshot(alloc) == before
    alloc.free(0, got[0], 1)
    assert alloc.allocate("t", [(0, 1)])[0] == got[0]
    with pytest.raises(ValueError, match="double free"):
        alloc.free(0, got[1] + got[1], 2)
    check_invariants_alloc(alloc)


def test_request_own_page_path_runs_out_cleanly():
    # "r" holds 1 of 4 pages of the only large page; its own 3 pages come first, then none.
    alloc = make(num_large=1)
    first = alloc.allocate("r", [(0, 1)])[0]
    more = [alloc.allocate("r", [(0, 1)])[0][0] for _ in range(3)]
    assert sorted(first + more) == [0, 1, 2, 3]
    before = snapshot(alloc)
    with pytest.raises(OutOfPages):
        alloc.allocate("r", [(0, 1)])
    assert snapshot(alloc) == before


def test_supply_below_counts_free_and_unused_large_pages_under_a_key():
    alloc = make(num_large=4)
    old = alloc.allocate("x", [(0, 4)])[0]
    new = alloc.allocate("y", [(0, 4)])[0]
    cache(alloc, 0, old, now=1, key="old")
    cache(alloc, 0, new, now=5, key="new")
    assert alloc.allocate("z", [(1, 1)])[0]  # a large page in use: never supply
    assert alloc.supply_below(0) == [1]  # the free large page only
    assert alloc.supply_below(3) == [2]  # and the page cached at step 1
    assert alloc.supply_below(10) == [3]
    check_invariants_alloc(alloc)


def test_a_block_computed_again_replaces_its_unused_cached_page():
    # An unused cached copy left past what lookups could serve would keep its old
    # eviction key inside a prefix in use again: the new page takes its place.
    alloc = make(num_large=2)
    old = alloc.allocate("r", [(0, 2)])[0]
    cache(alloc, 0, old, now=1, key="k")
    new = alloc.allocate("s", [(0, 1)])[0]
    assert alloc.insert(0, new[0], ("k", 0), 1)
    sp = alloc.specs[0]
    assert sp.cached[("k", 0)] == new[0] and sp.hash[old[0]] is None
    alloc.free(0, new, now=5)
    assert sp.last[new[0]] == 5 and sp.cached[("k", 1)] == old[1]
    # A cached page in use stays: the new one remains private.
    alloc.claim(0, new)
    other = alloc.allocate("t", [(0, 1)])[0]
    assert not alloc.insert(0, other[0], ("k", 0), 1)
    assert sp.cached[("k", 0)] == new[0] and sp.hash[other[0]] is None
    alloc.free(0, other + new, now=6)
