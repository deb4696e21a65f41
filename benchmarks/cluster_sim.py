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
          TTFT -59%) under PD-Caching-3; prompt trees learnt from routing (the
          paper's) and also fed KV events (+events), least-load alongside.

`{rate}` in --trace takes each of --rates (sessions started per second) in turn.
Every run is the real GlobalScheduler and memory core per instance on H100
roofline step times, a 200 Gb/s NIC per instance (kvserve.sim.cluster); the
tables are Markdown, as docs/benchmarks.md shows them.
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
# (baseline, contender, others): (design, routing, heartbeat s) each; a heartbeat feeds
# the prompt trees the instances' KV events (the real front end's default, every 0.5 s),
# without one they learn from routing alone with a TTL (the paper's global scheduler)
VARIANTS = {
    "designs": [("pd-basic", "prompt-tree", 0.0), ("pd-caching-3", "prompt-tree", 0.0)],
    "routing": [("pd-caching-3", "session", 0.0), ("pd-caching-3", "prompt-tree", 0.0),
                ("pd-caching-3", "prompt-tree", 0.5), ("pd-caching-3", "least-load", 0.0)],
}
PAPER_PAIR = {"designs": "1P2D-CC against 1P2D (ShareGPT)",
              "routing": "prompt-tree against session-ID (LooGLE, 3P1D)"}
METRICS = ("mean_jct_s", "p99_jct_s", "mean_ttft_s", "p99_ttft_s")


def run(args: argparse.Namespace, design: str, routing: str, heartbeat: float,
        trace: list) -> dict:
    inst = SimConfig(get_model(args.model), get_gpu("h100"), max_model_len=MAX_MODEL_LEN,
                     mem_every=0)
    prefill = 0 if design == "colocated" else args.prefill
    cfg = ClusterConfig(inst, instances=args.gpus, prefill=prefill, design=design,
                        routing=routing, network=NetworkConfig(args.network_gbps * GBIT),
                        heartbeat_s=heartbeat)
    t0 = time.perf_counter()
    s = summary(simulate_cluster(trace, cfg))
    s["wall_s"], s["heartbeat_s"] = time.perf_counter() - t0, heartbeat
    print(f"  {label(s)}: {s['wall_s']:.0f} s", flush=True)
    return s


def label(s: dict) -> str:
    """design / routing, +events where KV events fed the prompt trees."""
    events = "+events" if s.get("heartbeat_s") else ""
    return f"{s['design']} / {s['routing']}{events}"


def variant(s: dict) -> tuple[str, str, float]:
    return s["design"], s["routing"], s.get("heartbeat_s", 0.0)


def busy(s: dict, role: str) -> float:
    """Mean share of the run the instances of a role spent stepping."""
    xs = [i["busy"] for i in s["per_instance"].values() if i["role"] == role]
    return sum(xs) / len(xs) if xs else 0.0


def shape(s: dict) -> str:
    return "+".join(f"{s['instances'][r]}{r[0].upper()}"
                    for r in ("prefill", "decode", "colocated") if r in s["instances"])


def table(rows: list[dict]) -> str:
    head = ("| rate | design / routing | instances | JCT mean | JCT p99 | TTFT mean | TTFT p99 "
            "| prefix hits | D hits | KV moved | P busy | req/s |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in rows:
        p_busy = busy(s, "prefill") or busy(s, "colocated")
        d_hits = f"{s['decode_hit_rate']:.1%}" if "decode" in s["instances"] else "—"
        out.append(
            f"| {s['rate']} | {label(s)} | {shape(s)} "
            f"| {s['mean_jct_s']:.2f} s | {s['p99_jct_s']:.2f} s "
            f"| {s['mean_ttft_s'] * 1e3:.0f} ms | {s['p99_ttft_s'] * 1e3:.0f} ms "
            f"| {s['hit_rate']:.1%} | {d_hits} | {s['bytes'] / 1e9:.0f} GB "
            f"| {p_busy:.0%} "
            f"| {s['finished'] / s['sim_seconds']:.1f} |")
    return "\n".join(out)


def changes(kind: str, rows: list[dict]) -> str:
    """Per rate, every other run against the first (the baseline), next to the paper."""
    head = ("| rate | change of | " + " | ".join(m.replace("_s", "").replace("_", " ")
                                               for m in METRICS) + " |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    base_v = VARIANTS[kind][0]
    for rate in dict.fromkeys(s["rate"] for s in rows):
        at = [s for s in rows if s["rate"] == rate]
        base = next(s for s in at if variant(s) == base_v)
        for new in at:
            if new is not base:
                out.append(f"| {rate} | {label(new)} against {label(base)} | " + " | ".join(
                    f"{new[m] / base[m] - 1:+.0%}" if base[m] else "n/a" for m in METRICS)
                    + " |")
    paper = PAPER[kind]
    out.append(f"| paper | {PAPER_PAIR[kind]} | " + " | ".join(
        f"{paper[m]:+.0%}" if m in paper else "" for m in METRICS) + " |")
    return "\n".join(out)


def plot(kind: str, rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.4))
    for v in dict.fromkeys(variant(s) for s in rows):
        mine = [s for s in rows if variant(s) == v]
        for ax, m in zip(axes, METRICS):
            ax.plot([float(s["rate"]) for s in mine], [s[m] for s in mine], marker="o",
                    label=label(mine[0]))
    for ax, m in zip(axes, METRICS):
        ax.set_xlabel("sessions started per second")
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
    ap.add_argument("--from-json", help="print and plot the runs saved by --json, run nothing")
    args = ap.parse_args()
    variants = VARIANTS[args.kind] + ([("colocated", "prompt-tree", 0.0)] if args.colocated
                                      else [])
    rows = []
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)
    for rate in [] if args.from_json else args.rates.split(","):
        spec = args.trace.replace("{rate}", rate)
        print(f"{args.kind}: {args.model}, {args.gpus} H100s, {spec}", flush=True)
        trace = load_trace(spec)
        for design, routing, heartbeat in variants:
            s = run(args, design, routing, heartbeat, trace)
            s["rate"], s["trace"] = rate, spec
            rows.append(s)
            if args.json_out:  # after every run: a long sweep cut short keeps its runs
                with open(args.json_out, "w") as f:
                    json.dump(rows, f, indent=1)
    title = f"{args.model}, {args.gpus} simulated H100s, {args.trace}"
    print(f"\n{title}\n\n{table(rows)}\n\n{changes(args.kind, rows)}\n", flush=True)
    if args.plot:
        plot(args.kind, rows, args.plot, title)


if __name__ == "__main__":
    main()
