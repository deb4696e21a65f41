"""Admission and eviction by reuse: dead pages first, speculative insertion, loops.

Full and sliding pages here have the same size, so every small page is a
whole large page and eviction follows one queue of keys across both specs.
"""

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from invariants import check_invariants, check_state_peak

from kvserve.memory import KVCacheManager, KVSpec, LayerKind
from kvserve.memory.allocator import DEAD
from kvserve.memory.layer_types import LOOP, RequestKV, ReusePoints
from kvserve.memory.prefix_cache import extend_block_hashes

T = 4
FULL = KVSpec("full", LayerKind.FULL, 1, 8)
SWA = KVSpec("swa", LayerKind.SLIDING, 1, 8, window=16)
PAGE = T * 8


def make(pages: int, specs=(FULL, SWA), window_only: bool = False) -> KVCacheManager:
    mgr = KVCacheManager(list(specs), PAGE * pages, tokens_per_page=T, window_only=window_only)
    assert mgr.layout.pages_per_large == (1,) * len(specs)
    mgr.reuse.PROMPT_TAIL = 5 * T  # the prompt's end region: its last 5 blocks
    return mgr


def serve(mgr: KVCacheManager, rid, tokens: list[int], out: int = 2) -> int:
    """Run one request alone: lookup, prefill in one step, `out` decode steps, finish."""
    tokens = list(tokens)
    mgr.begin_step()
    mgr.add_request(rid, tokens)
    hit = mgr.lookup(rid)
    prefill_and_decode(mgr, rid, tokens, hit, out)
    return hit


def prefill_and_decode(mgr: KVCacheManager, rid, tokens: list[int], hit: int,
                       out: int) -> None:
    """The rest of `serve` for a request looked up at `hit`: its prompt in one step,
    `out` decode steps, finish."""
    assert mgr.allocate_slots(rid, len(tokens) - hit)
    mgr.advance(rid, len(tokens) - hit)
    for i in range(out):
        mgr.begin_step()
        tokens.append(900 + i)
        mgr.reqs[rid].tokens = tokens
        assert mgr.allocate_slots(rid, 1)
        mgr.advance(rid, 1)
    mgr.begin_step()
    mgr.finish(rid)
    check_invariants(mgr)


