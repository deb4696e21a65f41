"""Multi-turn ShareGPT through `kvserve serve`, without and with a host tier.

    python benchmarks/host_tier_serving.py [--kv-memory 64M] [--host 0 512M] \
        [--sessions 16] [--rate 0.5] [--think-time 5]

For each host-tier size: a fresh `kvserve serve --kv-memory <kv> [--host-kv-memory
<host>]` (Gemma 3 270M, the defaults otherwise), then `kvserve bench serve
--multi-turn`: sessions arrive as a Poisson process, each turn carries the
whole conversation and waits a think time after the previous answer. The KV
pool holds a few of the sessions; the host tier (8x) all of them. Reports the
prefix hit rate (/metrics), the share served from the host tier, TTFT p50 /
p99 (all turns, and later turns alone: a first turn has nothing to hit),
output throughput, and the bytes swapped each way. Writes
`<out>/host_<size>.json` (the bench report plus the server's counters).
"""

from __future__ import annotations

import argparse
import json
import os

from serving import add_multi_turn_arguments, bench_multi_turn, metrics, served

from kvserve.bench.report import distribution
from kvserve.cpu_features import summary

MiB = 1 << 20


def one_run(host: str, args: argparse.Namespace) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / f"host_{host}.bench.json"
    options = ["--kv-memory", args.kv_memory]
    if host != "0":
        options += ["--host-kv-memory", host]
    with served(options, args.out / f"host_{host}.server.log") as base:
        bench_multi_turn(base, report_path, args)
        counters = metrics(base)
    report = json.loads(report_path.read_text())
    later = [r["ttft_s"] for r in report["requests"] if r["ok"] and r["turn"] > 0]
    hits = counters.get("kvserve_prefix_cache_hit_tokens", 0)
    row = {
        "host": host, "requests": report["completed"], "failed": report["failed"],
        "later_turns": len(later), "duration_s": report["duration_s"],
        "hit_rate": report["prefix_cache_hit_rate"],
        "host_hit_share": counters.get("kvserve_prefix_cache_host_hit_tokens", 0) / hits
        if hits else 0.0,
        "ttft_p50_ms": report["median_ttft_ms"], "ttft_p99_ms": report["p99_ttft_ms"],
        **{f"later_{k}": v for k, v in distribution("ttft", later).items()},
        "output_tok_s": report["output_throughput"],
        "swap_out_mib": counters.get("kvserve_kv_swap_out_bytes", 0) / MiB,
        "swap_in_mib": counters.get("kvserve_kv_swap_in_bytes", 0) / MiB,
        "preemptions": report["num_preemptions"],
    }
    (args.out / f"host_{host}.json").write_text(
        json.dumps({"row": row, "counters": counters}, indent=1) + "\n")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", nargs="+", default=["0", "512M"])
    ap.add_argument("--kv-memory", default="64M")
    add_multi_turn_arguments(ap, sessions=16, rate=0.5, think_time=5.0, max_tokens=48,
                             max_prompt_tokens=1024, out="/tmp/host_tier_serving")
    args = ap.parse_args()
    print(f"CPU: {summary()}; load average {os.getloadavg()[0]:.2f}")
    rows = [one_run(host, args) for host in args.host]
    print("| host tier | requests (later turns) | duration (s) | prefix hit | of it from host "
          "| TTFT p50 / p99 (ms) | later turns TTFT p50 / p99 (ms) | output tok/s | "
          "swapped out / in (MiB) | preemptions |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['host']} | {r['requests']} ({r['later_turns']}) | {r['duration_s']:.0f} | "
              f"{r['hit_rate']:.1%} | {r['host_hit_share']:.1%} | "
              f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
              f"{r['later_median_ttft_ms']:.0f} / {r['later_p99_ttft_ms']:.0f} | "
              f"{r['output_tok_s']:.1f} | {r['swap_out_mib']:.0f} / {r['swap_in_mib']:.0f} | "
              f"{r['preemptions']:.0f} |")


if __name__ == "__main__":
    main()
