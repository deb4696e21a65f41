"""KV memory given back: --kv-idle-release-s, the EngineLoop's idle wake-up, /metrics,
under both backends.

The real Gemma 3 270M (session fixture). Physical bytes are the memfd's
allocated blocks (vtensor: `stats()["physical_bytes"]`, paged: the pool's
`physical_bytes()`); the process's RssShmem counts the same pages while they
are mapped, so it falls with them (RssAnon moves with torch's allocator and is
not asserted on). The pools' clock is replaced by a fake one (vtensor) or the
engine is handed the time (paged) where a test needs "idle for that long"
without sleeping.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time

import pytest
from hf_reference import ledger_text
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.engine import DEFAULT_IDLE_RELEASE_S, EngineConfig, LLMEngine
from kvserve.engine.request import InvalidRequest, SamplingParams
from kvserve.entrypoints.model_args import add_model_arguments, model_config
from kvserve.physical.share import KVShare
from kvserve.server.engine_loop import EngineLoop, Submission
from kvserve.server.metrics import ServerMetrics

MiB = 1 << 20
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class FakeClock:
    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def prompt(kv) -> list[int]:
    return kv.tokenizer(ledger_text(20)).input_ids[:200]  # the core hits 192: 6 whole chunks


def vtensor_engine(kv, idle_s: float, **kw) -> LLMEngine:
    cfg = EngineConfig(kv_memory=64 * MiB, kv_backend="vtensor", kv_idle_release_s=idle_s, **kw)
    return LLMEngine(kv.model, kv.tokenizer, cfg)


def run(engine: LLMEngine, rid: str, prompt: list[int]) -> int:
    """Run one request to completion; returns the highest physical bytes seen between steps."""
    engine.add_request(rid, {"prompt_token_ids": prompt}, PARAMS)
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.runner.attn.stats()["physical_bytes"])
    return peak


def rss_shmem() -> int:
    """Resident shared memory of this process (memfd pages it maps), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def test_memory_stays_until_idle_then_goes_back(kv, prompt):
    engine = vtensor_engine(kv, idle_s=30.0)
    attn, clock = engine.runner.attn, FakeClock()
    for pool in attn.pools:
        pool.clock = clock
    assert attn.stats()["physical_bytes"] == 0
    peak = run(engine, "a", prompt)
    assert peak >= len(prompt) * kv.config.num_hidden_layers * 2048  # K+V, 2 KiB a token
    held = attn.stats()["physical_bytes"]
    assert held > 0  # released lazily: kept for the next turn

    clock.now += 10  # not idle long enough: the next turn still hits the vTensor prefix
    assert engine.maybe_release_idle(clock.now) == 0
    shmem_before = rss_shmem()
    run(engine, "b", prompt)
    assert attn.recomputed_tokens == 0

    clock.now += 31
    punched = engine.maybe_release_idle(clock.now + 100)
    assert punched >= held
    stats = attn.stats()
    assert stats["physical_bytes"] == 0 and stats["referenced_bytes"] == 0
    assert rss_shmem() <= shmem_before - held // 2  # the mapped pages left the process
    assert engine.maybe_release_idle(clock.now + 100.001) == 0  # rate-limited: idle_s / 4

    run(engine, "c", prompt)  # the price of giving back: the core's hit is recomputed
    assert attn.recomputed_tokens == 192


