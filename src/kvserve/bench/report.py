"""Summary statistics of a serving run, in vLLM's benchmark vocabulary (ms, mean/p50/p99)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvserve.bench.serve import RequestResult

PERCENTILES = (50, 99)


def distribution(name: str, seconds: Sequence[float]) -> dict[str, float | None]:
    """mean_<name>_ms, median_<name>_ms (= p50) and p99_<name>_ms; None without samples."""
    out: dict[str, float | None] = {f"mean_{name}_ms": None}
    out.update({f"{_label(q)}_{name}_ms": None for q in PERCENTILES})
    if seconds:
        ms = sorted(s * 1000 for s in seconds)
        out[f"mean_{name}_ms"] = sum(ms) / len(ms)
        for q in PERCENTILES:
            out[f"{_label(q)}_{name}_ms"] = percentile(ms, q)
    return out


def percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) on sorted data."""
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _label(q: int) -> str:
    return "median" if q == 50 else f"p{q}"


def summarize(results: list[RequestResult], duration: float,
              counters: dict[str, float]) -> dict[str, Any]:
    """`counters`: how much each server counter grew over the run (see serve.COUNTERS)."""
    done = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    hits = counters.get("kvserve_prefix_cache_hit_tokens")
    queried = counters.get("kvserve_prefix_cache_queried_tokens")
    # --kv-backend vtensor: hit tokens whose KV the vTensor had given back (idle release).
    recomputed = counters.get("kvserve_vtensor_recomputed_tokens")
    summary: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        # Server side (/metrics): every prefix-cache lookup, preemption re-lookups included.
        "prefix_cache_hit_rate": hits / queried if hits is not None and queried else None,
        "prefix_cache_hit_tokens": hits,
        "prefix_cache_queried_tokens": queried,
        "num_preemptions": counters.get("kvserve_num_preemptions"),
        "vtensor_recomputed_tokens": recomputed,
        # The hits really served from KV memory: the prefix cache's, less what was recomputed.
        "prefix_reused_rate": ((hits - recomputed) / queried
                               if None not in (hits, recomputed) and queried else None),
        # Client side: usage.prompt_tokens_details.cached_tokens over prompt tokens.
        "cached_prompt_token_ratio": cached / prompt if prompt else None,
    }
    summary |= distribution("ttft", [r.ttft for r in done if r.ttft is not None])
    summary |= distribution("tpot", [t for r in done if (t := r.tpot) is not None])
    summary |= distribution("itl", [gap for r in done for gap in r.itl])
    summary |= distribution("e2el", [r.latency for r in done])
    errors = sorted({r.error for r in results if r.error})
    summary["errors"] = errors[:10]
    return summary


def format_table(summary: dict[str, Any]) -> str:
    """The human-readable block printed at the end of a run."""
    def num(v: Any, fmt: str = ".2f") -> str:
        return "n/a" if v is None else format(v, fmt)

    rows = [
        ("Successful requests", num(summary["completed"], "d")),
        ("Failed requests", num(summary["failed"], "d")),
        ("Duration (s)", num(summary["duration_s"])),
        ("Total input tokens", num(summary["total_input_tokens"], "d")),
        ("Total generated tokens", num(summary["total_output_tokens"], "d")),
        ("Request throughput (req/s)", num(summary["request_throughput"], ".3f")),
        ("Output token throughput (tok/s)", num(summary["output_throughput"])),
        ("Total token throughput (tok/s)", num(summary["total_token_throughput"])),
        ("Prefix cache hit rate (/metrics)", num(summary["prefix_cache_hit_rate"], ".1%")),
        ("Cached prompt tokens (usage)", num(summary["cached_prompt_token_ratio"], ".1%")),
        ("Preemptions (/metrics)", num(summary["num_preemptions"], ".0f")),
        ("Hit tokens recomputed (vtensor)", num(summary["vtensor_recomputed_tokens"], ".0f")),
        ("Prefix reused, net (/metrics)", num(summary["prefix_reused_rate"], ".1%")),
    ]
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {title} (ms)", num(summary[f"{stat}_{name}_ms"])))
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join(f"{k:<{width}}{v:>14}" for k, v in rows)
