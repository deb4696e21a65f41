"""Summary metrics of a simulated cluster run, and its JSON form.

Latencies are the front end's: from a request's arrival there (a session's turn:
after the previous answer and the think time) to its first token (TTFT, P's
sampled token in a disaggregated design) and to its last (JCT). The prefix hit
rate is the prefill side's, as the single-instance simulator counts it: prompt
tokens found cached at the first admission, over prompt tokens.
"""

from __future__ import annotations

from kvserve.sim.cluster import ClusterResult, Job
from kvserve.sim.metrics import mean, quantile
from kvserve.sim.simulator import SimResult


def summary(res: ClusterResult) -> dict:
    cfg = res.config
    done = [j for j in res.jobs if j.finish is not None]
    jct = sorted(j.finish - j.arrival for j in done)
    ttft = sorted(j.first_token - j.arrival for j in done)
    prompt = sum(j.tr.prompt_len for j in done)
    moved = res.network.bytes_by_kind()
    return {
        "model": cfg.instance.model.name,
        "gpu": cfg.instance.gpu.name,
        "design": cfg.design,
        "routing": cfg.routing,
        "instances": {role: sum(r == role for r, _ in res.instances.values())
                      for role in sorted({r for r, _ in res.instances.values()})},
        "network_gbps": cfg.network.bandwidth * 8 / 1e9,
        "requests": len(res.jobs),
        "finished": len(done),
        "rejected": sum(j.rejected is not None for j in res.jobs),
        "sim_seconds": res.clock,
        "mean_jct_s": mean(jct),
        "p99_jct_s": quantile(jct, 0.99),
        "mean_ttft_s": mean(ttft),
        "p99_ttft_s": quantile(ttft, 0.99),
        "mean_tpot_s": mean([_tpot(j) for j in done if j.max_tokens > 1]),
        "hit_rate": sum(j.cached_tokens for j in done) / prompt if prompt else 0.0,
        "decode_hit_rate": _decode_hits(done),
        "bytes": sum(moved.values()),
        "bytes_by_kind": moved,
        "per_instance": {name: instance_summary(role, r, res.clock)
                         for name, (role, r) in res.instances.items()},
    }


def _tpot(j: Job) -> float:
    return (j.finish - j.first_token) / (j.max_tokens - 1)


def _decode_hits(done: list[Job]) -> float:
    """Tokens the decode instances found cached (imported or kept) over what they read."""
    dis = [j for j in done if j.decode and j.max_tokens > 1]
    total = sum(j.tr.prompt_len + 1 for j in dis)
    return sum(j.decode_cached for j in dis) / total if total else 0.0


def instance_summary(role: str, r: SimResult, clock: float) -> dict:
    """One instance's load: its share of the clock spent stepping, what it computed."""
    decode = [s.decode for s in r.steps if s.decode]
    return {
        "role": role,
        "requests": len(r.requests),
        "busy": sum(s.dt for s in r.steps) / clock if clock else 0.0,
        "steps": len(r.steps),
        "prefill_tokens": sum(s.prefill_tokens for s in r.steps),
        "decode_tokens": sum(decode),
        "avg_decode_batch": mean(decode),
        "lookup_hit_rate": r.hit_tokens / r.queried_tokens if r.queried_tokens else 0.0,
        "preemptions": r.preemptions,
    }


def to_json(res: ClusterResult) -> dict:
    keep = ("arrival", "max_tokens", "prefill", "decode", "cached_tokens", "decode_cached",
            "prompt_bytes", "first_token", "finish", "rejected")
    return {
        "summary": summary(res),
        "requests": [{"id": j.id, "session": j.tr.session, "prompt_len": j.tr.prompt_len,
                      **{k: getattr(j, k) for k in keep}} for j in res.jobs],
        "transfers": [vars(t) for t in res.network.transfers],
    }
