"""Multi-turn ShareGPT through `kvserve cluster serve`: colocated x2 against 1P+1D designs.

    python benchmarks/cluster_serving.py [--configs colocated pd-basic pd-caching-3] \
        [--kv-memory 64M] [--sessions 16] [--rate 0.5] [--think-time 5]

Each configuration is a fresh cluster of two Gemma 3 270M instances (Ray actors,
one torch thread each on this 2-core machine) behind the OpenAI front end,
driven by `kvserve bench serve --multi-turn` (sessions arrive as a Poisson
process; each turn carries the whole conversation and waits a think time after
the previous answer). Reports JCT (request latency) and TTFT mean / p99, the
prefix hit rate where prompts are looked up first (colocated or prefill
instances: a decode instance's lookups find the KV it was just sent), and the KV
bytes moved between instances. Writes `<out>/<config>.json`.
"""

from __future__ import annotations

import argparse
import json
import os

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serving import add_multi_turn_arguments, bench_multi_turn, served

from kvserve.bench.report import distribution
from kvserve.cpu_features import summary

CONFIGS = {
    "colocated": ["--instances", "2"],
    "pd-basic": ["--prefill", "1", "--decode", "1", "--design", "pd-basic"],
    "pd-caching-1": ["--prefill", "1", "--decode", "1", "--design", "pd-caching-1"],
    "pd-caching-3": ["--prefill", "1", "--decode", "1", "--design", "pd-caching-3"],
}
MiB = 1 << 20


def by_instance(base: str) -> dict[tuple[str, str], dict[str, float]]:
    """{(instance, role): {family: value}} for the labelled counters of /metrics."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    text = httpx.get(f"{base}/metrics", timeout=60).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "instance" in s.labels and s.name.endswith("_total"):
                key = (s.labels["instance"], s.labels.get("role", s.labels.get("direction")))
                out.setdefault(key, {})[family.name] = s.value
    return out


def one_run(config: str, args: argparse.Namespace) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / f"{config}.bench.json"
    options = [*CONFIGS[config], "--kv-memory", args.kv_memory, "--threads-per-instance", "1",
               "--policy", args.policy]
    with served(options, args.out / f"{config}.server.log", ("cluster", "serve")) as base:
        bench_multi_turn(base, report_path, args)
        counters = by_instance(base)
    report = json.loads(report_path.read_text())
    ok = [r for r in report["requests"] if r["ok"]]
    first = [(k, v) for k, v in counters.items() if k[1] in ("colocated", "prefill")]
    hit = sum(v.get("kvserve_prefix_cache_hit_tokens", 0) for _, v in first)
    queried = sum(v.get("kvserve_prefix_cache_queried_tokens", 0) for _, v in first)
    moved = sum(v.get("kvserve_kv_transfer_bytes", 0) for k, v in counters.items()
                if k[1] == "received")
    row = {"config": config, "requests": report["completed"], "failed": report["failed"],
           "duration_s": report["duration_s"], "hit_rate": hit / queried if queried else 0.0,
           "moved_mib": moved / MiB, "output_tok_s": report["output_throughput"],
           **distribution("jct", [r["latency_s"] for r in ok]),
           **distribution("ttft", [r["ttft_s"] for r in ok])}
    (args.out / f"{config}.json").write_text(
        json.dumps({"row": row, "counters": {f"{k[0]}/{k[1]}": v for k, v in counters.items()}},
                   indent=1) + "\n")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS),
                    default=["colocated", "pd-basic", "pd-caching-3"])
    ap.add_argument("--policy", default="prompt-tree")
    ap.add_argument("--kv-memory", default="64M")
    add_multi_turn_arguments(ap, sessions=16, rate=0.5, think_time=5.0, max_tokens=48,
                             max_prompt_tokens=1024, out="/tmp/cluster_serving")
    args = ap.parse_args()
    print(f"CPU: {summary()}; load average {os.getloadavg()[0]:.2f}")
    rows = [one_run(c, args) for c in args.configs]
    print("| design (2 instances) | requests | duration (s) | JCT mean / p99 (ms) | "
          "TTFT mean / p99 (ms) | prefix hit (first lookup) | KV moved (MiB) | output tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['config']} | {r['requests']} ({r['failed']} failed) | "
              f"{r['duration_s']:.0f} | {r['mean_jct_ms']:.0f} / {r['p99_jct_ms']:.0f} | "
              f"{r['mean_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['hit_rate']:.1%} | "
              f"{r['moved_mib']:.1f} | {r['output_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
