"""`kvserve bench serve --think-time`: a session waits between an answer and its next turn.

Against a fake streaming endpoint (httpx.MockTransport), so no model is loaded.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvserve.bench.dataset import Session, Turn
from kvserve.bench.report import summarize
from kvserve.bench.serve import RunConfig, run_sessions, think_times


def _stream(request: httpx.Request) -> httpx.Response:
    """One content chunk, then usage: enough for a result to count as answered."""
    chunks = [{"choices": [{"delta": {"content": "ok"}}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


def _run(think: float, sessions: int = 2, turns: int = 3) -> list:
    cfg = RunConfig("http://bench.test", "m", "chat", float("inf"), None, 0.0, seed=3,
                    show_progress=False, think_time=think)
    plan = [Session(str(i), [Turn("hi", 1, 1)] * turns) for i in range(sessions)]

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(_stream)) as client:
            return await run_sessions(cfg, plan, client)

    return asyncio.run(go())[0]


def test_think_times_are_seeded_and_start_after_the_first_turn():
    a = think_times(2.0, seed=0, session=4, turns=50)
    assert a == think_times(2.0, seed=0, session=4, turns=50)
    assert a[0] == 0 and all(t > 0 for t in a[1:])
    assert a != think_times(2.0, seed=0, session=5, turns=50)  # sessions differ
    assert 1.0 < sum(a[1:]) / 49 < 3.0  # exponential of mean 2 (49 draws)
    assert think_times(0.0, 0, 0, 3) == [0.0, 0.0, 0.0]


def test_a_session_waits_its_think_time_before_each_later_turn():
    results = _run(think=0.05)
    assert all(r.ok for r in results)
    for sid in (0, 1):
        turns = sorted((r for r in results if r.session == sid), key=lambda r: r.turn)
        expected = think_times(0.05, 3, sid, 3)
        assert [r.think for r in turns] == expected
        for prev, nxt in zip(turns, turns[1:]):
            # The next turn leaves no sooner than the previous answer plus the think time.
            assert nxt.start >= prev.start + prev.latency + nxt.think - 1e-3
    assert all(r.record()["think_s"] == r.think for r in results)


def test_without_think_time_turns_follow_at_once():
    assert all(r.think == 0 for r in _run(think=0.0))


@pytest.mark.parametrize("counters, rate", [
    ({"kvserve_prefix_cache_hit_tokens": 80, "kvserve_prefix_cache_queried_tokens": 100,
      "kvserve_vtensor_recomputed_tokens": 30}, 0.5),
    ({"kvserve_prefix_cache_hit_tokens": 80, "kvserve_prefix_cache_queried_tokens": 100}, None),
])
def test_net_reuse_subtracts_what_the_vtensor_recomputed(counters, rate):
    summary = summarize([], 1.0, counters)
    assert summary["prefix_cache_hit_rate"] == 0.8
    assert summary["prefix_reused_rate"] == rate
