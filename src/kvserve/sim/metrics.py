"""Summary metrics of a simulated run, and its JSON form.

Averages over memory samples are weighted by simulated busy time (a sample
stands for the steps until the next one), since a long prefill step and a
short decode step should not count the same on a memory timeline; the
per-step averages are given next to them.
"""

from __future__ import annotations

from kvserve.sim.simulator import MemSample, SimResult


def summary(res: SimResult) -> dict:
    cfg = res.config
    done = [r for r in res.requests if r.finish is not None]
    admitted = [r for r in res.requests if r.rejected is None]
    clock = res.clock
    generated = sum(r.output_len for r in done)
    prompt = sum(r.prompt_len for r in admitted)
    decode_steps = [s.decode for s in res.steps if s.decode]
    ttfts = sorted(r.first_token - r.arrival for r in done if r.first_token)
    return {
        "model": cfg.model.name,
        "gpu": cfg.gpu.name,
        "tp": cfg.tp,
        "policy": cfg.policy,
        "kv_pool_bytes": res.pool_bytes,
        "requests": len(res.requests),
        "finished": len(done),
        "rejected": sum(r.rejected is not None for r in res.requests),
        "steps": len(res.steps),
        "sim_seconds": clock,
        "output_tokens_per_s": generated / clock if clock else 0.0,
        "total_tokens_per_s": (generated + prompt) / clock if clock else 0.0,
        "requests_per_s": len(done) / clock if clock else 0.0,
        "mean_latency_s": mean([r.finish - r.arrival for r in done]),
        "mean_ttft_s": mean(ttfts),
        "p50_ttft_s": quantile(ttfts, 0.5),
        "p99_ttft_s": quantile(ttfts, 0.99),
        "avg_decode_batch": mean(decode_steps),
        "decode_steps": len(decode_steps),
        "hit_rate": sum(r.cached_tokens for r in admitted) / prompt if prompt else 0.0,
        "lookup_hit_rate": res.hit_tokens / res.queried_tokens if res.queried_tokens else 0.0,
        "preemptions": res.preemptions,
        "waste_of_held": _time_avg(res, lambda m: m.stats.waste_fraction),
        "waste_of_pool": _time_avg(res, lambda m: m.stats.waste / m.stats.pool_bytes),
        "held_of_pool": _time_avg(res, _held_fraction),
        # The same waste averaged with every sampled step weighing the same.
        "waste_of_held_per_step": mean([m.stats.waste_fraction for m in res.memory]),
        "need_share": need_share(res),
        **_host_summary(res),
    }


def quantile(ordered: list[float], q: float) -> float:
    """Nearest-rank quantile of sorted values (0 for none)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _host_summary(res: SimResult) -> dict:
    """The host tier's share of the hits and what crossed PCIe (absent without one)."""
    h = res.host
    if h is None:
        return {}
    return {"host_bytes": h.pool_bytes, "host_hit_tokens": h.hit_tokens,
            "host_hit_share": h.hit_tokens / res.hit_tokens if res.hit_tokens else 0.0,
            "swap_in_bytes": h.bytes_in, "swap_out_bytes": h.bytes_out,
            "swap_seconds": res.swap_seconds}


def need_share(res: SimResult) -> dict[str, list[float]]:
    """Per layout spec, [min, max] over samples of its share of the bytes the requests need."""
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    for m in res.memory:
        total = m.stats.ideal
        if not total:
            continue
        for s in m.stats.specs:
            share = s.ideal / total
            lo[s.name] = min(lo.get(s.name, 1.0), share)
            hi[s.name] = max(hi.get(s.name, 0.0), share)
    return {name: [lo[name], hi[name]] for name in lo}


def _held_fraction(m: MemSample) -> float:
    st = m.stats
    return sum(s.used + s.empty for s in st.specs) / st.pool_bytes


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _time_avg(res: SimResult, f) -> float:
    """Mean of f over memory samples, each weighted by the busy time of the steps it stands for.

    Idle gaps between arrivals are left out: nothing runs there, and the
    leftover cache would otherwise dominate a lightly loaded run.
    """
    mem = res.memory
    if not mem:
        return 0.0
    bounds = [m.step for m in mem[1:]] + [len(res.steps)]
    weights = [sum(s.dt for s in res.steps[m.step:end]) for m, end in zip(mem, bounds)]
    total = sum(weights)
    if total == 0:
        return mean([f(m) for m in mem])
    return sum(w * f(m) for w, m in zip(weights, mem)) / total


SPEC_FIELDS = ("used", "ideal", "waste", "evictable", "empty")


def memory_series(res: SimResult) -> dict:
    """Columns per memory sample: time, free bytes, and per spec used/ideal/waste/cache."""
    names = [s.name for s in res.memory[0].stats.specs] if res.memory else []
    specs: dict = {n: {k: [] for k in SPEC_FIELDS} for n in names}
    for m in res.memory:
        for s in m.stats.specs:
            for k in SPEC_FIELDS:
                specs[s.name][k].append(getattr(s, k))
    return {"t": [m.t for m in res.memory], "step": [m.step for m in res.memory],
            "pool": res.pool_bytes, "free": [m.stats.free for m in res.memory], "specs": specs}


def step_series(res: SimResult) -> dict:
    cols = ("t", "dt", "tokens", "decode", "prefill_tokens", "running", "waiting")
    return {c: [getattr(s, c) for s in res.steps] for c in cols}


def to_json(res: SimResult) -> dict:
    cfg = res.config
    return {
        "summary": summary(res),
        "config": {
            "model": cfg.model.name, "gpu": cfg.gpu.name, "policy": cfg.policy, "tp": cfg.tp,
            "tokens_per_page": cfg.tokens_per_page, "max_num_seqs": cfg.max_num_seqs,
            "max_model_len": cfg.model_len, "max_num_batched_tokens": cfg.batched_tokens,
            "gpu_utilization": cfg.gpu_utilization, "fp8_weights": cfg.fp8_weights,
            "kv_dtype_bytes": cfg.kv_dtype_bytes, "mem_every": cfg.mem_every,
        },
        "budget": res.budget.as_dict(),
        "steps": step_series(res),
        "memory": memory_series(res),
        "requests": [vars(r) for r in res.requests],
    }
