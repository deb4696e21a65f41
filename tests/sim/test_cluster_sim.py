"""The simulated cluster: the real global scheduler and designs over simulated instances."""

from __future__ import annotations

import argparse
import json

import pytest
from sim_helpers import chat, small_config

from kvserve.cluster.prompt_tree import block_hashes
from kvserve.sim import cli
from kvserve.sim.cluster import ClusterConfig, ClusterSim, simulate_cluster
from kvserve.sim.cluster_metrics import summary, to_json
from kvserve.sim.network import GBIT, Network, NetworkConfig
from kvserve.sim.traces import TraceRequest, doc_qa

LLAMA, GEMMA = "llama-3.1-8b", "gemma-3-12b"
T = 16


def config(design: str, routing: str = "prompt-tree", instances: int = 4, model: str = LLAMA,
           kv_mib: int = 2048, **kw) -> ClusterConfig:
    return ClusterConfig(small_config(model, "jenga", kv_mib=kv_mib, max_model_len=8192,
                                      mem_every=0),
                         instances=instances, design=design, routing=routing, **kw)


def page_bytes(sim: ClusterSim) -> dict[str, int]:
    layout = next(iter(sim.nodes.values())).sim.kv.layout
    return {s.name: b for s, b in zip(layout.specs, layout.page_bytes)}


def test_the_same_trace_gives_the_same_run() -> None:
    cfg = config("pd-caching-3", instances=4, prefill=2)
    a, b = (to_json(simulate_cluster(chat(), cfg)) for _ in range(2))
    assert a == b
    assert a["summary"]["finished"] == 24


