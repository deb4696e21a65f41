"""Prefix hit rates of jenga and uniform paging next to the trace's upper bounds.

    python benchmarks/prefix_hits.py arxiv --model gemma-3-12b
    python benchmarks/prefix_hits.py arxiv --model jamba-1.5-mini --max-model-len 65536
    python benchmarks/prefix_hits.py chat --model gemma-3-12b --gpu-utilization 0.5

Each row replays one trace through the simulator (real memory core and
scheduler) per policy, and computes the infinite-pool bound and Belady's
offline bound for jenga's pool (kvserve.sim.bounds), plain and with each
running request's peak room kept free (`+peak`, prefill chunks of the
scheduler's token budget or, if smaller, the chunk it gives misses).
`vs bound` is jenga's hit rate over the lower of the infinite and plain
Belady bounds, `vs peak` over the peak bound. `+run` is the peak bound with
the least room beside the cache that the requests jenga's run had running at
each moment need (`belady(busy=...)`: any policy serving with that concurrency
needs it), `vs run` jenga over it. `blind` is not a bound but what
an online policy can expect on a shuffled trace: the peak bound's pool kept by
each unit's remaining uses instead of its next one (`vs blind`: jenga over it).
`lru` is what recency alone gets in the same pool: units by their last use, each
cached after its request whether or not it comes back (`vs lru`: jenga over it).
The bounds admit requests in the order each run saw them arrive (a conversation's
next turn comes after its previous answer, so the order depends on the run); the
scheduler may reorder a backlog (KVCacheManager.can_start), so jenga can pass them
under overload.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from kvserve.sim.bounds import belady, hit_bytes, infinite_pool, peak_bytes, run_bytes
from kvserve.sim.gpus import get_gpu
from kvserve.sim.models import get_model
from kvserve.sim.simulator import SimConfig, SimResult, Simulator
from kvserve.sim.traces import TraceRequest, load_trace

POLICIES = ("uniform", "jenga")


def simulate(trace: list[TraceRequest], policy: str, args: argparse.Namespace,
             on_step: Callable | None = None) -> tuple[Simulator, SimResult, float]:
    """Replay trace under one policy with the options `add_sim_arguments` defines;
    the hit rate counts each request's first admission (not re-admissions after
    preemption) over every prompt token of the trace. `on_step(kv, sched, batch)`:
    `Simulator.on_step`."""
    model = get_model(args.model)
    cfg = SimConfig(model, get_gpu(args.gpu), policy=policy,
                    fp8_weights=args.gpu in model.fp8_gpus,  # the paper's Table 1
                    max_model_len=args.max_model_len,
                    gpu_utilization=args.gpu_utilization, mem_every=1 << 30,
                    max_num_batched_tokens=args.max_num_batched_tokens)
    sim = Simulator(cfg)
    sim.on_step = on_step
    res = sim.run(trace)
    hit = sum(r.cached_tokens for r in res.requests) / sum(r.prompt_len for r in trace)
    return sim, res, hit


def add_sim_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="gemma-3-12b")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--gpu-utilization", type=float, default=0.9)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="the step's token budget (default: the simulator's, vLLM v0's "
                         "max(max_model_len, 2048); vLLM v1 serves with 8192 on an H100)")


def run_point(trace_spec: str, args: argparse.Namespace) -> dict:
    trace = load_trace(trace_spec)
    row: dict = {"trace": trace_spec}
    for policy in POLICIES:
        sim, res, row[policy] = simulate(trace, policy, args)
        seen = res.realized(trace)  # conversations' turns in the order this run gave them
        if policy == "jenga":
            row["infinite"] = infinite_pool(seen, 16)
        pool, size = sim.kv.pool_bytes, hit_bytes(sim.kv)
        row[f"{policy}_belady"] = belady(seen, pool, size, 16)
        # The scheduler prefills misses in chunks of MISS_CHUNK: the bound
        # takes that chunk for every request, so no request here peaks below it.
        peak = peak_bytes(sim.kv, min(sim.cfg.batched_tokens, sim.kv.MISS_CHUNK))
        row[f"{policy}_peak"] = belady(seen, pool, size, 16, peak)
        if policy == "jenga":
            busy = {r.id: (r.first_token, r.finish) for r in res.requests
                    if r.first_token is not None and r.finish is not None}
            row["jenga_run"] = belady(seen, pool, size, 16, peak, busy=busy,
                                      room=run_bytes(sim.kv))
            row["jenga_blind"] = belady(seen, pool, size, 16, peak, order_blind=True)
            row["jenga_lru"] = belady(seen, pool, size, 16, peak, recency=True)
        row[f"{policy}_pool_gb"] = sim.kv.pool_bytes / 1e9
    row["bound"] = min(row["infinite"], row["jenga_belady"])
    return row


def print_row(row: dict, header: bool) -> None:
    if header:
        print(f"{'trace':<58}{'uniform':>8}{'jenga':>8}{'ratio':>7}{'inf':>8}"
              f"{'belady':>8}{'vs bound':>9}{'+peak':>8}{'vs peak':>9}{'+run':>8}{'vs run':>8}"
              f"{'blind':>8}{'vs blind':>9}"
              f"{'lru':>8}{'vs lru':>8}")
    ratio = row["jenga"] / row["uniform"] if row["uniform"] else float("inf")
    vs = row["jenga"] / row["bound"] if row["bound"] else 1.0
    vs_peak = row["jenga"] / row["jenga_peak"] if row["jenga_peak"] else 1.0
    vs_run = row["jenga"] / row["jenga_run"] if row["jenga_run"] else 1.0
    vs_blind = row["jenga"] / row["jenga_blind"] if row["jenga_blind"] else 1.0
    vs_lru = row["jenga"] / row["jenga_lru"] if row["jenga_lru"] else float("inf")  # loops
    print(f"{row['trace']:<58}{row['uniform']:>8.1%}{row['jenga']:>8.1%}{ratio:>7.2f}"
          f"{row['infinite']:>8.1%}{row['jenga_belady']:>8.1%}{vs:>9.1%}"
          f"{row['jenga_peak']:>8.1%}{vs_peak:>9.1%}{row['jenga_run']:>8.1%}{vs_run:>8.1%}"
          f"{row['jenga_blind']:>8.1%}"
          f"{vs_blind:>9.1%}{row['jenga_lru']:>8.1%}{vs_lru:>8.1%}", flush=True)


def traces(args: argparse.Namespace) -> list[str]:
    if args.workload == "chat":
        return [f"sharegpt-chat:sessions={n},rate={r}" for r in args.rates for n in args.sessions]
    extra = f",{args.extra}" if args.extra else ""
    return [f"arxiv-qa:articles={n},rate={r},order={o}{extra}"
            for o in args.orders for r in args.rates for n in args.articles]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=["arxiv", "chat"])
    add_sim_arguments(ap)
    ap.add_argument("--articles", type=int, nargs="+", default=[2, 4, 8, 12, 16, 32, 64])
    ap.add_argument("--orders", nargs="+", default=["round_robin", "shuffled"])
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[100, 200, 400])
    ap.add_argument("--extra", default="", help="more generator options, key=value,...")
    ap.add_argument("--json", help="append one JSON object per row to this file")
    args = ap.parse_args()
    for i, spec in enumerate(traces(args)):
        row = run_point(spec, args)
        print_row(row, header=i == 0)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"model": args.model, **row}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