@pytest.mark.parametrize("backend", ["vtensor", "paged"])
def test_engine_loop_gives_idle_memory_back(kv, prompt, backend):
    """Idle, the loop wakes every idle_s / 4 and trims; /metrics shows it."""
    cfg = EngineConfig(kv_memory=64 * MiB, kv_backend=backend, kv_idle_release_s=0.05)
    engine = LLMEngine(kv.model, kv.tokenizer, cfg)
    physical = {"vtensor": "kvserve_vtensor_physical_bytes",
                "paged": "kvserve_kv_physical_bytes"}[backend]
    metrics = ServerMetrics()
    loop = EngineLoop(engine, metrics)

    async def scenario() -> list[dict[str, float]]:
        group = await loop.add([Submission("a", prompt, None, PARAMS)], time.monotonic())
        async for _ in group.outputs():
            pass
        seen = [gauges(metrics, await loop.snapshot())]
        deadline = time.monotonic() + 10
        while seen[-1][physical] and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            seen.append(gauges(metrics, await loop.snapshot()))
        return seen

    loop.start()
    try:
        seen = asyncio.run(scenario())
    finally:
        loop.stop()
    assert seen[0][physical] > 0 and seen[-1][physical] == 0
    if backend == "paged":
        assert engine.kv.stats().evictable == 0  # the cache went too: idle past 0.05 s
        return
    assert seen[-1]["kvserve_vtensor_reserved_bytes"] == 0
    assert seen[-1]["kvserve_vtensor_mapped_bytes"] == 0
    assert seen[-1]["kvserve_vtensor_capacity_bytes"] == 64 * MiB


def gauges(metrics: ServerMetrics, snapshot) -> dict[str, float]:
    text = metrics.render(snapshot).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_gauges_under_each_backend(kv, prompt):
    engine = vtensor_engine(kv, idle_s=60.0)
    run(engine, "a", prompt)
    metrics = ServerMetrics()
    vt = gauges(metrics, EngineLoop(engine, metrics)._snapshot())
    stats = engine.runner.attn.stats()
    for key in ("reserved_bytes", "mapped_bytes", "physical_bytes", "referenced_bytes"):
        assert vt[f"kvserve_vtensor_{key}"] == stats[key] > 0, key
    assert vt["kvserve_vtensor_reserved_bytes"] >= vt["kvserve_vtensor_mapped_bytes"]
    attn = engine.runner.attn
    attn.trim()  # the core still holds the prefix, the vTensor not: its hit is recomputed
    run(engine, "b", prompt)
    vt = gauges(metrics, EngineLoop(engine, metrics)._snapshot())
    assert vt["kvserve_vtensor_recomputed_tokens_total"] == attn.recomputed_tokens == 192
    assert "kvserve_kv_physical_bytes" not in vt
    paged = LLMEngine(kv.model, kv.tokenizer, EngineConfig(kv_memory=64 * MiB))
    assert paged.idle_poll_s() == DEFAULT_IDLE_RELEASE_S / 4
    generate(paged, "a", prompt)
    plain = gauges(metrics, EngineLoop(paged, metrics)._snapshot())
    assert not any(name.startswith("kvserve_vtensor_") for name in plain)
    assert plain["kvserve_kv_physical_bytes"] == paged.runner.pool.physical_bytes() > 0
    assert plain["kvserve_kv_pool_bytes"] == paged.kv.pool_bytes


def generate(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """Run one request to completion; (its tokens, prompt tokens it found cached)."""
    engine.add_request(rid, {"prompt_token_ids": prompt}, PARAMS)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out.outputs[0].token_ids, out.num_cached_tokens
    raise AssertionError(f"{rid} never finished")


def test_paged_pool_takes_memory_as_written_and_gives_idle_memory_back(kv, prompt):
    engine = LLMEngine(kv.model, kv.tokenizer,
                       EngineConfig(kv_memory=64 * MiB, kv_idle_release_s=60.0))
    pool, t = engine.runner.pool, time.monotonic()
    assert pool.physical_bytes() == 0 < engine.kv.pool_bytes  # a ceiling, not a reservation
    first, cached = generate(engine, "a", prompt)
    assert cached == 0
    engine.maybe_release_idle(t)  # only pages no one holds go; the prefix stays cached
    held, evictable = pool.physical_bytes(), engine.kv.stats().evictable
    assert evictable > 0
    assert held >= len(prompt) // 16 * 16 * 3 * 2048  # at least the full layers' prefix
    shmem = rss_shmem()

    again, cached = generate(engine, "b", prompt)  # 20 s later: a hit
    assert (again, cached) == (first, 192)
    engine.maybe_release_idle(t + 20)  # no poll 60 s old yet: the cache stays
    assert engine.kv.stats().evictable == evictable

    punched = engine.maybe_release_idle(t + 81)  # everything was last used by t + 20
    assert punched >= held and pool.physical_bytes() == 0
    assert rss_shmem() <= shmem - held // 2
    assert engine.kv.stats().evictable == 0
    assert engine.maybe_release_idle(t + 81.001) == 0  # rate-limited: idle_s / 4

    last, cached = generate(engine, "c", prompt)  # the price: recomputed, the same tokens
    assert (last, cached) == (first, 0)
    assert pool.physical_bytes() > 0


def test_paged_pool_never_gives_back_when_told_inf(kv, prompt):
    engine = LLMEngine(kv.model, kv.tokenizer,
                       EngineConfig(kv_memory=64 * MiB, kv_idle_release_s=math.inf))
    generate(engine, "a", prompt)
    held = engine.runner.pool.physical_bytes()
    assert engine.idle_poll_s() is None
    assert engine.maybe_release_idle(time.monotonic() + 1e6) == 0
    assert engine.runner.pool.physical_bytes() == held


def test_vtensor_never_maps_past_the_kv_budget(kv):
    engine = vtensor_engine(kv, idle_s=60.0)
    assert engine.runner.attn.stats()["capacity_bytes"] <= 64 * MiB
    assert engine.kv.pool_bytes < 64 * MiB  # the core admits a share: chunk rounding aside


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, "60", None, True])
def test_bad_idle_release_is_refused(bad):
    with pytest.raises(ValueError, match="kv_idle_release_s must be"):
        EngineConfig(kv_idle_release_s=bad)


