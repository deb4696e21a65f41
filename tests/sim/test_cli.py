"""`kvserve sim` through its add_arguments / main, as the top-level CLI wires it."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve.sim import cli


def _run(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    cli.main(p.parse_args(argv))


def test_main_writes_json_and_plots(tmp_path, capsys) -> None:
    out, plots = tmp_path / "out.json", tmp_path / "plots"
    _run(["--model", "gemma-3-12b", "--gpu", "h100", "--policy", "all",
          "--trace", "decode20:n=3,lo=2000,hi=3000,out_lo=5,out_hi=10",
          "--max-model-len", "8192", "--json", str(out), "--plot", str(plots)])
    data = json.loads(out.read_text())
    runs = {r["summary"]["policy"]: r for r in data["runs"]}
    assert set(runs) == {"jenga", "uniform", "max_page", "static", "vllm_align"}
    for r in runs.values():
        assert r["summary"]["finished"] == 3
        assert len(r["steps"]["decode"]) == r["summary"]["steps"] == len(r["memory"]["t"])
        for col in r["memory"]["specs"].values():
            assert len(col["used"]) == len(r["memory"]["t"])
    assert set(runs["jenga"]["memory"]["specs"]) == {"full", "sliding"}
    assert set(runs["uniform"]["memory"]["specs"]) == {"uniform"}
    for name in ("decode_batch.png", "memory.png", "summary.png"):
        assert (plots / name).read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "jenga" in printed and "uniform" in printed


def test_saved_trace_replays_identically(tmp_path) -> None:
    trace, a, b = tmp_path / "t.jsonl", tmp_path / "a.json", tmp_path / "b.json"
    common = ["--model", "llama-3.2-11b-vision", "--gpu", "l4", "--max-model-len", "4096"]
    _run([*common, "--trace", "mmmu:n=4", "--save-trace", str(trace), "--json", str(a)])
    _run([*common, "--trace", str(trace), "--json", str(b)])
    sa, sb = (json.loads(p.read_text())["runs"][0]["summary"] for p in (a, b))
    assert sa == sb and sa["finished"] == 4


def test_policy_lists() -> None:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    base = ["--model", "ministral-8b", "--trace", "decode20"]
    assert p.parse_args([*base, "--policy", "uniform,jenga"]).policy == ["uniform", "jenga"]
    assert len(p.parse_args([*base, "--policy", "all"]).policy) == 5
    with pytest.raises(SystemExit):
        p.parse_args([*base, "--policy", "jenga,paged"])


def test_fp8_follows_the_paper_table() -> None:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    args = p.parse_args(["--model", "ministral-8b", "--gpu", "l4", "--trace", "decode20"])
    assert cli._config(args, "jenga").fp8_weights  # Table 1: 8B* on L4
    args = p.parse_args(["--model", "ministral-8b", "--gpu", "h100", "--trace", "decode20"])
    assert not cli._config(args, "jenga").fp8_weights
    args = p.parse_args(["--model", "ministral-8b", "--trace", "x", "--fp8", "weights+kv"])
    cfg = cli._config(args, "jenga")
    assert cfg.fp8_weights and cfg.kv_dtype_bytes == 1
