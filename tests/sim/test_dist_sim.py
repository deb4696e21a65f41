"""Infinite-LLM's simulator: spreading, accounting, hybrid-aware moves, vLLM-S's TP cost."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.sim import distattn
from kvserve.sim.cost import kv_budget
from kvserve.sim.distattn import DistConfig, DistSim, Pricer, summary
from kvserve.sim.gpus import get_gpu
from kvserve.sim.models import get_model
from kvserve.sim.traces import TraceRequest

CHUNK = 256


def _small(model_name: str, kv_bytes: int, **kw) -> DistConfig:
    """H100s with only ~kv_bytes of KV pool each, so that a few thousand tokens fill one."""
    model, h100 = get_model(model_name), get_gpu("h100")
    have = kv_budget(model, h100, fp8_weights=False, max_num_batched_tokens=CHUNK,
                     max_num_seqs=256, utilization=0.9).kv
    gpu = dataclasses.replace(h100, memory_bytes=int(h100.memory_bytes - (have - kv_bytes) / 0.9))
    return DistConfig(model, gpu, chunk_tokens=CHUNK, move_blocks=8, heartbeat_s=0.01, **kw)


def _run_checked(cfg: DistConfig, trace: list[TraceRequest]) -> DistSim:
    """Run, checking the block accounting after every step and every event."""
    sim = DistSim(cfg, trace)
    step, at = sim._step, sim._at

    def checked_step(inst):
        step(inst)
        distattn.check(sim)

    def checked_at(t, fn):
        def run(now):
            fn(now)
            distattn.check(sim)
        at(t, run)

    sim._step, sim._at = checked_step, checked_at  # type: ignore[method-assign]
    sim.run()
    return sim


def _trace() -> list[TraceRequest]:
    """One request longer than any single pool among short ones."""
    short = [TraceRequest(f"s{i}", 0.001 * i, 30, 200 + 40 * i) for i in range(12)]
    return [TraceRequest("long", 0.0, 40, 3000)] + short


def test_a_request_longer_than_a_pool_completes_spread_and_multi_rejects_it():
    cfg = _small("llama-3.1-8b", 48 << 21, gpus=4)  # 48 blocks of 2 MiB = 768 tokens each
    sim = _run_checked(cfg, _trace())
    pool = sim.insts[0].total
    assert pool * cfg.tokens_per_block < 3040  # the long request fits no single pool
    long = next(r for r in sim.reqs if r.id == "long")
    assert long.finish is not None and long.rejected is None
    s = summary(sim.res)
    assert s["finished"] == 13 and s["max_spread"] >= 3  # 3040 tokens over >= 3 pools
    assert s["forced_moves"] > 0 and s["moved_bytes"] > 0
    # nothing left anywhere after the run
    assert all(i.used == 0 and not i.hosted and i.reserved == 0 for i in sim.insts)

    multi = _run_checked(dataclasses.replace(cfg, mode="multi"), _trace())
    m = summary(multi.res)
    assert m["rejected"] == 1 and m["finished"] == 12
    assert next(r for r in multi.reqs if r.id == "long").rejected


def test_single_holds_it_on_all_gpus_and_pays_tp():
    cfg = _small("llama-3.1-8b", 48 << 21, gpus=4, mode="single")
    sim = _run_checked(cfg, _trace())
    assert summary(sim.res)["finished"] == 13 and len(sim.insts) == 1
    assert sim.insts[0].pricer.tp == 4


def test_hybrid_moves_fewer_bytes_than_all_layers():
    """Gemma 3 12B: 8 of 48 layers are full attention (a 16-token block of them is
    1 MiB); the 40 sliding layers' windows (320 MiB a request at most) stay home.
    Spreading all 48 layers' KV instead fills pools 6x faster and moves far more."""
    trace = [TraceRequest("long", 0.0, 20, 5000)]
    trace += [TraceRequest(f"s{i}", 0.001 * i, 20, 100 + 20 * i) for i in range(6)]
    base = _small("gemma-3-12b", 600 << 20, gpus=4)
    hybrid = summary(_run_checked(base, trace).res)
    every = summary(_run_checked(dataclasses.replace(base, hybrid=False), trace).res)
    assert hybrid["finished"] == every["finished"] == 7
    assert 0 < hybrid["moved_bytes"] < every["moved_bytes"]
    # the same blocks, had every layer been moved: 48 / 8 times the bytes
    assert hybrid["all_layer_bytes"] == 6 * hybrid["moved_bytes"]
    assert every["all_layer_bytes"] == every["moved_bytes"]


def test_tp8_non_attention_per_gpu_is_a_third_of_one_gpu():
    """vLLM-S's assumption, calibrated on Infinite-LLM's Fig. 1(c)."""
    cfg = DistConfig(get_model("llama-3.1-8b"), get_gpu("h100"))
    one, tp8 = Pricer(cfg, 1), Pricer(cfg, 8)
    per_gpu = (256 / tp8.seconds(256, 256, 0, 0) / 8) / (256 / one.seconds(256, 256, 0, 0))
    assert per_gpu == pytest.approx(1 / 3, rel=0.1)


def test_a_creditor_pays_for_the_attention_it_hosts():
    """Eq. 6: a creditor's step grows by the attention over the blocks it holds, and the
    debtor's decode waits for that shard."""
    cfg = _small("llama-3.1-8b", 48 << 21, gpus=2)
    sim = DistSim(cfg, [])
    d, c = sim.insts
    r = distattn.Req(TraceRequest("x", 0.0, 10, 1000), home=d.name, computed=1000)
    r.blocks = {d.name: 10, c.name: 50}
    shards: dict[str, float] = {}
    sim._attention(d, r, 1, shards)
    assert c.pending_bytes == pytest.approx(50 * 16 * 32 * 4096 + 32 * 4096)
    assert shards[c.name] == pytest.approx(c.pricer.attn_seconds(c.pending_bytes,
                                                                 c.pending_flops))


def test_long_mix_has_table_1_shapes():
    from kvserve.sim.traces import load_trace

    trace = load_trace("long-mix:n=3000,long_frac=0.2,long_max=2000000")
    total = {r.id: r.prompt_len + r.output_len for r in trace}
    short = [n for k, n in total.items() if k.startswith("s")]
    long = [n for k, n in total.items() if k.startswith("L")]
    assert 0.17 < len(long) / len(trace) < 0.23
    assert max(short) <= 60_000 and 800 < sum(short) / len(short) < 2_000  # trace 0: 1233
    assert max(long) <= 2_000_000 and 430_000 < sum(long) / len(long) < 570_000  # 498,609
    assert all(r.arrival == 0.0 for r in trace)
    assert [r.prompt_len for r in trace] == [r.prompt_len for r in load_trace(
        "long-mix:n=3000,long_frac=0.2,long_max=2000000")]
