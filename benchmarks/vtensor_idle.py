"""--kv-idle-release-s on multi-turn ShareGPT: prefix hits kept against memory held.

    python benchmarks/vtensor_idle.py --idle 0 5 60 inf [--think-time 10] [--sessions 10]

For each idle value: a fresh `kvserve serve --kv-backend vtensor` (Gemma 3
270M, the defaults otherwise), then `kvserve bench serve --multi-turn` with a
think time between turns, while a sampler reads /metrics every 0.25 s. After
the run the sampler keeps going until the memory is given back (at most
`--max-tail` s; 10 s for `inf`, which never gives it back). Reports, per value:

* the prefix-cache hit rate (/metrics), the hit tokens the vTensor had given
  back and recomputed (`kvserve_vtensor_recomputed_tokens`), and the net reuse;
* TTFT p50 / p99 of every request and of the later turns alone (the first turn
  of a session has no prefix to hit);
* physical KV (the memfd's blocks): peak, its time integral over the run
  (MiB x s), what is held when the run ends, and how long until it is back to 0.

Writes `<out>/idle_<value>.json` (bench report + memory samples) and prints a
markdown table. The server's process is started and stopped here (by its pid).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serving import add_multi_turn_arguments, bench_multi_turn, served

from kvserve.bench.report import distribution
from kvserve.cpu_features import summary

MiB = 1 << 20
GAUGES = ("kvserve_vtensor_physical_bytes", "kvserve_vtensor_mapped_bytes",
          "kvserve_vtensor_referenced_bytes")


class Sampler(threading.Thread):
    """Reads the vTensor gauges from /metrics every `period` seconds until stopped."""

    def __init__(self, base: str, period: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.base, self.period = base, period
        self.samples: list[dict[str, float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.halt.is_set():
                t = time.monotonic()
                try:
                    text = client.get(f"{self.base}/metrics").text
                except httpx.HTTPError:
                    text = ""
                row = {"t": t}
                for family in text_string_to_metric_families(text):
                    if family.name in GAUGES:
                        row[family.name] = family.samples[0].value
                if len(row) > 1:
                    self.samples.append(row)
                self.halt.wait(max(0.0, self.period - (time.monotonic() - t)))

    def latest(self) -> float:
        return self.samples[-1]["kvserve_vtensor_physical_bytes"] if self.samples else math.nan


def integral_mib_s(samples: list[dict[str, float]], t0: float, t1: float) -> float:
    """Physical MiB x seconds over [t0, t1], holding each sample until the next."""
    total = 0.0
    for a, b in zip(samples, samples[1:]):
        lo, hi = max(a["t"], t0), min(b["t"], t1)
        if hi > lo:
            total += a["kvserve_vtensor_physical_bytes"] / MiB * (hi - lo)
    return total


def one_run(idle: str, args: argparse.Namespace) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / f"idle_{idle}.bench.json"
    options = ["--kv-backend", "vtensor", "--kv-idle-release-s", idle,
               "--kv-memory", args.kv_memory]
    with served(options, args.out / f"idle_{idle}.server.log") as base:
        sampler = Sampler(base)
        try:
            sampler.start()
            t0 = time.monotonic()
            bench_multi_turn(base, report_path, args)
            t1 = time.monotonic()
            held_at_end = sampler.latest()
            tail = 10.0 if idle == "inf" else min(args.max_tail, float(idle) * 1.25 + 5)
            deadline = t1 + tail
            while time.monotonic() < deadline and not (idle != "inf" and sampler.latest() == 0):
                time.sleep(0.1)
            back_to_zero = 0.0 if held_at_end == 0 else next(
                (s["t"] - t1 for s in sampler.samples
                 if s["t"] >= t1 and s["kvserve_vtensor_physical_bytes"] == 0), None)
        finally:
            sampler.halt.set()
            sampler.join()
    report = json.loads(report_path.read_text())
    later = [r["ttft_s"] for r in report["requests"] if r["ok"] and r["turn"] > 0]
    samples = sampler.samples
    row = {
        "idle_s": idle,
        "requests": report["completed"], "failed": report["failed"],
        "later_turns": len(later),
        "duration_s": t1 - t0,
        "hit_rate": report["prefix_cache_hit_rate"],
        "recomputed_tokens": report["vtensor_recomputed_tokens"],
        "hit_tokens": report["prefix_cache_hit_tokens"],
        "queried_tokens": report["prefix_cache_queried_tokens"],
        "net_reuse": report["prefix_reused_rate"],
        "ttft_p50_ms": report["median_ttft_ms"], "ttft_p99_ms": report["p99_ttft_ms"],
        **{f"later_{k}": v for k, v in distribution("ttft", later).items()},
        "peak_physical_mib": max(s["kvserve_vtensor_physical_bytes"] for s in samples) / MiB,
        "physical_mib_s": integral_mib_s(samples, t0, t1),
        "held_at_end_mib": held_at_end / MiB,
        "back_to_zero_s": back_to_zero,
    }
    (args.out / f"idle_{idle}.json").write_text(json.dumps(
        {"row": row, "samples": [{**s, "t": s["t"] - t0} for s in samples]}, indent=1) + "\n")
    return row


def fmt(v: object, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle", nargs="+", default=["0", "5", "60", "inf"])
    add_multi_turn_arguments(ap, sessions=10, rate=0.5, think_time=10.0, max_tokens=32,
                             max_prompt_tokens=768, out="/tmp/vtensor_idle")
    ap.add_argument("--kv-memory", default="512M")
    ap.add_argument("--max-tail", type=float, default=80.0,
                    help="seconds to wait after a run for the memory to go back")
    args = ap.parse_args()
    print(f"CPU: {summary()}; load average {os.getloadavg()[0]:.2f}")
    rows = [one_run(idle, args) for idle in args.idle]
    print("| idle (s) | requests (later turns) | duration (s) | prefix hit | recomputed / hit "
          "tokens | net reuse | TTFT p50 / p99 (ms) | later turns TTFT p50 / p99 (ms) | "
          "peak physical (MiB) | physical x time (MiB s) | held at end (MiB) | back to 0 "
          "after (s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['idle_s']} | {r['requests']} ({r['later_turns']}) | "
              f"{r['duration_s']:.0f} | {fmt(r['hit_rate'], '.1%')} | "
              f"{fmt(r['recomputed_tokens'], '.0f')} / {fmt(r['hit_tokens'], '.0f')} | "
              f"{fmt(r['net_reuse'], '.1%')} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
              f"{fmt(r['later_median_ttft_ms'], '.0f')} / {fmt(r['later_p99_ttft_ms'], '.0f')} | "
              f"{r['peak_physical_mib']:.1f} | {r['physical_mib_s']:.0f} | "
              f"{r['held_at_end_mib']:.1f} | {fmt(r['back_to_zero_s'], '.1f')} |")


if __name__ == "__main__":
    main()
