"""The Jenga paper's worked examples (Fig. 6, 10, 11) as unit tests."""

import pytest

from kvserve.memory import ImageInput, KVCacheManager, KVSpec, LayerKind, make_layout
from kvserve.memory.layer_types import make_spec_manager

# Fig. 6: 2 cross-attention layers (image tokens) and 3 self-attention layers
# (text tokens), 128 B per token per layer, one token per page.
CROSS = KVSpec("cross", LayerKind.CROSS, 2, 128)
SELF = KVSpec("self", LayerKind.FULL, 3, 128)


def test_fig6_lcm_layout():
    layout = make_layout([CROSS, SELF], tokens_per_page=1)
    assert layout.page_bytes == (256, 384)
    assert layout.large_page_bytes == 768
    assert layout.pages_per_large == (3, 2)


def test_fig6_two_level_allocation():
    # <IMG><IMG><IMG><IMG> Hello World: 4 image pages of 256 B, 2 text pages of 384 B.
    mgr = KVCacheManager([CROSS, SELF], pool_bytes=768 * 8, tokens_per_page=1)
    tokens = [101, 102]
    mgr.add_request("r", tokens, [ImageInput("img", offset=0, num_tokens=4)])
    assert mgr.lookup("r") == 0
    assert mgr.allocate_slots("r", 2)
    tables = mgr.block_tables("r")
    assert len(tables["cross"]) == 4 and len(tables["self"]) == 2
    # Image pages fill two large pages (3 + 1), text pages one.
    cross_large = {p // 3 for p in tables["cross"]}
    self_large = {p // 2 for p in tables["self"]}
    assert len(cross_large) == 2 and len(self_large) == 1
    assert not cross_large & self_large  # a large page belongs to one type at a time
    stats = mgr.stats()
    assert mgr.pool_bytes - stats.free == 3 * 768
    by = {s.name: s for s in stats.specs}
    assert by["cross"].empty == 2 * 256  # two unused image pages in the second large page
    assert by["self"].empty == 0
    assert stats.ideal == 4 * 256 + 2 * 384


def test_unreasonable_lcm_names_specs():
    a = KVSpec("a", LayerKind.FULL, 1, 1009)
    b = KVSpec("b", LayerKind.FULL, 1, 1013)
    with pytest.raises(ValueError, match=r"a=1009 B.*b=1013 B"):
        make_layout([a, b], tokens_per_page=1)


def _run_fig10():
    """Request 1 [A B C D] -> E F, then request 2 [A B C D G] -> H, window 2."""
    full = KVSpec("full", LayerKind.FULL, 1, 64)
    swa = KVSpec("swa", LayerKind.SLIDING, 1, 64, window=2)
    mgr = KVCacheManager([full, swa], pool_bytes=64 * 32, tokens_per_page=1)
    # The paper keeps generated tokens' pages by recency: kvserve does once some request
    # has continued a finished one (before that they go first: test_reuse.py).
    mgr.reuse.continued = 1
    A, B, C, D, E, F, G, H = range(1, 9)
    r1 = [A, B, C, D]
    mgr.begin_step()  # step 1: request 1's prefill ABCD -> E
    mgr.add_request(1, r1)
    assert mgr.lookup(1) == 0
    assert mgr.allocate_slots(1, 4)
    mgr.advance(1, 4)
    r1.append(E)
    mgr.begin_step()  # step 2: request 1's decode E -> F
    assert mgr.allocate_slots(1, 1)
    pages1 = mgr.block_tables(1)
    mgr.advance(1, 1)
    r1.append(F)
    mgr.finish(1)
    mgr.begin_step()  # step 3: request 2's prefill ABCDG -> H with ABCD cached
    r2 = [A, B, C, D, G]
    mgr.add_request(2, r2)
    assert mgr.lookup(2) == 4
    assert mgr.allocate_slots(2, 1)
    pages2 = mgr.block_tables(2)
    mgr.advance(2, 1)
    r2.append(H)
    mgr.finish(2)
    return mgr, pages1, pages2


def test_fig10_last_access_timeline():
    mgr, pages1, pages2 = _run_fig10()
    last = {name: mgr.alloc.specs[i].last for i, name in enumerate(["full", "swa"])}
    full1, full2 = pages1["full"], pages2["full"]
    assert full2[:4] == full1[:4]  # ABCD shared
    # Full attention: A B C D and G last used in step 3, E in step 2.
    assert [last["full"][p] for p in full2] == [3, 3, 3, 3, 3]
    assert last["full"][full1[4]] == 2
    # Sliding window: A B left the window after step 1, E was last read in
    # step 2, C D G in step 3.
    s1, s2 = pages1["swa"], pages2["swa"]
    a_b = [p for p in s1[:2] if p >= 0]
    assert a_b == []  # already released while request 1 was running
    assert [last["swa"][p] for p in s2[2:5]] == [3, 3, 3]
    assert last["swa"][s1[4]] == 2


def test_fig10_pages_left_window_for_a_reuse_point_leave_with_the_request():
    mgr, pages1, _ = _run_fig10()
    # A and B left the window in step 1, but a hit near request 1's prompt end
    # needs them: they are stamped with request 1's finish (step 2), not step 1.
    # (The paper leaves them at 1, so they would go before the rest of the prefix.)
    swa = mgr.alloc.specs[1]
    times = sorted(swa.last[p] for p in range(len(swa.last)) if swa.hash[p] is not None)
    assert times == [2, 2, 2, 3, 3, 3]


def test_fig10_eviction_order_is_balanced():
    mgr, _, _ = _run_fig10()
    # Request 1's own tokens go before request 2's in both layers; within a
    # time the longest prefix goes first (aligned rule).
    order = {}
    for i, name in enumerate(["full", "swa"]):
        sp = mgr.alloc.specs[i]
        live = [(sp.last[p], -sp.plen[p], sp.plen[p]) for p in range(len(sp.last)) if sp.hash[p]]
        order[name] = [plen for _, _, plen in sorted(live)]
    assert order["full"][0] == 5  # E (prefix length 5) first
    assert order["swa"][:3] == [5, 2, 1]  # E, B, A: request 1's, tail first


def test_fig11_possible_prefixes():
    # [A..J]: the full layer caches A..I; the sliding layer (window 2) misses
    # A, B, E and G.
    full = make_spec_manager(0, KVSpec("f", LayerKind.FULL, 1, 8), None, 1)
    swa = make_spec_manager(1, KVSpec("s", LayerKind.SLIDING, 1, 8, window=2), None, 1)
    full_hit = [True] * 9 + [False]
    swa_hit = [False, False, True, True, False, True, False, True, True, True]
    assert full.possible_prefix(full_hit) == set(range(1, 10))
    assert swa.possible_prefix(swa_hit) == {4, 9, 10}
    assert max(full.possible_prefix(full_hit) & swa.possible_prefix(swa_hit)) == 9


def test_odd_state_pages_are_padded_to_the_token_pages():
    # A Mamba state of 200,003 B shares no factor with a 1 KiB token page: the plain LCM
    # would be ~200 MB. Padded up to a multiple of the token page it tiles (196 pages).
    full = KVSpec("full", LayerKind.FULL, 1, 64)
    state = KVSpec("mamba", LayerKind.MAMBA, 1, 200_003, checkpoint_every=32)
    layout = make_layout([full, state], tokens_per_page=16)
    assert layout.page_bytes == (1024, 196 * 1024) == (1024, layout.large_page_bytes)
    mgr = KVCacheManager([full, state], pool_bytes=8 * layout.large_page_bytes,
                         tokens_per_page=16)
    mgr.add_request("r", list(range(40)))
    mgr.lookup("r")
    assert mgr.allocate_slots("r", 40)
    # Token pages alone are never padded: an odd pair is still refused.
    with pytest.raises(ValueError, match="unreasonable"):
        make_layout([KVSpec("a", LayerKind.FULL, 1, 1009),
                     KVSpec("b", LayerKind.FULL, 1, 1013)], tokens_per_page=1)


def test_a_state_page_is_padded_to_a_large_page_of_its_own_where_that_costs_little():
    # Jamba 1.5 Mini: a 8,716,288 B state (28 layers) and 262,144 B token pages share
    # 2^16 only; their LCM is 4 states or 133 token pages, so either type would take
    # room from the other four states at a time. 2.2% more makes the state 34 pages.
    full = KVSpec("full", LayerKind.FULL, 4, 4096)
    state = KVSpec("mamba", LayerKind.MAMBA, 28, 311_296, checkpoint_every=512)
    layout = make_layout([full, state], tokens_per_page=16)
    assert layout.page_bytes == (262_144, 34 * 262_144) == (262_144, layout.large_page_bytes)
    # Where rounding up would cost more than a sixteenth of the state, the LCM stays.
    small = KVSpec("mamba", LayerKind.MAMBA, 1, 3 * 1024, checkpoint_every=16)
    layout = make_layout([KVSpec("full", LayerKind.FULL, 1, 128), small], tokens_per_page=16)
    assert layout.page_bytes == (2048, 3072) and layout.large_page_bytes == 6144
