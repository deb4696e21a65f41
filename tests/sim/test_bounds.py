"""The offline bounds the prefix-hit benchmarks compare to."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.sim.bounds import belady, infinite_pool
from kvserve.sim.traces import OUTPUT_TOKEN, TraceRequest


def _trace(units: list[int], prefix: int = 64, out: int = 4) -> list[TraceRequest]:
    """One request per entry, a second apart, each on its unit's shared prefix."""
    return [TraceRequest(f"r{i}", float(i), out, prefix + 8, f"u{u}", prefix)
            for i, u in enumerate(units)]


def tokens(n: int) -> int:  # a byte a token: hit bytes and peak room alike
    return n


def past_hit(h: int, n: int) -> int:  # a running request's room: a byte a token past its hit
    return n - h


def test_belady_keeps_what_comes_back_first():
    trace = _trace([0, 1, 2, 0, 1, 2])
    assert belady(trace, 10**9, tokens) == infinite_pool(trace)
    # Room for two of three units: MIN keeps 0 and 1 past 2's miss, then hits both.
    assert belady(trace, 2 * 64, tokens) == 2 * 64 / sum(r.prompt_len for r in trace)
    assert belady(trace, 63, tokens) == 0.0  # no unit fits


def test_the_peak_bound_keeps_each_running_requests_room_free():
    trace = _trace([0, 1, 0, 1])
    fits = belady(trace, 2 * 64, tokens)
    assert fits == infinite_pool(trace)
    # Each request holds its uncomputed tokens while it runs: with two units
    # cached the second unit's miss has no room beside them, so it keeps one.
    assert belady(trace, 2 * 64, tokens, peak=tokens) < fits
    assert belady(trace, 10**9, tokens, peak=tokens) == fits


def test_a_request_holds_its_room_whether_or_not_its_unit_stays_cached():
    trace = _trace([0, 1, 0, 1])
    # While the second request runs it holds its 76 tokens (72 of prompt, 4 out) beside
    # unit 0's 64: 140 > 130. Keeping unit 1 cached would overlap its room, but MIN drops
    # unit 1 (needed last), and the request still holds all 76 until it ends, so unit 0
    # cannot stay either (counting only the 12 beyond unit 1's bytes kept it). With room
    # for both beside that request, both hit.
    assert belady(trace, 130, tokens, peak=tokens) == 0.0
    assert belady(trace, 140, tokens, peak=tokens) == 2 * 64 / sum(r.prompt_len for r in trace)


@settings(max_examples=40, deadline=None)
@given(units=st.lists(st.integers(0, 5), min_size=1, max_size=30),
       capacity=st.integers(0, 600))
def test_bounds_are_ordered(units, capacity):
    trace = _trace(units)
    plain = belady(trace, capacity, tokens)
    assert belady(trace, capacity, tokens, peak=tokens) <= plain <= infinite_pool(trace)


def test_the_order_blind_reference_keeps_the_unit_used_most_from_now_on():
    trace = _trace([0, 1, 0, 0, 1, 1, 1])
    total = sum(r.prompt_len for r in trace)
    # Room for one unit. MIN keeps 0 for its two uses right after (4 hits); ranked by
    # uses left, 1 (three) beats 0 (two), so both of 0's come back to nothing (3).
    assert belady(trace, 64, tokens) == 4 * 64 / total
    assert belady(trace, 64, tokens, order_blind=True) == 3 * 64 / total


@settings(max_examples=40, deadline=None)
@given(units=st.lists(st.integers(0, 5), min_size=1, max_size=30),
       capacity=st.integers(0, 600))
def test_knowing_when_beats_knowing_how_often(units, capacity):
    # Units of one size: MIN is optimal, so no ranking of them hits more.
    trace = _trace(units)
    assert belady(trace, capacity, tokens, order_blind=True) <= belady(trace, capacity, tokens)


def test_the_recency_reference_is_lru_that_caches_what_never_comes_back():
    total = lambda trace: sum(r.prompt_len for r in trace)  # noqa: E731
    # A loop one unit longer than the room: LRU evicts each unit just before it returns.
    loop = _trace([0, 1, 2, 0, 1, 2])
    assert belady(loop, 2 * 64, tokens, recency=True) == 0.0
    assert belady(loop, 2 * 64, tokens) > 0.0
    # Unit 2 is used once. MIN bypasses it; LRU caches it over unit 0, whose miss then
    # evicts unit 1: both come back to nothing.
    once = _trace([0, 1, 2, 0, 1])
    assert belady(once, 2 * 64, tokens) == 2 * 64 / total(once)
    assert belady(once, 2 * 64, tokens, recency=True) == 0.0
    # Recency's own strength: what was used last comes back first.
    near = _trace([0, 1, 1, 0])
    assert belady(near, 64, tokens, recency=True) == 64 / total(near)


def test_the_recency_reference_keeps_a_conversation_whole():
    # Without a shared prefix length (a conversation), the unit is the whole sequence so
    # far, prompt and answer: the next turn starts with it and hits its three full blocks.
    sent = list(range(48))
    first = TraceRequest("t0", 0.0, 16, prompt_ids=sent, prefix_id="chat")
    second = TraceRequest("t1", 1.0, 4, prompt_ids=sent + [OUTPUT_TOKEN] * 15
                          + list(range(100, 133)), prefix_id="chat")
    total = first.prompt_len + second.prompt_len
    assert infinite_pool([first, second]) == 48 / total
    assert belady([first, second], 48, tokens, recency=True) == 48 / total
    assert belady([first, second], 47, tokens, recency=True) == 0.0


@settings(max_examples=40, deadline=None)
@given(units=st.lists(st.integers(0, 5), min_size=1, max_size=30),
       capacity=st.integers(0, 600), peak=st.booleans())
def test_recency_never_beats_min(units, capacity, peak):
    # Units of one size: MIN is optimal, so no online ranking of them hits more.
    trace = _trace(units)
    room = tokens if peak else None
    assert (belady(trace, capacity, tokens, peak=room, recency=True)
            <= belady(trace, capacity, tokens, peak=room))


def test_the_concurrent_bound_keeps_the_others_running_room_free():
    trace = _trace([0, 1, 0, 1])  # 72-token prompts on 64-token units, a second apart
    total = sum(r.prompt_len for r in trace)
    assert belady(trace, 2 * 64, tokens) == 2 * 64 / total
    # r0 decodes through the whole trace, holding its 8 tokens past unit 0 beside the
    # cache: the two units no longer fit together, and MIN keeps unit 0 (back first).
    busy = {"r0": (0.5, 10.0)}
    assert belady(trace, 2 * 64, tokens, busy=busy, room=past_hit) == 64 / total
    # Its room counts from its first token to its finish only.
    assert belady(trace, 2 * 64, tokens, busy={"r0": (1.5, 10.0)}, room=past_hit) == 2 * 64 / total
    assert belady(trace, 2 * 64, tokens, busy={"r0": (0.5, 0.9)}, room=past_hit) == 2 * 64 / total


@settings(max_examples=60, deadline=None)
@given(units=st.lists(st.integers(0, 5), min_size=1, max_size=30),
       capacity=st.integers(0, 600),
       spans=st.lists(st.tuples(st.floats(0, 3), st.floats(0, 8)), min_size=30, max_size=30))
def test_the_others_room_never_adds_hits(units, capacity, spans):
    trace = _trace(units)
    busy = {tr.id: (tr.arrival + a, tr.arrival + a + d) for tr, (a, d) in zip(trace, spans)}
    assert (belady(trace, capacity, tokens, busy=busy, room=past_hit)
            <= belady(trace, capacity, tokens))
