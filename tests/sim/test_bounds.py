"""The offline bounds the prefix-hit benchmarks compare to."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.sim.bounds import belady, infinite_pool
from kvserve.sim.traces import TraceRequest


def _trace(units: list[int], prefix: int = 64, out: int = 4) -> list[TraceRequest]:
    """One request per entry, a second apart, each on its unit's shared prefix."""
    return [TraceRequest(f"r{i}", float(i), out, prefix + 8, f"u{u}", prefix)
            for i, u in enumerate(units)]


def tokens(n: int) -> int:  # a byte a token: hit bytes and peak room alike
    return n


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