def squeeze(mgr: KVCacheManager, rid, more: int = 0) -> None:
    """A running request takes every free page and every DEAD one (and `more` pages,
    evicted lowest key first), then leaves."""
    sp = [mgr.alloc.specs[s] for s in range(2)]
    dead = sum(1 for s in sp for p, h in enumerate(s.hash)
               if h is not None and s.ref[p] == 0 and s.last[p] == DEAD)
    pages = mgr.alloc.num_free_large() + dead + more
    tokens = [10_000 + i for i in range(pages // 2 * T)]  # one full + one sliding page a block
    mgr.begin_step()
    mgr.add_request(rid, tokens)
    mgr.lookup(rid)
    assert mgr.allocate_slots(rid, len(tokens))
    mgr.abort(rid)  # nothing computed: its pages become empty again


ARTICLE = list(range(1, 65))  # 16 blocks


def test_out_of_window_pages_far_from_the_prompt_end_are_dead():
    mgr = make(200)
    serve(mgr, "a", ARTICLE + [500 + i for i in range(40)])  # prompt: 26 blocks
    swa = mgr.alloc.specs[1]
    by_block = {swa.plen[p] // T - 1: swa.last[p] for p, h in enumerate(swa.hash) if h}
    # A hit in the prompt's end region (blocks 21..26) needs blocks >= 17; earlier dead.
    assert all(by_block[b] == DEAD for b in range(17))
    assert {by_block[b] for b in range(17, 26)} == {mgr.now}  # stamped at finish


def test_dead_pages_go_before_any_page_that_can_hit():
    mgr = make(121)  # 69 free + 17 dead pages: the squeeze takes exactly those
    serve(mgr, "a", ARTICLE + [500 + i for i in range(40)])
    squeeze(mgr, "fill")
    swa = mgr.alloc.specs[1]
    assert not any(swa.last[p] == DEAD for p, h in enumerate(swa.hash) if h)
    # The prompt's own prefix still hits in both specs.
    mgr.add_request("again", ARTICLE + [500 + i for i in range(40)] + [7])
    assert mgr.lookup("again") == 104


def _three_questions(mark: bool) -> list[int]:
    mgr = make(120)
    if not mark:
        mgr.reuse.mark = lambda h: None
    hits = []
    for q in range(3):
        hits.append(serve(mgr, q, ARTICLE + [600 + 50 * q + i for i in range(40)]))
        squeeze(mgr, f"fill{q}")
    return hits


def test_a_divergence_found_at_lookup_makes_the_next_question_hit():
    # The article ends 40 tokens before the prompt does: the first question keeps
    # no window at the article's end. The second finds the full-attention pages
    # there but no window (a divergence point), marks it and keeps the window as
    # it prefills past; the third hits the whole article.
    first, second, third = _three_questions(mark=True)
    assert first == 0 and second < 64 and third == 64
    assert _three_questions(mark=False)[2] < 64


def _loop(lost_key: bool, rounds: int = 5) -> list[int]:
    mgr = make(80, specs=(FULL,))  # 3 articles of 16 pages fit with a running one
    mgr.reuse.protect = lost_key
    hits = []
    for k in range(rounds):
        got = 0
        for a in range(6):
            base = [1000 * (a + 1) + i for i in range(64)]
            got += serve(mgr, (k, a), base + [5, k, a]) > 0
        hits.append(got)
    return hits


def test_a_loop_over_more_prefixes_than_fit_keeps_a_set_hitting():
    assert _loop(lost_key=False)[1:] == [0, 0, 0, 0]  # LRU: every request misses
    assert min(_loop(lost_key=True)[2:]) >= 2
    # Left to itself the rule starts at each prefix's first return after it was lost.
    assert min(_loop(lost_key=None, rounds=6)[1:]) >= 2


def test_only_prefixes_back_at_regular_gaps_count_as_a_loop():
    reuse = ReusePoints(T)
    tokens = list(range(1, 66))
    hashes: list = []
    extend_block_hashes(hashes, tokens, T, ())

    def lookup_at(arrival: int, hit: int = 0) -> bool:
        """The request arriving `arrival`-th has the same prompt; whether it is a loop
        member (the step it looks up at does not matter: gaps count arrivals)."""
        r = RequestKV(arrival, tokens, (), hashes=list(hashes), num_computed=len(tokens),
                      arrival=arrival)
        key = reuse.reuse_key(r, len(hashes), hit, now=7)
        assert key == (LOOP - 7 if r.loop else None)
        reuse.remember(r)
        return r.loop

    assert not lookup_at(100)  # never seen
    assert not lookup_at(200)  # lost once: gets LRU's chance
    assert lookup_at(300)  # lost again after the same gap: a loop
    assert lookup_at(450, hit=16)  # a hit within 2x of the gap stays in the loop
    assert not lookup_at(1000)  # 550 arrivals after a gap of 150: random reuse, LRU again
    assert not lookup_at(1100, hit=16)  # a hit alone does not make a loop


@pytest.mark.parametrize("lost", [True, False])
def test_a_lost_prefix_branching_off_is_a_loop_member_on_its_first_return(lost):
    reuse = ReusePoints(T)
    doc = list(range(1, 65))  # 16 blocks shared, then a question of 2 blocks

    def ask(arrival: int, question: int, hit: int = 0) -> bool:
        tokens = doc + [1000 * question + i for i in range(8)]
        hashes: list = []
        extend_block_hashes(hashes, tokens, T, ())
        r = RequestKV(arrival, tokens, (), hashes=hashes, num_computed=len(tokens),
                      arrival=arrival, prompt_len=len(tokens))
        reuse.reuse_key(r, len(hashes), hit, now=7)
        reuse.remember(r)
        return r.loop

    assert not ask(100, 1)  # never seen
    if not lost:
        assert not ask(200, 2, hit=16)  # back and hit: nothing was lost
        return
    assert ask(200, 2)  # back and the document was lost: a loop member at once
    assert ask(300, 3, hit=16)  # a loop member that hits after the same gap stays one
    # The first return of a prefix that continues a finished sequence (a
    # conversation's next turn) keeps LRU's chance: see the same-prompt test above.


@pytest.mark.parametrize("reply", ["as generated", "re-tokenized"])
def test_a_lost_conversation_turn_is_not_a_loop_member_whatever_its_reply(reply):
    reuse = ReusePoints(T)
    prompt = list(range(1, 91))  # 22 blocks and 2 tokens
    answer = [700 + i for i in range(12)]

    def turn(arrival: int, tokens: list[int], out: list[int]) -> bool:
        hashes: list = []
        extend_block_hashes(hashes, tokens + out, T, ())
        r = RequestKV(arrival, tokens + out, (), hashes=hashes,
                      num_computed=len(tokens) + len(out), arrival=arrival,
                      prompt_len=len(tokens))
        reuse.reuse_key(r, (len(tokens) - 1) // T, 0, now=7)  # nothing cached: lost
        reuse.remember(r)
        return r.loop

    assert not turn(100, prompt, answer)
    # The client sends the reply back as text: its ids need not be the generated ones.
    sent = answer if reply == "as generated" else [800 + i for i in range(12)]
    assert not turn(200, prompt + sent + [900, 901, 902], [])


@st.composite
def workload(draw):
    ops = []
    for _ in range(draw(st.integers(5, 40))):
        ops.append((draw(st.integers(0, 3)), draw(st.integers(1, 60)), draw(st.integers(0, 3)),
                    draw(st.integers(0, 6))))
    return ops


# Found by hypothesis: several loop members' releases share loop keys (their order
# decides there, not the prefix length), which the aligned-rule check must leave alone.
LOOP_KEYS_SHARED = [
    (1, 11, 1, 1), (1, 15, 0, 4), (1, 53, 3, 2), (2, 46, 2, 5), (0, 52, 3, 6), (2, 58, 1, 2),
    (2, 35, 1, 3), (2, 16, 3, 2), (3, 31, 2, 3), (3, 53, 0, 5), (1, 10, 0, 4), (0, 45, 1, 4),
    (0, 18, 1, 3), (0, 51, 0, 0), (0, 58, 2, 6), (3, 21, 0, 5), (3, 24, 2, 5), (3, 52, 1, 1),
    (0, 50, 1, 0), (1, 57, 3, 4), (1, 29, 3, 2), (0, 38, 1, 3), (1, 57, 3, 4), (0, 59, 3, 6),
    (0, 42, 3, 2), (1, 33, 3, 0), (3, 40, 0, 2), (3, 36, 3, 3), (2, 12, 1, 4), (2, 11, 2, 6),
    (1, 30, 0, 0), (3, 26, 3, 4)]


@pytest.mark.parametrize("window_only", [False, True])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pages=st.integers(24, 90), ops=workload())
@example(pages=33, ops=LOOP_KEYS_SHARED)
def test_eviction_takes_the_lowest_keys_first(window_only, pages, ops):
    """Whatever the workload, an allocation never evicts a page while a page with a
    lower key (DEAD, then older) stays evictable, in either spec; and among the pages
    one request released at one step (at finish, every spec at once) the longest
    prefixes go first across specs (aligned rule), so what stays is a prefix in every
    spec. (Loop keys are shared by several requests' releases, which go in their
    order: the rule is checked on step keys.) With window_only as without."""
    mgr = make(pages, window_only=window_only)
    bases = [[100 * (b + 1) + i for i in range(80)] for b in range(4)]
    for i, (base, keep, tail, out) in enumerate(ops):
        tokens = bases[base][:keep] + [9000 + i] * (tail + 1)
        mgr.begin_step()
        mgr.add_request(i, tokens)
        could = mgr.cached_prefix(tokens, [])  # what the scheduler sorts the queue by
        hit = mgr.lookup(i)
        assert hit == could
        before, plen = _evictable(mgr), _plens(mgr)
        if not mgr.allocate_slots(i, len(tokens) - hit):
            mgr.abort(i)
            continue
        # keys as they were: the allocation may then demote what it left of a cut prefix
        after = {key: before[key] for key in _evictable(mgr)}
        gone = [k for key, k in before.items() if key not in after]
        if gone and after:
            assert max(gone) <= min(after.values())
            edge = max(gone)
            if edge >= 0:  # a step key: one release per step here
                went = [plen[key] for key, k in before.items() if key not in after and k == edge]
                stay = [plen[key] for key, k in after.items() if k == edge]
                assert not stay or min(went) >= max(stay)
        _no_cut_remainder(mgr, set(gone))
        mgr.advance(i, len(tokens) - hit)
        for _ in range(out):
            mgr.begin_step()
            tokens.append(3)
            if not mgr.allocate_slots(i, 1):
                break
            mgr.advance(i, 1)
        mgr.begin_step()
        mgr.finish(i)
        check_invariants(mgr)


def _no_cut_remainder(mgr: KVCacheManager, keys: set) -> None:
    """Every finished sequence whose key lost pages in an allocation keeps that key
    only on pages within the longest prefix every spec still serves (CutPrefixes)."""
    for key, seqs in mgr.cuts.by_key.items():
        for hashes in seqs if key in keys else ():
            r = RequestKV(None, (), (), hashes=hashes)
            v = mgr._longest_common_hit(r, len(hashes))
            for sp in mgr.alloc.specs:
                past = [sp.cached[h] for h in hashes[v:] if h in sp.cached]
                assert all(sp.ref[p] or sp.last[p] != key for p in past)


def _plens(mgr: KVCacheManager) -> dict:
    """(spec, hash) -> prefix length of every cached page."""
    return {(s, h): sp.plen[p] for s, sp in enumerate(mgr.alloc.specs)
            for h, p in sp.cached.items()}


def _evictable(mgr: KVCacheManager) -> dict:
    """(spec, hash) -> eviction key of every cached page no request uses."""
    return {(s, h): sp.last[p] for s, sp in enumerate(mgr.alloc.specs)
            for h, p in sp.cached.items() if sp.ref[p] == 0}


def _running(mgr: KVCacheManager, rid, tokens: list[int]) -> None:
    """Prefill `tokens` in one step and decode two tokens; the request keeps running."""
    tokens = list(tokens)
    mgr.begin_step()
    mgr.add_request(rid, tokens)
    assert mgr.lookup(rid) == 0
    assert mgr.allocate_slots(rid, len(tokens))
    mgr.advance(rid, len(tokens))
    for i in range(2):
        mgr.begin_step()
        tokens.append(900 + i)
        mgr.reqs[rid].tokens = tokens
        assert mgr.allocate_slots(rid, 1)
        mgr.advance(rid, 1)


def _spare(mgr: KVCacheManager) -> int:
    """Pages a new request can get: free ones and cached ones nobody holds."""
    return mgr.alloc.num_free_large() + sum(sp.n_evictable for sp in mgr.alloc.specs)


def _admit(mgr: KVCacheManager, rid, pages: int) -> bool:
    tokens = [20_000 + 100 * len(mgr.reqs) + i for i in range(pages // 2 * T)]
    mgr.begin_step()
    mgr.add_request(rid, tokens)
    mgr.lookup(rid)
    if mgr.allocate_slots(rid, len(tokens)):
        return True
    mgr.abort(rid)
    return False


PROMPT = ARTICLE + [500 + i for i in range(40)]  # 26 blocks; end region: blocks 21..26


def test_new_requests_cannot_evict_a_running_requests_window():
    # The window a hit at the prompt's end region needs has left the running
    # request's attention, but it holds it like its full-attention pages: an
    # admission that would need those pages waits instead of splitting the prefix.
    mgr = make(120)
    _running(mgr, "a", PROMPT)
    held = len(mgr.reqs["a"].held.get(1, []))
    assert held >= 4  # blocks 17..20, out of the window a query at 106 reads
    spare = _spare(mgr)
    assert not _admit(mgr, "big", spare + 2)
    assert _admit(mgr, "fits", spare)
    # A question that shares the article and 20 tokens of the first question hits
    # its whole common prefix (21 blocks): the sliding spec needs blocks 17..20.
    mgr.add_request("q", PROMPT[:84] + [7] * 8)
    assert mgr.lookup("q") == 84
    check_invariants(mgr)


def test_a_running_request_takes_held_pages_back_when_memory_runs_out():
    mgr = make(120)
    _running(mgr, "a", PROMPT)
    held = len(mgr.reqs["a"].held.get(1, []))
    assert _admit(mgr, "fill", _spare(mgr))
    # "fill" (admitted, not yet computed) asks for two blocks more: with nothing free
    # or evictable, a running request may take the pages others hold.
    mgr.begin_step()
    mgr.reqs["fill"].tokens.extend([1] * 2 * T)
    assert mgr.allocate_slots("fill", len(mgr.reqs["fill"].tokens))
    assert mgr.reqs["a"].held.get(1, []) == []
    check_invariants(mgr)
    # When even the held pages are not enough, nothing changes.
    mgr2 = make(120)
    _running(mgr2, "a", PROMPT)
    assert _admit(mgr2, "fill", _spare(mgr2))
    before = [list(sp.ref) for sp in mgr2.alloc.specs]
    mgr2.begin_step()
    r = mgr2.reqs["fill"]
    r.tokens.extend([1] * (held + 8) * T)
    assert not mgr2.allocate_slots("fill", len(r.tokens))
    assert [list(sp.ref) for sp in mgr2.alloc.specs] == before
    assert len(mgr2.reqs["a"].held.get(1, [])) == held
    check_invariants(mgr2)


def test_held_pages_go_least_valuable_first_and_only_as_many_as_needed():
    # Two running requests hold the windows their prompt ends need; memory runs
    # short by a few pages. The short prompt's window saves less prefill per byte
    # than the long one's: it goes, and a question on the long prompt still hits.
    mgr = make(160)
    short = [3000 + i for i in range(12 * T)]
    _running(mgr, "long", PROMPT)
    _running(mgr, "short", short)
    held = {rid: len(mgr.reqs[rid].held.get(1, [])) for rid in ("long", "short")}
    assert held["long"] >= 4 and held["short"] >= 4
    assert _admit(mgr, "fill", _spare(mgr))
    mgr.begin_step()
    mgr.reqs["fill"].tokens.extend([1] * 2 * T)  # 4 pages more: fewer than one request holds
    assert mgr.allocate_slots("fill", len(mgr.reqs["fill"].tokens))
    assert mgr.reqs["short"].held.get(1, []) == []
    assert len(mgr.reqs["long"].held[1]) == held["long"]
    check_invariants(mgr)
    mgr.add_request("q", PROMPT[:84] + [7] * 8)
    assert mgr.lookup("q") == 84
    check_invariants(mgr)


def _looked_up(mgr: KVCacheManager, rid, tokens: list[int], loop: bool = False, gap: int = 0):
    """A request after its lookup, made a loop member with `gap` as reuse_key would."""
    mgr.add_request(rid, tokens)
    mgr.lookup(rid)
    r = mgr.reqs[rid]
    r.loop, r.gap = loop, gap
    return r


def test_a_loop_miss_waits_for_room_and_for_other_loop_misses():
    mgr = make(40)
    mgr.begin_step()
    a = _looked_up(mgr, "a", list(range(1, 21)))
    assert mgr.can_start("a", 20)  # alone: always
    assert mgr.allocate_slots("a", 20)  # 5 full + 5 sliding pages; 30 stay free
    b = _looked_up(mgr, "b", [100 + i for i in range(64)], loop=True, gap=3)
    assert not mgr.can_start("b", 64)  # prefilled at once it peaks at 16 + 16 pages
    assert mgr.can_start("b", 8)  # 8 at a time: 16 full + 7 sliding pages
    a.loop = True  # another loop miss runs: b waits whatever it needs
    assert not mgr.can_start("b", 8)
    b.num_hit = 32  # b hit half its prompt: not a miss, it never waits
    assert mgr.can_start("b", 8)
    b.num_hit = 0
    assert not mgr.can_start("b", 8)
    for i in range(3):  # a loop period (gap = 3) of admissions later it starts anyway
        assert mgr.can_start("b", 8) is (i == 3)
        mgr.add_request(i, [7, 7, i])
        mgr.lookup(i)
        assert mgr.allocate_slots(i, 3)
    assert mgr.can_start("b", 8)
    mgr.abort("b")
    for rid in ["a", 0, 1, 2]:
        mgr.finish(rid)
    b = _looked_up(mgr, "b", [100 + i for i in range(64)], loop=True, gap=3)
    assert mgr.can_start("b", 64)  # nothing else runs
    mgr.abort("b")
    check_invariants(mgr)
    assert not mgr._waits


def test_a_prompt_being_computed_is_waited_for_until_its_request_stops():
    mgr = make(200)
    mgr.add_request("a", ARTICLE + [500, 501, 502])
    mgr.lookup("a")
    assert mgr.allocate_slots("a", 32)  # the first half of the article
    mgr.add_request("b", ARTICLE + [600, 601])
    mgr.lookup("b")
    assert mgr.waits_for_running("b", 64)  # "a" computes 16 of its 16 full blocks
    mgr.abort("b")
    mgr.abort("a")  # stopped mid-prompt: nothing is being computed any more
    check_invariants(mgr)
    assert not mgr.computing
    mgr.add_request("b", ARTICLE + [600, 601])
    mgr.lookup("b")
    assert not mgr.waits_for_running("b", 64)


@pytest.mark.parametrize("stop", ["prefilled", "aborted"])
def test_a_loop_miss_waits_while_another_loop_miss_computes_its_prompt(stop):
    # "a" holds 8 + 8 pages and peaks 8 + 8 more; "b" peaks at 16 + 16: 48 > 44 free.
    mgr = make(60)
    _looked_up(mgr, "a", [100 + i for i in range(64)], loop=True, gap=3)
    assert mgr.allocate_slots("a", 32)  # half its prompt: "a" computes
    b = _looked_up(mgr, "b", [300 + i for i in range(64)], loop=True, gap=3)
    assert mgr.waits_for_running("b", 64)  # even last in the queue: "a" runs meanwhile
    assert not mgr.waits_for_running("b", 8)  # in 8-token steps both peaks fit
    b.loop = False  # other traffic does not wait for loop misses
    assert not mgr.waits_for_running("b", 64)
    b.loop = True
    mgr.advance("a", 32)
    if stop == "prefilled":
        assert mgr.allocate_slots("a", 32)
        mgr.advance("a", 32)  # "a" has computed its prompt: it decodes now
    else:
        mgr.abort("a")  # cancelled mid-prompt: it computes nothing any more
    assert not mgr.waits_for_running("b", 64)
    for rid in list(mgr.reqs):
        mgr.abort(rid)
    check_invariants(mgr)


def test_with_a_backlog_loop_misses_run_one_at_a_time():
    mgr = make(200)  # room for both: only the backlog makes "b" wait
    a = _looked_up(mgr, "a", [100 + i for i in range(64)], loop=True, gap=3)
    assert mgr.allocate_slots("a", 64)
    mgr.advance("a", 64)  # "a" has computed its prompt: it decodes now
    b = _looked_up(mgr, "b", [300 + i for i in range(64)], loop=True, gap=3)
    short = mgr.SHORT_QUEUE
    assert not mgr.waits_for_running("b", 64, waiting=short + 1)  # a short prompt runs
    mgr.LONG_PROMPT = 32  # 64 tokens count as a document from here on
    assert not mgr.waits_for_running("b", 64, waiting=short)  # no backlog: both run
    assert mgr.waits_for_running("b", 64, waiting=short + 1)
    b.loop = False  # other traffic does not wait for loop misses
    assert not mgr.waits_for_running("b", 64, waiting=short + 1)
    b.loop, a.num_hit = True, 64  # "a" hit its prompt: not a loop miss
    assert not mgr.waits_for_running("b", 64, waiting=short + 1)
    a.num_hit = 0
    mgr.finish("a")
    assert not mgr.waits_for_running("b", 64, waiting=short + 1)  # "a" has left
    mgr.abort("b")
    check_invariants(mgr)


def test_without_a_backlog_at_most_a_few_loop_misses_run_at_once():
    mgr = make(400)  # room for all: only the cap makes the last one wait
    mgr.LONG_PROMPT = 32  # 64 tokens count as a document
    cap = mgr.MAX_LOOP_MISSES
    misses = []
    for i in range(cap):
        # Each admitted this step: allocated, nothing computed yet, already counted.
        misses.append(_looked_up(mgr, f"m{i}", [1000 * (i + 1) + j for j in range(64)],
                                 loop=True, gap=3))
        assert mgr.allocate_slots(f"m{i}", 64)
        _looked_up(mgr, "b", [300 + j for j in range(64)], loop=True, gap=3)
        assert mgr.waits_for_running("b", 64) is (i + 1 == cap)
        mgr.abort("b")
    _looked_up(mgr, "b", [300 + j for j in range(64)], loop=True, gap=3)
    misses[0].num_hit = 40  # it hit most of its prompt: not a loop miss, one fewer runs
    assert not mgr.waits_for_running("b", 64)
    misses[0].num_hit = 0
    mgr.finish("m1")
    assert not mgr.waits_for_running("b", 64)  # one has left
    for rid in list(mgr.reqs):
        mgr.abort(rid)
    check_invariants(mgr)


@pytest.mark.parametrize("pages, waits", [(120, True), (140, False)])
def test_without_a_backlog_a_loop_miss_that_would_evict_the_kept_cache_waits(pages, waits):
    """Below the cap, a document loop miss runs beside another only in the pages the loop
    rule gives up (free, dead, loop members'): computed beside it, its peak would evict
    the documents that keep hitting, for room that stays the loop's afterwards. Alone,
    it runs regardless."""
    mgr = make(pages)
    mgr.LONG_PROMPT = 32  # 64 tokens count as a document
    for d in range(3):  # three documents that keep hitting (step keys), 25 pages each
        serve(mgr, f"doc{d}", [1000 * (d + 1) + j for j in range(64)], out=0)
    mgr.begin_step()
    _looked_up(mgr, "a", [100 + i for i in range(64)], loop=True, gap=3)
    assert mgr.allocate_slots("a", 64)  # a loop miss that decodes now
    mgr.advance("a", 64)
    _looked_up(mgr, "b", [300 + i for i in range(64)], loop=True, gap=3)
    # "b" peaks at 16 full + 16 sliding pages; free and dead: 20 of 120, 40 of 140.
    assert mgr.waits_for_running("b", 64) is waits
    mgr.abort("b")
    mgr.finish("a")
    _looked_up(mgr, "b", [300 + i for i in range(64)], loop=True, gap=3)
    assert not mgr.waits_for_running("b", 64)  # alone
    mgr.abort("b")
    check_invariants(mgr)


def test_two_loop_misses_that_both_fit_prefill_side_by_side():
    mgr = make(70)  # 54 free pages: both peaks (48) fit
    _looked_up(mgr, "a", [100 + i for i in range(64)], loop=True, gap=3)
    assert mgr.allocate_slots("a", 32)
    _looked_up(mgr, "b", [300 + i for i in range(64)], loop=True, gap=3)
    assert not mgr.waits_for_running("b", 64)
    for rid in "ab":
        mgr.abort(rid)
    check_invariants(mgr)


def test_a_request_taken_back_after_lookup_leaves_its_hit_pages_keys_alone():
    mgr = make(200)
    serve(mgr, "a", ARTICLE + [500, 501, 502])
    sp = [mgr.alloc.specs[s] for s in range(2)]
    before = [list(s.last) for s in sp]
    for _ in range(3):  # a loop miss retried while it waits: lookup, then taken back
        mgr.begin_step()
        b = _looked_up(mgr, "b", ARTICLE + [600, 601, 602], loop=True, gap=3)
        assert b.num_hit == 64
        b.key = LOOP - mgr.now  # what a loop member's release would stamp
        mgr.abort("b")
        check_invariants(mgr)
    assert [list(s.last) for s in sp] == before
    assert "b" not in mgr.reuse.ends  # nothing computed: nothing remembered
    mgr.begin_step()
    b = _looked_up(mgr, "b", ARTICLE + [600, 601, 602])
    assert b.num_hit == 64
    hit = [list(t) for t in b.tables]
    mgr.abort("b")  # not a loop member: its hit pages are as recent as a release makes them
    for s, pids in zip(sp, hit):
        assert {s.last[p] for p in pids if p >= 0} == {mgr.now}
    check_invariants(mgr)


def test_a_loop_miss_prefills_in_small_chunks_only_while_the_queue_is_short():
    mgr = make(200)
    mgr.MISS_CHUNK = 8
    _looked_up(mgr, "a", [100 + i for i in range(64)], loop=True, gap=3)
    assert mgr.max_chunk("a", waiting=mgr.SHORT_QUEUE) == 8
    assert mgr.max_chunk("a", waiting=mgr.SHORT_QUEUE + 1) is None  # a backlog: full steps
    b = _looked_up(mgr, "b", [300 + i for i in range(64)])
    assert mgr.max_chunk("b", waiting=0) is None  # not in a loop, and 200 pages are free
    b.loop, b.num_hit = True, 32  # a loop member that hit half its prompt: not a miss
    assert mgr.max_chunk("b", waiting=0) is None
    for rid in "ab":
        mgr.abort(rid)
    full = make(200, specs=(FULL,))  # no window: smaller steps lower no peak
    full.MISS_CHUNK = 8
    _looked_up(full, "a", [100 + i for i in range(64)], loop=True, gap=3)
    assert full.max_chunk("a", waiting=0) is None
    full.abort("a")


def test_another_miss_prefills_in_small_chunks_only_where_one_step_would_evict_hits():
    for pages, capped in ((200, False), (60, True)):
        mgr = make(pages)
        mgr.MISS_CHUNK = 8
        serve(mgr, "a", ARTICLE + [500 + i for i in range(40)])  # 35 live pages, 17 dead
        mgr.begin_step()
        _looked_up(mgr, "b", [300 + i for i in range(64)])
        # No prompt has shared a prefix yet: the cache has served no hit to keep.
        assert mgr.max_chunk("b", waiting=0) is None
        mgr.abort("b")
        assert serve(mgr, "q2", ARTICLE + [600, 601, 602]) == 64  # a second question hits
        mgr.begin_step()
        b = _looked_up(mgr, "b", [300 + i for i in range(64)])
        assert not b.loop and b.num_hit == 0
        # In one step b peaks at 16 full + 16 sliding pages: within the free pages of
        # 200, above the free and dead ones of 60, where it would evict live pages.
        assert mgr.max_chunk("b", waiting=mgr.SHORT_QUEUE) == (8 if capped else None)
        assert mgr.max_chunk("b", waiting=mgr.SHORT_QUEUE + 1) is None
        mgr.abort("b")
        check_invariants(mgr)


def test_a_miss_that_would_take_held_windows_prefills_in_the_largest_step_that_fits():
    # Before any prompt has shared a prefix: a miss whose prompt in one step peaks above
    # the free and evictable pages would take the window a running request holds for
    # its prompt's end (the first questions on 16 articles at 4/s lost every second
    # question so). It prefills in the largest steps that fit beside it instead.
    for spare, capped in ((41, False), (27, True)):
        mgr = make(120)
        mgr.MISS_CHUNK = 8
        _running(mgr, "a", PROMPT)
        held = list(mgr.reqs["a"].held[1])
        assert _admit(mgr, "fill", _spare(mgr) - spare) and _spare(mgr) == spare
        mgr.begin_step()
        _looked_up(mgr, "b", [300 + i for i in range(64)])  # 16 full + 16 sliding pages
        assert mgr.reuse.branched == 0
        assert mgr.max_chunk("b", mgr.SHORT_QUEUE + 1) is None  # a backlog: full steps
        first = mgr.max_chunk("b", 0)
        # 16 full pages and (16 + c) / 4 + 1 sliding ones fit in 27 up to c = 24.
        assert first == (24 if capped else None)
        done = 0
        while done < 64:  # as the scheduler runs b: steps of max_chunk
            n = min(64 - done, mgr.max_chunk("b", 0) or 64)
            assert mgr.allocate_slots("b", n)
            mgr.advance("b", n)
            done += n
            mgr.begin_step()
        assert mgr.reqs["a"].held[1] == held
        mgr.add_request("q", PROMPT[:84] + [7] * 8)
        assert mgr.lookup("q") == 84
        check_invariants(mgr)


def test_a_request_alone_gives_up_the_windows_it_would_keep_at_marks_to_fit():
    # Windows kept at marks are speculative, and beyond the peak that fits_alone admits
    # by. In a pool that holds the request alone only without them, it runs without them
    # once it goes lean (the scheduler's call for a request alone: before, it failed the
    # request); the window at its prompt's end, within the peak, stays.
    doc = [7_000 + i for i in range(400)]  # 100 blocks
    hashes: list[int] = []
    extend_block_hashes(hashes, doc, T)

    def pages(mgr: KVCacheManager) -> int:
        mgr.add_request("probe", doc)
        mgr.lookup("probe")
        n = sum(m.num_new_pages(mgr.reqs["probe"], len(doc)) for m in mgr.managers)
        mgr.abort("probe")
        return n

    probe = make(1000, window_only=True)
    lean = pages(probe)
    probe.reuse.mark(hashes[49])  # a branch point halfway
    assert pages(probe) == lean + 4  # the window before it: blocks 46..49
    mgr = make(lean + 2, window_only=True)  # room for the decode's last block, not the mark's
    mgr.reuse.mark(hashes[49])
    assert mgr.fits_alone(len(doc) + 2, len(doc))
    mgr.add_request("a", doc)
    assert mgr.lookup("a") == 0
    assert not mgr.allocate_slots("a", len(doc))  # short, and nothing changed
    check_invariants(mgr)
    assert mgr.go_lean("a") and not mgr.go_lean("a")  # once; then nothing to give up
    prefill_and_decode(mgr, "a", list(doc), 0, 2)  # its allocations all succeed
    assert serve(mgr, "b", doc + [1, 2, 3]) == len(doc)


def test_answers_go_first_until_a_conversation_continues():
    mgr = make(200)
    serve(mgr, "a", ARTICLE + [500, 501, 502], out=6)  # 16 prompt blocks, 2 of answer
    full = mgr.alloc.specs[0]
    key = {full.plen[p] // T: full.last[p] for p, h in enumerate(full.hash) if h}
    assert key[17] == key[18] == DEAD  # blocks past the prompt: only a next turn hits them
    assert key[16] == mgr.now != DEAD
    assert mgr.reuse.continued == 0
    # A next turn sends the answer back: its hit continues "a", and from then on
    # answers are cached like the rest.
    turn = ARTICLE + [500, 501, 502] + _answer(6) + list(range(600, 608))
    assert serve(mgr, "b", turn) == 72
    assert mgr.reuse.continued == 1
    assert {full.last[p] for p, h in enumerate(full.hash) if h and full.plen[p] > 76} \
        == {mgr.now}
    check_invariants(mgr)


def test_a_state_checkpoint_past_the_prompt_goes_first_until_a_conversation_continues():
    """Mamba's sequence-end checkpoint serves a next turn only, as the answer's pages."""
    state = KVSpec("mamba", LayerKind.MAMBA, 1, PAGE, checkpoint_every=2 * T)
    mgr = make(200, (FULL, state))
    sp = mgr.alloc.specs[1]

    def keys() -> dict[int, int]:
        return {sp.plen[p] // T: sp.last[p] for p, h in enumerate(sp.hash) if h}

    serve(mgr, "a", ARTICLE + [500, 501, 502], out=6)  # ends at block 18, prompt at 16
    assert keys()[18] == DEAD and keys()[16] == mgr.now
    turn = ARTICLE + [500, 501, 502] + _answer(6) + list(range(600, 608))
    assert serve(mgr, "b", turn) == 72  # continues "a": from now on answers count
    assert mgr.reuse.continued == 1
    c = list(range(2000, 2067))
    serve(mgr, "c", c, out=6)
    hashes: list[int] = []
    extend_block_hashes(hashes, c + _answer(6), T)
    assert sp.last[sp.cached[hashes[17]]] == mgr.now  # "c"'s sequence end: kept by recency
    check_invariants(mgr)


def test_a_next_turn_hits_the_state_at_the_previous_sequences_last_block():
    """The tail: once conversations continue, a state snapshot at every block boundary
    past the prompt, cached at the end, so a next turn hits every full block it sends
    back, not the checkpoint grid below."""
    state = KVSpec("mamba", LayerKind.MAMBA, 1, PAGE, checkpoint_every=4 * T)
    mgr = make(200, (FULL, state))
    sp = mgr.alloc.specs[1]

    def keys() -> dict[int, int]:
        return {sp.plen[p]: sp.last[p] for p, h in enumerate(sp.hash) if h}

    a = ARTICLE + [500, 501, 502]  # 67 tokens; 10 answered, 76 computed
    serve(mgr, "a", a, out=10)
    assert 76 not in keys()  # no conversation seen yet: no tail
    b = a + _answer(10) + [7000 + i for i in range(9)]  # 86 tokens
    assert serve(mgr, "b", b, out=2) == 64  # the grid; its attention reaches a's end, 76
    assert mgr.reuse.continued == 1
    assert keys()[88] == mgr.now  # b's tail (its grid checkpoint is at 80)
    c = b + [900, 901] + [8000 + i for i in range(5)]
    assert serve(mgr, "c", c) == 88
    assert not any(sp.ref)  # every tail went with its request


def test_a_next_turn_leaves_the_state_it_restored_from_to_go_first():
    """A conversation goes on past the state its next turn restores from: that state then
    serves only an edit of the turn's message, so it goes before every state a next turn
    could hit (as Marconi drops a state its sequence has outgrown) instead of outliving
    other conversations' latest states, and serves the edit while it stays."""
    state = KVSpec("mamba", LayerKind.MAMBA, 1, PAGE, checkpoint_every=4 * T)
    mgr = make(200, (FULL, state))
    sp = mgr.alloc.specs[1]
    a = ARTICLE + [500, 501, 502]
    serve(mgr, "a", a, out=10)
    b = a + _answer(10) + [7000 + i for i in range(9)]
    serve(mgr, "b", b, out=2)
    (tail,) = [p for p, h in enumerate(sp.hash) if h and sp.plen[p] == 88]  # b's end
    assert sp.last[tail] > DEAD
    c = b + _answer(2) + [8000 + i for i in range(5)]
    assert serve(mgr, "c", c) == 88  # restored from b's tail
    assert sp.hash[tail] is not None and sp.last[tail] == DEAD
    edit = b + _answer(2) + [9000 + i for i in range(5)]  # c's message, edited
    assert serve(mgr, "edit", edit) == 88


def test_a_next_turn_lets_the_states_its_first_turn_kept_for_its_prompt_go_first():
    """A conversation's first turn keeps states for its prompt's end region (an answer
    regenerated); once the next turn continues past its answer they serve only that, as
    the windows TextStream.retire lets go: cached DEAD, but for one a mark needs. A
    second question on a document (a branch, not a next turn) restores from them, and
    they stay."""
    state = KVSpec("mamba", LayerKind.MAMBA, 1, PAGE, checkpoint_every=4 * T)
    mgr = make(200, (FULL, state))
    sp = mgr.alloc.specs[1]
    w = [10_000 + i for i in range(40)]  # another conversation goes on: tails are kept
    serve(mgr, "w1", w, out=4)
    assert serve(mgr, "w2", w + _answer(4) + [11_000 + i for i in range(9)]) == 32  # grid
    assert mgr.reuse.continued
    a = ARTICLE + [500, 501, 502]  # 16 whole blocks, the end region's grid: 8, 12, 16
    serve(mgr, "a", a, out=10)

    mine = set(_hashes(ARTICLE))

    def prompt_states():
        return {sp.plen[p]: sp.last[p] for p, h in enumerate(sp.hash) if h in mine}

    assert set(prompt_states()) == {32, 48, 64}
    assert all(key > DEAD for key in prompt_states().values())
    question = ARTICLE + [600, 601, 602, 603, 604]  # branches off at block 16
    assert serve(mgr, "q", question) == 64
    assert all(key > DEAD for key in prompt_states().values())
    b = a + _answer(10) + [7000 + i for i in range(9)]
    assert serve(mgr, "b", b) == 76  # a's sequence end: its tail
    states = prompt_states()
    assert states[32] == states[48] == DEAD
    assert states[64] > DEAD  # the question marked it: the next question hits there


def _message(k: int, msg: int) -> list[int]:
    """Turn k's new message of `msg` tokens in `_conversation`."""
    return [50_000 + 100 * k + i for i in range(msg)]


def _answer(out: int) -> list[int]:
    """`serve`'s answer of `out` tokens."""
    return [900 + i for i in range(out)]


def _hashes(tokens: list[int]) -> list[int]:
    """Block hashes of `tokens`."""
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, T)
    return hashes


def _conversation(mgr: KVCacheManager, turns: list[tuple[int, int]], start: int = 0,
                  between=None) -> list[int]:
    """Serve a conversation: each turn's prompt is the previous turn's whole sequence and a
    new message of `msg` tokens, answered with `out` tokens (all computed). Before turn
    `start` only the tokens are built; `between(k)` runs before turn k. Returns the hits."""
    seq: list[int] = []
    hits = []
    for k, (msg, out) in enumerate(turns):
        seq = seq + _message(k, msg)
        if between is not None:
            between(k)
        if k >= start:
            hits.append(serve(mgr, ("turn", k), list(seq), out))
        seq = seq + _answer(out)
    return hits


def test_a_next_turn_retires_the_previous_prompts_end_windows():
    mgr = make(400)
    # Turn 0: a 30-block prompt and 12 blocks of answer; its prompt's end region (points
    # 25..30) kept blocks 21..29, before the window its sequence end needs (blocks 38..41).
    hashes = _hashes(_message(0, 120) + _answer(48))
    swa = mgr.alloc.specs[1]
    hits = _conversation(mgr, [(120, 48)])
    assert {swa.last[swa.cached[hashes[b]]] for b in range(21, 30)} == {mgr.now}
    hits += _conversation(mgr, [(120, 48), (8, 2)], start=1)
    assert hits[1] == 168  # the whole first sequence
    assert {swa.last[swa.cached[hashes[b]]] for b in range(21, 30)} == {DEAD}
    assert hashes[42 - 1] not in mgr.reuse.marks  # a continuation is no divergence


def test_a_sibling_retires_the_windows_older_prompts_kept_before_its_branch_point():
    mgr = make(400)
    swa = mgr.alloc.specs[1]
    hashes = _hashes(ARTICLE)
    key = lambda b: swa.last[swa.cached[hashes[b]]]  # noqa: E731
    # An 18-block prompt: its end region (points 13..18) kept blocks 9..17.
    serve(mgr, "q0", ARTICLE + [600 + i for i in range(8)])
    assert {key(b) for b in range(9, 16)} == {mgr.now}
    # The second question branches off at the article's end (point 16), whose hit
    # needs blocks 12..15: blocks 9..11 served only points before it, and go first.
    assert serve(mgr, "q1", ARTICLE + [700 + i for i in range(8)]) == 64
    assert hashes[15] in mgr.reuse.marks
    assert {key(b) for b in range(9, 12)} == {DEAD}
    assert {key(b) for b in range(12, 16)} == {mgr.now}
    # A mark inside the old end region keeps the window its hit needs.
    mgr = make(400)
    swa = mgr.alloc.specs[1]
    serve(mgr, "q0", ARTICLE + [600 + i for i in range(8)])
    mgr.reuse.mark(hashes[10])  # point 11: its hit needs blocks 7..10
    assert serve(mgr, "q1", ARTICLE + [700 + i for i in range(8)]) == 64
    assert DEAD not in {key(9), key(10)} and key(11) == DEAD
    check_invariants(mgr)


def test_a_repeated_prompt_retires_nothing():
    # A prompt repeated whole hits in its own end region: it parts from the cache
    # nowhere, so a question diverging at the article's end still finds its window
    # after a squeeze (with the branch rule applied to it, the window went DEAD and
    # that question hit 0 tokens).
    mgr = make(120)
    first = ARTICLE + [600 + i for i in range(8)]
    serve(mgr, "q0", first)
    assert serve(mgr, "q0b", first) == 68
    squeeze(mgr, "fill")
    assert serve(mgr, "q1", ARTICLE + [700 + i for i in range(8)]) == 64
    check_invariants(mgr)


def test_a_prompt_apart_from_every_sequence_end_is_seen_as_a_next_turn_once_one_ends():
    # The next turn is queued (looked up every step) while its previous turn still
    # runs: no finished sequence lies in it yet, and that answer is remembered until a
    # request finishes.
    reuse = ReusePoints(T)
    seq = _message(0, 40) + _answer(20)
    nxt = seq + _message(1, 12)
    r = RequestKV("b", nxt, (), hashes=_hashes(nxt), prompt_len=len(nxt))
    p = (len(nxt) - 1) // T
    assert not reuse.next_turn(r, p) and not reuse.next_turn(r, p)
    reuse.remember(RequestKV("a", seq, (), hashes=_hashes(seq), prompt_len=40,
                             num_computed=len(seq)))
    assert reuse.next_turn(r, p)


@pytest.mark.parametrize("lost", [False, True])
def test_a_next_turn_keeps_no_window_for_its_prompts_end(lost):
    # A conversation's next turn is hit again at its sequence end, not in its prompt's
    # end region: the windows there go DEAD as they leave, whether or not the cache
    # still held the previous turn (the first turn above kept them, at the step's key).
    mgr = make(400)

    def evict(k: int) -> None:  # before turn 1: a request takes every page, then leaves
        if lost and k == 1:
            assert _admit(mgr, "all", _spare(mgr) // 2 * 2)
            mgr.abort("all")

    hits = _conversation(mgr, [(120, 48), (40, 48)], between=evict)
    assert hits[1] == (0 if lost else 168)
    # Turn 1: a 52-block prompt, a 64-block sequence. Its prompt's end region (points
    # 47..52) would keep blocks 42..51, before its last window (blocks 59..63).
    hashes = _hashes(_message(0, 120) + _answer(48) + _message(1, 40))
    swa = mgr.alloc.specs[1]
    assert {swa.last[swa.cached[hashes[b]]] for b in range(42, 52)} == {DEAD}


def test_a_next_turn_marks_no_point_of_its_conversation():
    # Turn 0's last window is lost, its prompt's end region is not: turn 1 hits there
    # (block 30) and the attention pages reach its sequence end (block 42). Both are
    # points of its own conversation, which goes on from turn 1's end, so neither is a
    # mark that would make turn 1 keep a window there.
    mgr = make(400)
    hashes = _hashes(_message(0, 120) + _answer(48))
    swa = mgr.alloc.specs[1]

    def lose_last_window(k: int) -> None:
        if k == 1:
            mgr.alloc.demote(1, [swa.cached[hashes[b]] for b in range(38, 42)])
            squeeze(mgr, "squeeze")

    hits = _conversation(mgr, [(120, 48), (8, 2)], between=lose_last_window)
    assert hits[1] == 30 * T
    assert hashes[30 - 1] not in mgr.reuse.marks
    assert hashes[42 - 1] not in mgr.reuse.marks
    assert mgr.reuse.branched == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 30)), min_size=2,
                      max_size=6),
       other=st.integers(1, 70), split=st.integers(0, 5))
def test_conversations_keep_every_hit_that_room_allows(turns, other, split):
    """With room for everything but DEAD pages (evicted before each turn), every turn hits
    the previous turn's whole sequence, and a point a diverging request marked still
    serves a hit afterwards: retiring a finished prompt's end windows never takes a window
    a mark or a sequence end needs."""
    mgr = make(2000)
    mgr.reuse.continued = 1  # conversations were seen: answers stay cached by recency
    # A branch inside turn 0's prompt, before its sequence end. (A branch at a sequence
    # end is taken for the conversation's next turn: the window there is DEAD once that
    # request leaves it, and a second continuation from there pays a miss.)
    prompt0 = _message(0, max(0, turns[0][0] - T))
    marked = []

    def diverge(k: int) -> None:  # shares turn 0's prompt but its last block, then differs
        if k == min(split, len(turns) - 1) + 1:
            marked.append(serve(mgr, "diverge", prompt0 + [7] * other))
        squeeze(mgr, ("squeeze", k))  # what is DEAD goes: the rest must still serve

    hits = _conversation(mgr, turns, between=diverge)
    seq: list[int] = []
    for k, (msg, out) in enumerate(turns):
        if k:
            assert hits[k] == len(seq) // T * T, (k, hits)
        seq = seq + _message(k, msg) + _answer(out)
    q = marked[0] // T if marked else 0
    if q and _hashes(prompt0)[q - 1] in mgr.reuse.marks:
        squeeze(mgr, "last squeeze")
        mgr.begin_step()
        mgr.add_request("again", prompt0 + [8] * other)
        assert mgr.lookup("again") >= q * T
        mgr.abort("again")


def _cut_loop(demote: bool) -> tuple[set, int]:
    """Two documents served as loop members (MRU keys), the first cut at its tail
    before the second comes; the keys of what is left of the first, and the second's
    hit after a request took every free and DEAD page and as many more as the first
    has left."""
    mgr = make(60)
    mgr.reuse.PROMPT_TAIL = 0  # one reuse point: the prompt's end
    mgr.reuse.reuse_key = lambda r, p, q, now: LOOP - now  # every request a loop member
    if not demote:
        mgr.cuts = None
    docs = [[1000 * d + i for i in range(64)] + [5] for d in (1, 2)]  # 16 blocks and 1
    serve(mgr, "a", docs[0], out=0)
    squeeze(mgr, "cut", more=2)  # and one more block of each spec: the doc's last
    left = [(sp, p, h) for sp in mgr.alloc.specs for p, h in enumerate(sp.hash) if h]
    keys = {sp.last[p] for sp, p, _ in left}
    serve(mgr, "b", docs[1], out=0)
    squeeze(mgr, "fill", more=sum(sp.hash[p] == h and sp.last[p] != DEAD
                                  for sp, p, h in left))
    mgr.add_request("again", docs[1])
    return keys, mgr.lookup("again")


def test_what_eviction_leaves_of_a_cut_prefix_goes_first():
    # The first document's hit needs its last block in both specs: once that is gone
    # nothing of it can serve a lookup, yet its MRU key is above the second's.
    left, hit = _cut_loop(demote=True)
    assert left == {DEAD}
    assert hit == 64
    left, hit = _cut_loop(demote=False)
    assert DEAD not in left and hit < 64


def test_a_prompt_takes_state_checkpoints_only_where_a_hit_can_use_them():
    """Marconi's admission: a state on the grid between reuse points would be cached
    DEAD at once, so a prompt takes none there. A branch found at lookup marks its point;
    the request that found it takes the state there, and the next one hits it."""
    state = KVSpec("mamba", LayerKind.MAMBA, 1, PAGE, checkpoint_every=8 * T)
    mgr = make(200, (FULL, state))
    sp = mgr.alloc.specs[1]
    a = ARTICLE + [500 + i for i in range(60)]  # 124 tokens: grid points 32, 64, 96
    mgr.begin_step()
    mgr.add_request("a", a)
    mgr.lookup("a")
    assert mgr.allocate_slots("a", len(a))
    # The end region (the last 5 blocks, tokens 104..124) restores the state at 96; the
    # ones at 32 and 64 would serve no reuse point (nor would 64 for a region of the
    # grid's length, as it was).
    assert [pos for pos, _ in mgr.reqs["a"].pending[1]] == [96]
    assert len(mgr.reqs["a"].tables[1]) == 1  # the live state
    mgr.advance("a", len(a))
    mgr.begin_step()
    mgr.finish("a")
    branch = ARTICLE[:40] + [700 + i for i in range(30)]
    assert serve(mgr, "b", branch) == 0  # no state at 32: the branch at 40 is marked
    assert 32 in {sp.plen[p] for p, h in enumerate(sp.hash) if h}
    assert serve(mgr, "c", ARTICLE[:40] + [800 + i for i in range(30)]) == 32
    check_invariants(mgr)


def test_a_decode_past_several_marked_points_holds_one_state_past_its_prompt():
    """peak_pages counts one held state past the prompt: a decode that passes several
    marked grid points holds the latest only, and the ones before stay cached by
    recency (a branch there still hits), not held beyond the peak the wait and
    feasibility rules plan for."""
    state = KVSpec("mamba", LayerKind.MAMBA, 1, PAGE, checkpoint_every=8 * T)
    mgr = make(300, (FULL, state))
    sp = mgr.alloc.specs[1]
    prompt = ARTICLE[:40]
    seq = prompt + [900 + i for i in range(200)]
    hashes: list = []
    extend_block_hashes(hashes, seq, T)
    marked = range(64, 240, 32)  # six grid points past the 40-token prompt
    for pos in marked:
        mgr.reuse.mark(hashes[pos // T - 1])
    mgr.begin_step()
    mgr.add_request("a", list(prompt))
    mgr.lookup("a")
    assert mgr.allocate_slots("a", len(prompt))
    mgr.advance("a", len(prompt))
    r = mgr.reqs["a"]
    for tok in seq[len(prompt):]:
        mgr.begin_step()
        r.tokens = r.tokens + [tok]
        assert mgr.allocate_slots("a", 1)
        mgr.advance("a", 1)
        assert sum(sp.plen[p] > len(prompt) for p in r.held.get(1, [])) <= 1
        check_state_peak(mgr, 40)
    mgr.begin_step()
    mgr.finish("a")
    check_invariants(mgr)
    for pos in marked:  # every marked state stays cached, none of them DEAD
        pid = sp.cached[hashes[pos // T - 1]]
        assert sp.last[pid] != DEAD
