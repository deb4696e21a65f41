"""Infinite-LLM vs vLLM-M vs vLLM-S on simulated H100s (kvserve.sim.distattn).

    PYTHONPATH=src python benchmarks/dist_sim.py --model llama-3.1-8b --gpus 8 \\
        --trace long-mix:n=200,long_frac=0.2,long_max=2000000

Runs the three systems on the same trace (all requests at t=0: the saturated
throughput, as the paper's maximum achieved throughput), then Infinite-LLM again
spreading every attention layer's KV (--no-hybrid's bytes), and prints one
markdown table plus the longest context each system can hold. Two throughputs:
`tokens/s` counts the prompt and output tokens of finished requests over the time
to finish them all (sensitive to the last long request's tail); `saturated tok/s`
counts the tokens computed (finished or not) in the first W seconds, W half the
shortest of the three systems' times, while every system still has a queue.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from kvserve.sim.distattn import DistConfig, longest_context, simulate_dist, summary
from kvserve.sim.gpus import get_gpu
from kvserve.sim.models import get_model
from kvserve.sim.traces import load_trace

SYSTEMS = ("infinite", "multi", "single")
NAMES = {"infinite": "Infinite-LLM", "multi": "vLLM-M", "single": "vLLM-S"}


def run(model: str, gpus: int, trace_spec: str, all_layers: bool) -> None:
    trace = load_trace(trace_spec)
    base = DistConfig(get_model(model), get_gpu("h100"), gpus=gpus)
    print(f"\n{model}, {gpus} x H100, trace `{trace_spec}` ({len(trace)} requests, "
          f"{sum(r.prompt_len + r.output_len for r in trace) / 1e6:.1f}M tokens)\n")
    rows = []
    modes = [(m, True) for m in SYSTEMS] + ([("infinite", False)] if all_layers else [])
    for mode, hybrid in modes:
        cfg = dataclasses.replace(base, mode=mode, hybrid=hybrid)
        t0 = time.perf_counter()
        res = simulate_dist(trace, cfg)
        s = summary(res)
        s["res"] = res
        s["wall"] = time.perf_counter() - t0
        s["longest"] = longest_context(cfg)
        rows.append(s)
    window = min(s["sim_seconds"] for s in rows[:3]) / 2
    for s in rows:
        s["saturated"] = s["res"].tokens_by(window) / window
    print(f"saturated window W = {window:.1f} s; `Inf. x` = Infinite-LLM's throughput over "
          "this row's (tokens/s, saturated)\n")
    print("| system | done | rejected | sim s | tokens/s | saturated tok/s | Inf. x "
          "| GB moved | GB if all layers | max spread | longest context | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ref = rows[0]
    for s in rows:
        name = NAMES[s["mode"]] + ("" if s["hybrid"] else " (all layers spread)")
        x = [ref[k] / s[k] if s[k] else float("inf") for k in ("tokens_per_s", "saturated")]
        print(f"| {name} | {s['finished']} | {s['rejected']} | {s['sim_seconds']:.1f} "
              f"| {s['tokens_per_s']:,.0f} | {s['saturated']:,.0f} | {x[0]:.2f} / {x[1]:.2f} "
              f"| {s['moved_bytes'] / 1e9:,.1f} | {s['all_layer_bytes'] / 1e9:,.1f} "
              f"| {s['max_spread']} | {s['longest'] / 1e3:,.0f}K | {s['wall']:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--trace", default="long-mix:n=200,long_frac=0.2,long_max=2000000")
    p.add_argument("--all-layers", action="store_true",
                   help="also run Infinite-LLM spreading every attention layer's KV")
    a = p.parse_args()
    run(a.model, a.gpus, a.trace, a.all_layers)


if __name__ == "__main__":
    main()
