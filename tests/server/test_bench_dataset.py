"""The benchmark's ShareGPT reader and session sampling, without a server."""

from __future__ import annotations

import asyncio
import json
import statistics

from kvserve.bench.dataset import (
    Limits,
    dialogue,
    sample_sessions,
    sharegpt_records,
)
from kvserve.bench.report import distribution, percentile
from kvserve.bench.serve import arrival_times
from kvserve.datasets.sharegpt import records as decode_records


def _conv(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_decoding_stops_cleanly_at_a_truncated_record() -> None:
    records = [_conv(("human", "a b c d"), ("gpt", "e f g h")), {"id": "y", "conversations": []}]
    text = json.dumps(records, indent=2)
    assert list(decode_records(text)) == records
    assert list(decode_records(text[: text.rindex('"y"')])) == records[:1]


def test_the_packaged_file_is_cut_and_still_yields_thousands_of_records() -> None:
    n = sum(1 for _ in sharegpt_records())
    assert n > 10_000


def test_dialogue_pairs_alternating_turns_and_skips_a_system_turn() -> None:
    rec = _conv(("system", "s"), ("human", "q1"), ("gpt", "a1"), ("human", "q2"),
                ("bing", "a2"), ("gpt", "out of order"), ("human", "q3"))
    assert dialogue(rec) == [("q1", "a1"), ("q2", "a2")]
    assert dialogue(_conv(("gpt", "starts with an answer"), ("human", "q"))) == []


def _words(texts: list[str]) -> list[int]:
    return [len(t.split()) for t in texts]


async def _count(texts: list[str]) -> list[int]:
    return _words(texts)


def test_sessions_cap_output_and_drop_turns_past_the_prompt_cap() -> None:
    w = " ".join(["w"] * 10)
    records = [_conv(("human", w), ("gpt", w * 3), ("human", w), ("gpt", w), ("human", w),
                     ("gpt", w)),
               _conv(("human", "too short"), ("gpt", w))]
    limits = Limits(max_tokens=8, max_prompt_tokens=50, max_model_len=1000, multi_turn=True)
    sessions = asyncio.run(sample_sessions(records, 5, _count, limits, seed=0))
    assert len(sessions) == 1  # the second record's prompt is under 4 tokens
    turns = sessions[0].turns
    assert [t.output_tokens for t in turns] == [8, 8]  # answers of 30 and 10 words, capped
    # Turn 3 would carry 10+6 + 8+6 + 10+6 + 8+6 + 10+6 = 76 > 50 tokens of prompt.
    assert len(turns) == 2
    single = Limits(max_tokens=8, max_prompt_tokens=50, max_model_len=1000, multi_turn=False)
    assert len(asyncio.run(sample_sessions(records, 5, _count, single, 0))[0].turns) == 1


def test_poisson_arrivals_have_the_requested_rate() -> None:
    times = arrival_times(4000, rate=4.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and abs(statistics.mean(gaps) - 0.25) < 0.02
    assert arrival_times(3, float("inf"), 0) == [0.0, 0.0, 0.0]


def test_percentiles_interpolate_like_numpy() -> None:
    assert percentile([1.0], 99) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert abs(percentile(list(map(float, range(101))), 99) - 99.0) < 1e-9
    assert distribution("ttft", []) == {"mean_ttft_ms": None, "median_ttft_ms": None,
                                        "p99_ttft_ms": None}
    assert distribution("ttft", [0.1, 0.3])["median_ttft_ms"] == 200.0