def test_idle_release_flag():
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert model_config(parser.parse_args([])).kv_idle_release_s == DEFAULT_IDLE_RELEASE_S
    args = parser.parse_args(["--kv-idle-release-s", "0.5"])
    assert model_config(args).kv_idle_release_s == 0.5
    assert math.isinf(model_config(parser.parse_args(["--kv-idle-release-s", "inf"]))
                      .kv_idle_release_s)
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-idle-release-s", bad])


def test_two_engines_share_one_physical_ceiling(kv, prompt):
    """Two engines (the same model here; any two would do) under one 20 MiB ceiling, each
    allowed 64 MiB alone: steps interleaved, the memory each holds follows its load and
    the tokens are those of an engine alone."""
    share = KVShare(20 * MiB)
    engines = [LLMEngine(kv.model, kv.tokenizer, EngineConfig(
        kv_memory=64 * MiB, kv_share=share, max_num_batched_tokens=128)) for _ in range(2)]
    alone, _ = generate(LLMEngine(kv.model, kv.tokenizer, EngineConfig(kv_memory=64 * MiB)),
                        "alone", prompt)
    a, b = engines
    a.add_request("a0", {"prompt_token_ids": prompt}, PARAMS)
    a.add_request("a1", {"prompt_token_ids": prompt[:150]}, PARAMS)
    got: dict[str, list[int]] = {}
    granted, physical, steps = [], [], 0
    while a.has_unfinished() or b.has_unfinished():
        for e in engines:
            if e.has_unfinished():
                got |= {o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished}
        steps += 1
        if steps == 2:  # b's load arrives while a runs
            b.add_request("b0", {"prompt_token_ids": prompt}, PARAMS)
        granted.append([m.granted_bytes() for m in share.members])
        physical.append(sum(e.runner.pool.physical_bytes() for e in engines))
        assert share.granted_bytes() <= 20 * MiB
    assert got["a0"] == got["b0"] == alone
    assert max(physical) <= 20 * MiB
    assert max(g[0] for g in granted) > 10 * MiB  # a held most of the ceiling...
    assert granted[-1][1] > granted[-1][0]  # ...then b, a's free pages punched on the way
    with pytest.raises(ValueError, match="kv_share needs kv_backend 'paged'"):
        EngineConfig(kv_backend="vtensor", kv_share=share)
    tight = LLMEngine(kv.model, kv.tokenizer, EngineConfig(  # alone it would fit
        kv_memory=64 * MiB, kv_share=KVShare(2 * MiB), max_num_batched_tokens=128))
    with pytest.raises(InvalidRequest, match="than the pool's 2 MiB"):
        tight.add_request("big", {"prompt_token_ids": prompt}, PARAMS)
    assert not tight.requests
