"""`kvserve bench serve` against the live server, on a handful of ShareGPT prompts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from server_harness import LiveServer

from kvserve.bench import cli

FIELDS = [
    "date", "model", "num_requests", "completed", "failed", "duration_s", "request_throughput",
    "output_throughput", "total_token_throughput", "prefix_cache_hit_rate",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "p99")),
    "requests",
]


def _run(server: LiveServer, out: Path, *extra: str) -> dict:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([
        "serve", "--base-url", server.base_url, "--dataset", "sharegpt", "--max-tokens", "3",
        "--max-prompt-tokens", "256", "--seed", "1", "--no-progress", "--output", str(out),
        *extra])
    cli.main(args)
    return json.loads(out.read_text())


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_bench_serve_writes_a_complete_report(server: LiveServer, tmp_path: Path,
                                              multi_turn: bool) -> None:
    extra = ["--multi-turn", "--num-prompts", "2"] if multi_turn else ["--num-prompts", "3"]
    report = _run(server, tmp_path / "run.json", "--request-rate", "inf", *extra)
    for name in FIELDS:
        assert name in report, name
    assert report["failed"] == 0 and report["errors"] == []
    assert report["completed"] == report["num_requests"] == len(report["requests"])
    assert report["total_output_tokens"] == sum(r["output_tokens"] for r in report["requests"])
    assert all(r["output_tokens"] <= 3 and r["ttft_s"] > 0 for r in report["requests"])
    assert report["median_ttft_ms"] > 0 and report["output_throughput"] > 0
    assert 0 <= report["prefix_cache_hit_rate"] <= 1
    if multi_turn:
        assert report["num_sessions"] == 2
        later = [r for r in report["requests"] if r["turn"] > 0]
        # A later turn resends the history, which the prefix cache holds.
        assert later and all(r["cached_tokens"] > 0 for r in later)
        assert report["prefix_cache_hit_rate"] > 0
