"""/metrics: parses as Prometheus text; gauges, counters and histograms move with traffic."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL, LiveServer

EXPECTED = {
    "kvserve_num_requests_running": "gauge",
    "kvserve_num_requests_waiting": "gauge",
    "kvserve_kv_used_bytes": "gauge",
    "kvserve_kv_evictable_bytes": "gauge",
    "kvserve_kv_free_bytes": "gauge",
    "kvserve_kv_wasted_bytes": "gauge",
    "kvserve_kv_pool_bytes": "gauge",
    "kvserve_prefix_cache_queried_tokens": "counter",
    "kvserve_prefix_cache_hit_tokens": "counter",
    "kvserve_num_preemptions": "counter",
    "kvserve_prompt_tokens": "counter",
    "kvserve_generation_tokens": "counter",
    "kvserve_time_to_first_token_seconds": "histogram",
    "kvserve_time_per_output_token_seconds": "histogram",
    "kvserve_e2e_request_latency_seconds": "histogram",
}


def _families(server: LiveServer) -> dict:
    resp = httpx.get(f"{server.base_url}/metrics", timeout=60)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(resp.text)}


def test_metrics_parse_with_the_expected_families(server: LiveServer) -> None:
    fams = _families(server)
    for name, kind in EXPECTED.items():
        assert name in fams and fams[name].type == kind, name
    layer_types = {s.labels["layer_type"] for s in fams["kvserve_kv_free_bytes"].samples}
    assert layer_types == {"full", "sliding", "unassigned"}
    used_types = {s.labels["layer_type"] for s in fams["kvserve_kv_used_bytes"].samples}
    assert used_types == {"full", "sliding"}
    assert fams["kvserve_kv_pool_bytes"].samples[0].value > 0


def test_counters_and_histograms_move_with_a_request(server: LiveServer, client) -> None:
    def value(m: dict, name: str) -> float:
        return m[(name, ())]

    before = server.metrics()
    out = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    after = server.metrics()
    delta = {name: value(after, name) - value(before, name) for name in (
        "kvserve_prompt_tokens_total", "kvserve_generation_tokens_total",
        "kvserve_prefix_cache_queried_tokens_total", "kvserve_time_to_first_token_seconds_count",
        "kvserve_e2e_request_latency_seconds_count",
        "kvserve_time_per_output_token_seconds_count")}
    assert delta == {
        "kvserve_prompt_tokens_total": out.usage.prompt_tokens,
        "kvserve_generation_tokens_total": 3,
        "kvserve_prefix_cache_queried_tokens_total": out.usage.prompt_tokens,
        "kvserve_time_to_first_token_seconds_count": 1,
        "kvserve_e2e_request_latency_seconds_count": 1,
        "kvserve_time_per_output_token_seconds_count": 1,
    }
    total = sum(v for (name, _), v in after.items()
                if name in ("kvserve_kv_free_bytes", "kvserve_kv_used_bytes",
                            "kvserve_kv_evictable_bytes"))
    assert total == value(after, "kvserve_kv_pool_bytes")  # every byte is accounted for


def test_host_tier_families_count_what_moved(kv, serve_engine) -> None:
    """With --host-kv-memory: host bytes per layer type and the swap counters, moving as a
    prompt evicted from a one-prompt pool comes back from the host tier."""
    from kvserve.engine.engine import EngineConfig, LLMEngine

    prompts = [f"Story {i}: " + "the harbour master counted ships " * 50 for i in range(3)]
    engine = LLMEngine(kv.model, kv.tokenizer,
                       EngineConfig(kv_memory=16 << 20, host_kv_memory=64 << 20))
    with serve_engine(engine) as server, httpx.Client(timeout=120) as http:
        for p in [*prompts, prompts[0]]:
            http.post(f"{server.base_url}/v1/completions",
                      json={"model": MODEL, "prompt": p, "max_tokens": 1}).raise_for_status()
        fams = _families(server)
        m = server.metrics()
    assert fams["kvserve_host_kv_bytes"].type == "gauge"
    assert {s.labels["layer_type"] for s in fams["kvserve_host_kv_bytes"].samples} == \
        {"full", "sliding"}
    assert m[("kvserve_kv_swap_out_pages_total", ())] > 0
    assert m[("kvserve_kv_swap_in_bytes_total", ())] > 0
    assert m[("kvserve_prefix_cache_host_hit_tokens_total", ())] > 0
    # whole large pages of the layout, at most what was asked
    assert m[("kvserve_host_kv_pool_bytes", ())] == engine.kv.host.pool_bytes <= 64 << 20
    assert "kvserve_host_kv_bytes" not in _families_of_plain(kv)


def _families_of_plain(kv) -> set[str]:
    """A server without a host tier shows none of its families."""
    from kvserve.engine.engine import EngineConfig, LLMEngine
    from kvserve.server.engine_loop import EngineSnapshot
    from kvserve.server.metrics import ServerMetrics

    engine = LLMEngine(kv.model, kv.tokenizer, EngineConfig(kv_memory=16 << 20))
    snap = EngineSnapshot(0, 0, engine.kv.stats(), 0, 0, 0)
    text = ServerMetrics().render(snap).decode()
    return {f.name for f in text_string_to_metric_families(text)}
