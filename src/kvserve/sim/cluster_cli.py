"""`kvserve sim --instances N`: the trace through a simulated cluster of N instances.

    kvserve sim --model llama-3.1-8b --trace sharegpt-chat:sessions=400,rate=4 \\
        --instances 8 --prefill 3 --design pd-basic,pd-caching-3 --routing prompt-tree

Every instance is the single-instance simulator with the flags above (one per
--tp GPUs); --design, --routing and --policy take comma lists (or all) and run
side by side on the same trace. See kvserve.sim.cluster.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from kvserve.cluster.disagg import DESIGNS
from kvserve.cluster.global_scheduler import POLICIES as ROUTINGS


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (MemServe's designs and global scheduler)")
    g.add_argument("--instances", type=int, default=0,
                   help="simulate a cluster of N instances (0: one engine, no cluster)")
    g.add_argument("--prefill", type=int, default=0,
                   help="prefill instances of a disaggregated design (default: half); "
                        "the others decode")
    g.add_argument("--design", default=["colocated"], type=_choices(list(DESIGNS)),
                   help=f"one of {list(DESIGNS)}, a comma list, or all")
    g.add_argument("--routing", default=["prompt-tree"], type=_choices(list(ROUTINGS)),
                   help=f"global scheduler policy: one of {list(ROUTINGS)}, a comma list, "
                        "or all")
    g.add_argument("--network-gbps", type=float, default=200.0,
                   help="every instance's NIC, each direction (Gb/s)")
    g.add_argument("--transfer-latency-ms", type=float, default=1.0,
                   help="per transfer, beside its bytes")
    g.add_argument("--heartbeat", type=float, default=0.0, metavar="S",
                   help="feed the prompt trees the instances' KV events every S simulated "
                        "seconds (default 0: learn from routing only, with a TTL)")
    g.add_argument("--no-causal", action="store_true",
                   help="send a session's turns at their trace times, not after the "
                        "previous answer")
    g.add_argument("--dist-attention", default=None, type=_choices(["infinite", "multi",
                                                                    "single"]),
                   help="Infinite-LLM instead of MemServe's designs: infinite (KV spread "
                        "over the N instances), multi (vLLM-M), single (vLLM-S, one "
                        "instance over the N GPUs); a comma list or all (kvserve.sim.distattn)")
    g.add_argument("--no-hybrid", action="store_true",
                   help="--dist-attention: spread every attention layer's KV, not only the "
                        "full-attention layers'")


def _choices(names: list[str]):
    def parse(text: str) -> list[str]:
        got = names if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in got if n not in names]
        if bad or not got:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from "
                                             f"{names} or all")
        return got
    return parse


def config(args: argparse.Namespace, instance, design: str, routing: str):
    from kvserve.sim.cluster import ClusterConfig
    from kvserve.sim.network import GBIT, NetworkConfig

    return ClusterConfig(
        instance, instances=args.instances, prefill=args.prefill, design=design,
        routing=routing,
        network=NetworkConfig(args.network_gbps * GBIT, args.transfer_latency_ms / 1e3),
        heartbeat_s=args.heartbeat, causal=not args.no_causal)


def main(args: argparse.Namespace, trace: list, instance_config) -> None:
    """instance_config(policy) -> the SimConfig of every instance."""
    from kvserve.sim.cluster import simulate_cluster
    from kvserve.sim.cluster_metrics import summary, to_json

    if args.plot_dir:
        raise SystemExit("kvserve sim: --plot draws single-instance runs; use --json here")
    if args.dist_attention:
        return dist_main(args, trace, instance_config(args.policy[0]))
    runs = []
    for policy, design, routing in itertools.product(args.policy, args.design, args.routing):
        t0 = time.perf_counter()
        res = simulate_cluster(trace, config(args, instance_config(policy), design, routing))
        runs.append(res)
        _print_row(summary(res), policy, time.perf_counter() - t0, header=len(runs) == 1)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"trace": args.trace, "runs": [to_json(r) for r in runs]}, f)


def _print_row(s: dict, policy: str, wall: float, header: bool) -> None:
    if header:
        print(f"{s['model']} on {s['gpu']}, network {s['network_gbps']:.0f} Gb/s per NIC")
        print(f"{'policy':<8}{'design':<14}{'instances':<12}{'routing':<12}{'done':>6}"
              f"{'rej':>5}{'JCT s':>8}{'p99':>8}{'TTFT s':>9}{'p99':>9}{'hit':>7}"
              f"{'GB moved':>10}{'wall s':>8}")
    shape = "+".join(f"{s['instances'][r]}{r[0].upper()}"
                     for r in ("prefill", "decode", "colocated") if r in s["instances"])
    print(f"{policy:<8}{s['design']:<14}{shape:<12}{s['routing']:<12}{s['finished']:>6}"
          f"{s['rejected']:>5}{s['mean_jct_s']:>8.2f}{s['p99_jct_s']:>8.2f}"
          f"{s['mean_ttft_s']:>9.3f}{s['p99_ttft_s']:>9.3f}{s['hit_rate']:>7.1%}"
          f"{s['bytes'] / 1e9:>10.1f}{wall:>8.1f}")


def dist_main(args: argparse.Namespace, trace: list, instance) -> None:
    """--dist-attention: the same trace through each system of kvserve.sim.distattn."""
    from kvserve.sim.distattn import DistConfig, simulate_dist, summary
    from kvserve.sim.network import GBIT, NetworkConfig

    rows = []
    for mode in args.dist_attention:
        cfg = DistConfig(instance.model, instance.gpu, gpus=args.instances, mode=mode,
                         hybrid=not args.no_hybrid, tokens_per_block=instance.tokens_per_page,
                         max_num_seqs=instance.max_num_seqs,
                         gpu_utilization=instance.gpu_utilization,
                         heartbeat_s=args.heartbeat or 0.05,
                         network=NetworkConfig(args.network_gbps * GBIT,
                                               args.transfer_latency_ms / 1e3))
        t0 = time.perf_counter()
        s = summary(simulate_dist(trace, cfg))
        rows.append(s)
        if len(rows) == 1:
            print(f"{s['model']} on {args.instances} x {instance.gpu.name}")
            print(f"{'system':<10}{'done':>6}{'rej':>5}{'sim s':>9}{'tok/s':>10}{'out tok/s':>11}"
                  f"{'GB moved':>10}{'all-layer GB':>14}{'spread':>8}{'wall s':>8}")
        print(f"{mode:<10}{s['finished']:>6}{s['rejected']:>5}{s['sim_seconds']:>9.1f}"
              f"{s['tokens_per_s']:>10.0f}{s['output_tokens_per_s']:>11.0f}"
              f"{s['moved_bytes'] / 1e9:>10.1f}{s['all_layer_bytes'] / 1e9:>14.1f}"
              f"{s['max_spread']:>8}{time.perf_counter() - t0:>8.1f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"trace": args.trace, "runs": rows}, f)