def test_a_disaggregated_run_accounts_for_every_token_and_second() -> None:
    cfg = config("pd-basic", "least-load", instances=4, prefill=2)
    trace = chat()
    sim = ClusterSim(cfg, trace)
    res = sim.run()
    s = summary(res)
    assert s["finished"] == len(trace) and s["hit_rate"] == 0.0
    per = s["per_instance"]
    # P computes every prompt (pd-basic caches nothing) and samples its first token
    assert sum(i["prefill_tokens"] for i in per.values() if i["role"] == "prefill") == sum(
        r.prompt_len for r in trace)
    # D imports the prompt's full blocks, recomputes the last partial one and the first
    # token, then decodes the rest one token a step
    full = {r.id: r.prompt_len // T * T for r in trace}
    assert all(j.decode_cached == full[j.id] for j in res.jobs)
    assert sum(i["prefill_tokens"] for i in per.values() if i["role"] == "decode") == sum(
        r.prompt_len + 1 - full[r.id] for r in trace)
    assert sum(i["decode_tokens"] for i in per.values()) == sum(r.output_len - 2 for r in trace)
    kv_bytes = sum(page_bytes(sim).values())
    lat, bw = cfg.network.latency, cfg.network.bandwidth
    for j in res.jobs:
        assert j.prompt_bytes == j.tr.prompt_len // T * kv_bytes
        assert j.arrival < j.first_token < j.finish
        assert j.finish - j.first_token >= lat + j.prompt_bytes / bw
    # pd-basic deletes what it computed on both sides
    assert all(not n.sim.kv.cached_keys()["device"] for n in sim.nodes.values())


def test_a_sessions_next_turn_waits_for_the_answer_and_the_think_time() -> None:
    trace = chat(gap=2.0)
    res = simulate_cluster(trace, config("colocated"))
    jobs = {j.id: j for j in res.jobs}
    for s in range(6):
        for k in range(1, 4):
            prev, cur = jobs[f"s{s}t{k - 1}"], jobs[f"s{s}t{k}"]
            assert cur.arrival == pytest.approx(prev.finish + 2.0)


def test_returning_the_turn_to_prefill_hits_more_than_the_lower_designs() -> None:
    hits, moved = {}, {}
    for design in ("pd-basic", "pd-caching-1", "pd-caching-2", "pd-caching-3"):
        s = summary(simulate_cluster(chat(), config(design, "session", prefill=2)))
        hits[design], moved[design] = s["hit_rate"], s["bytes_by_kind"]
    assert hits["pd-basic"] == 0.0
    assert 0.0 < hits["pd-caching-1"] == hits["pd-caching-2"] < hits["pd-caching-3"]
    assert "return" in moved["pd-caching-3"] and "return" not in moved["pd-caching-2"]
    # D keeping the conversation means P sends it only the new message
    assert moved["pd-caching-2"]["prompt"] < moved["pd-caching-1"]["prompt"] / 2


def test_prompt_tree_routing_beats_session_routing_across_sessions() -> None:
    trace = doc_qa(docs=6, questions=3, share=2, doc_lo=1000, doc_hi=2000, rate=0.5, seed=1)
    hit = {r: summary(simulate_cluster(trace, config("colocated", r)))["hit_rate"]
           for r in ("session", "prompt-tree")}
    assert hit["prompt-tree"] > hit["session"] + 0.05


def test_bytes_moved_are_what_the_memory_core_holds() -> None:
    """One prompt four times: pd-basic sends it every time, pd-caching-2 once (D keeps it)."""
    prompt = list(range(1, 1001))
    trace = [TraceRequest(f"r{i}", 10.0 * i, 8, prompt_ids=prompt) for i in range(4)]
    sent = {}
    for design in ("pd-basic", "pd-caching-2"):
        sim = ClusterSim(config(design, instances=2), trace)
        res = sim.run()
        sent[design] = [j.prompt_bytes for j in res.jobs]
        once = 1000 // T * sum(page_bytes(sim).values())
    assert sent["pd-basic"] == [once] * 4
    assert sent["pd-caching-2"] == [once, 0, 0, 0]


def test_a_hybrid_model_moves_only_the_sliding_window_of_its_sliding_layers() -> None:
    n, window = 4000, 1024  # Gemma 3: window 1024 on 40 of 48 layers
    sim = ClusterSim(config("pd-basic", instances=2, model=GEMMA, kv_mib=4096),
                     [TraceRequest("r", 0.0, 8, prompt_ids=list(range(1, n + 1)))])
    res = sim.run()
    moved = res.network.transfers[0]
    pb = page_bytes(sim)
    full_pages = n // T
    sliding_pages = (moved.nbytes - full_pages * pb["full"]) / pb["sliding"]
    assert sliding_pages == int(sliding_pages)
    assert window // T <= sliding_pages <= window // T + 1
    assert moved.nbytes < 0.4 * full_pages * sum(pb.values())  # every block: 2.6x more
    assert res.jobs[0].decode_cached == n // T * T  # and D hits all of it


def test_kv_events_make_the_prefill_tree_exact() -> None:
    trace = chat(sessions=2, turns=2)
    sim = ClusterSim(config("pd-caching-1", prefill=2, heartbeat_s=0.5, ttl=1.0), trace)
    sim.run()
    owner = next(j.prefill for j in sim.jobs if j.id == "s0t0")
    hashes = block_hashes(trace[0].prompt_ids, T)
    # learnt entries expired long ago (ttl 1 s); what the events reported does not
    assert sim.sched.trees["prefill"].match(hashes, 1e9)[owner] == len(hashes)


def test_transfers_queue_on_the_nics() -> None:
    net = Network(NetworkConfig(bandwidth=8 * GBIT, latency=0.001))  # 1 GB/s
    assert net.send("prompt", "p0", "d0", 10**9, 0.0) == pytest.approx(1.001)
    assert net.send("prompt", "p0", "d1", 10**9, 0.5) == pytest.approx(2.001)  # p0 busy
    assert net.send("return", "d1", "p1", 10**9, 0.5) == pytest.approx(1.501)  # other NICs
    assert net.send("prompt", "p0", "d0", 0, 0.5) == pytest.approx(0.501)  # metadata only
    assert net.bytes_by_kind() == {"prompt": 2 * 10**9, "return": 10**9}


def test_cli_runs_designs_side_by_side(tmp_path, capsys) -> None:
    out = tmp_path / "c.json"
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    cli.main(p.parse_args([
        "--model", LLAMA, "--trace", "doc-qa:docs=3,questions=2,doc_lo=500,doc_hi=900",
        "--max-model-len", "4096", "--instances", "2", "--design", "colocated,pd-caching-3",
        "--routing", "session", "--network-gbps", "100", "--json", str(out)]))
    runs = json.loads(out.read_text())["runs"]
    assert [r["summary"]["design"] for r in runs] == ["colocated", "pd-caching-3"]
    assert all(r["summary"]["finished"] == 12 for r in runs)
    assert runs[1]["summary"]["network_gbps"] == 100
    printed = capsys.readouterr().out
    assert "pd-caching-3" in printed and "1P+1D" in printed and "2C" in printed
