"""MemServe's cluster results (§8.3, §8.4) on the simulated cluster, next to the paper's.

    python benchmarks/cluster_sim.py designs --model llama-3.1-8b --gpus 8 --prefill 1 \\
        --trace 'sharegpt-chat:sessions=1500,rate={rate},think=5' --rates 16,20,28,40 \\
        --plot docs/img/cluster_sim/designs-llama-8.png
    python benchmarks/cluster_sim.py routing --model llama-3.1-8b --gpus 8 --prefill 6 \\
        --trace 'doc-qa:docs=1000,questions=3,share=2,rate={rate}' --rates 40

designs   ShareGPT multi-turn sessions: PD-Caching-3 against PD-Basic on the same
          instances (the paper's 1P2D-CC against 1P2D: JCT mean -17%, P99 -29%;
          TTFT mean -58%, P99 -45%). --colocated adds N colocated instances.
routing   LooGLE-like document sessions, each run twice (share ratio 2):
          prompt-tree against session-ID routing (the paper's Fig. 15, 3P1D: P99
          TTFT -59%) under PD-Caching-3, least-load alongside.

`{rate}` in --trace takes each of --rates (sessions started per second) in turn.
Every run is the real GlobalScheduler and memory core per instance on H100
roofline step times, a 200 Gb/s NIC per instance (kvserve.sim.cluster); the
tables are Markdown, as docs/benchmarks_cluster_sim.md shows them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvserve.sim.cluster import ClusterConfig, simulate_cluster
from kvserve.sim.cluster_metrics import summary
from kvserve.sim.gpus import get_gpu
from kvserve.sim.models import get_model
from kvserve.sim.network import GBIT, NetworkConfig
from kvserve.sim.simulator import SimConfig
from kvserve.sim.traces import load_trace

MAX_MODEL_LEN = 16384  # sharegpt-chat cuts sessions there

# MemServe §8.3 (ShareGPT, 1P2D-CC against 1P2D) and §8.4 (Fig. 15, prompt-tree
# against session-ID)
PAPER = {
    "designs": {"mean_jct_s": -0.17, "p99_jct_s": -0.29, "mean_ttft_s": -0.58,
                "p99_ttft_s": -0.45},
    "routing": {"p99_ttft_s": -0.59},
}
# (baseline, contender, others): (design, routing) each
VARIANTS = {
    "designs": [("pd-basic", "prompt-tree"), ("pd-caching-3", "prompt-tree")],
    "routing": [("pd-caching-3", "session"), ("pd-caching-3", "prompt-tree"),
                ("pd-caching-3", "least-load")],
}
METRICS = ("mean_jct_s", "p99_jct_s", "mean_ttft_s", "p99_ttft_s")


def run(args: argparse.Namespace, design: str, routing: str, trace: list) -> dict:
    inst = SimConfig(get_model(args.model), get_gpu("h100"), max_model_len=MAX_MODEL_LEN,
                     mem_every=0)
    prefill = 0 if design == "colocated" else args.prefill
    cfg = ClusterConfig(inst, instances=args.gpus, prefill=prefill, design=design,
                        routing=routing, network=NetworkConfig(args.network_gbps * GBIT))
    t0 = time.perf_counter()
    s = summary(simulate_cluster(trace, cfg))
    s["wall_s"] = time.perf_counter() - t0
    print(f"  {design} {routing}: {s['wall_s']:.0f} s", flush=True)
    return s


def busy(s: dict, role: str) -> float:
    """Mean share of the run the instances of a role spent stepping."""
    xs = [i["busy"] for i in s["per_instance"].values() if i["role"] == role]
    return sum(xs) / len(xs) if xs else 0.0


def shape(s: dict) -> str:
    return "+".join(f"{s['instances'][r]}{r[0].upper()}"
                    for r in ("prefill", "decode", "colocated") if r in s["instances"])


def table(rows: list[dict]) -> str:
    head = ("| rate | design | instances | routing | JCT mean | JCT p99 | TTFT mean | TTFT p99 "
            "| prefix hits | KV moved | P busy | req/s |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in rows:
        p_busy = busy(s, "prefill") or busy(s, "colocated")
        out.append(
            f"| {s['rate']} | {s['design']} | {shape(s)} | {s['routing']} "
            f"| {s['mean_jct_s']:.2f} s | {s['p99_jct_s']:.2f} s "
            f"| {s['mean_ttft_s'] * 1e3:.0f} ms | {s['p99_ttft_s'] * 1e3:.0f} ms "
            f"| {s['hit_rate']:.1%} | {s['bytes'] / 1e9:.0f} GB | {p_busy:.0%} "
            f"| {s['finished'] / s['sim_seconds']:.1f} |")
    return "\n".join(out)


def changes(kind: str, rows: list[dict]) -> str:
    """Per rate, the contender against the baseline, next to the paper."""
    base_v, new_v = VARIANTS[kind][0], VARIANTS[kind][1]
    head = "| rate | " + " | ".join(m.replace("_s", "").replace("_", " ") for m in METRICS) + " |"
    out = [f"{new_v[0]} / {new_v[1]} against {base_v[0]} / {base_v[1]}:", "", head,
           "|" + "---|" * (head.count("|") - 1)]
    for rate in dict.fromkeys(s["rate"] for s in rows):
        at = {(s["design"], s["routing"]): s for s in rows if s["rate"] == rate}
        base, new = at[base_v], at[new_v]
        out.append(f"| {rate} | " + " | ".join(
            f"{new[m] / base[m] - 1:+.0%}" if base[m] else "n/a" for m in METRICS) + " |")
    paper = PAPER[kind]
    out.append("| paper | " + " | ".join(f"{paper[m]:+.0%}" if m in paper else ""
                                         for m in METRICS) + " |")
    return "\n".join(out)


def plot(kind: str, rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.4))
    for design, routing in VARIANTS[kind]:
        mine = [s for s in rows if (s["design"], s["routing"]) == (design, routing)]
        if not mine:
            continue
        rates = [s["finished"] / s["sim_seconds"] for s in mine]
        for ax, m in zip(axes, METRICS):
            ax.plot(rates, [s[m] for s in mine], marker="o",
                    label=design if kind == "designs" else routing)
    for ax, m in zip(axes, METRICS):
        ax.set_xlabel("requests/s (whole run)")
        ax.set_ylabel(m.replace("_s", " (s)").replace("_", " "))
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=tuple(VARIANTS))
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--gpus", type=int, default=8, help="instances of one H100 each")
    ap.add_argument("--prefill", type=int, default=1, help="prefill instances")
    ap.add_argument("--trace", required=True, help="a generator spec; {rate} is replaced")
    ap.add_argument("--rates", default="1", help="comma list for {rate}")
    ap.add_argument("--colocated", action="store_true",
                    help="also run the trace on as many colocated instances")
    ap.add_argument("--network-gbps", type=float, default=200.0)
    ap.add_argument("--json", dest="json_out", help="write every run's summary here")
    ap.add_argument("--plot", help="write a PNG of the metrics against the load here")
    args = ap.parse_args()
    variants = VARIANTS[args.kind] + ([("colocated", "prompt-tree")] if args.colocated else [])
    rows = []
    for rate in args.rates.split(","):
        spec = args.trace.replace("{rate}", rate)
        print(f"{args.kind}: {args.model}, {args.gpus} H100s, {spec}", flush=True)
        trace = load_trace(spec)
        for design, routing in variants:
            s = run(args, design, routing, trace)
            s["rate"], s["trace"] = rate, spec
            rows.append(s)
    title = f"{args.model}, {args.gpus} simulated H100s, {args.trace}"
    print(f"\n{title}\n\n{table(rows)}\n\n{changes(args.kind, rows)}\n", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(args.kind, rows, args.plot, title)


if __name__ == "__main__":
    main()
