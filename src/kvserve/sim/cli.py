"""`kvserve sim`: replay a trace through the real memory core and scheduler at GPU scale.

    kvserve sim --model ministral-8b --gpu h100 --policy all --trace decode20 \\
        --json out.json --plot out/

`--trace` is a JSONL file or a generator (`name` or `name:key=value,...`):
decode20, static, dynamic, arxiv-qa, mmmu, sharegpt, sharegpt-chat, doc-qa, long-mix
(see kvserve.sim.traces). With `--instances N` the trace runs through a simulated
cluster of N such engines instead (MemServe's designs and global scheduler:
kvserve.sim.cluster_cli); add `--dist-attention infinite,multi,single` for
Infinite-LLM against vLLM-M and vLLM-S on N GPUs (kvserve.sim.distattn).
"""

from __future__ import annotations

import argparse
import json
import time

from kvserve.memory.baselines import POLICIES
from kvserve.sim import cluster_cli
from kvserve.sim.gpus import GPUS, get_gpu
from kvserve.sim.models import BF16, FP8, MODELS, get_model
from kvserve.sim.traces import GENERATORS, load_trace, write_jsonl

FP8_CHOICES = ("auto", "off", "weights", "weights+kv")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    p.add_argument("--policy", default="jenga", type=_policies,
                   help=f"one of {list(POLICIES)}, a comma list, or all (side by side)")
    p.add_argument("--trace", required=True,
                   help=f"JSONL file, or generator[:key=value,...] of {sorted(GENERATORS)}")
    p.add_argument("--json", dest="json_out", help="write metrics and per-step series here")
    p.add_argument("--plot", dest="plot_dir", help="write PNG plots into this directory")
    p.add_argument("--save-trace", help="write the (generated) trace as JSONL")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (no comm. cost)")
    p.add_argument("--fp8", choices=FP8_CHOICES, default="auto",
                   help="auto: FP8 weights where the Jenga paper's Table 1 marks *")
    p.add_argument("--tokens-per-page", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the model's context length")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="per-step token budget; default max(max_model_len, 2048) as vLLM v0 "
                        "without chunked prefill")
    p.add_argument("--gpu-utilization", type=float, default=0.9)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--host-memory", type=float, default=0.0, metavar="GB",
                   help="a host tier of this many GB keeps what the KV pool evicts "
                        "(loads and write-backs cost PCIe time)")
    p.add_argument("--mem-every", type=int, default=None,
                   help="record the memory core's stats every N steps (default 1; "
                        "a cluster: 0, never)")
    cluster_cli.add_arguments(p)


def _policies(text: str) -> list[str]:
    if text == "all":
        return list(POLICIES)
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {bad or text!r}; choose from "
                                         f"{list(POLICIES)} or all")
    return names


def _precision(args: argparse.Namespace) -> tuple[bool, int]:
    """(FP8 weights?, KV bytes per element)."""
    if args.fp8 == "auto":
        return args.gpu in get_model(args.model).fp8_gpus, BF16
    return args.fp8 != "off", FP8 if args.fp8 == "weights+kv" else BF16


def _config(args: argparse.Namespace, policy: str):
    from kvserve.sim.simulator import SimConfig

    fp8_weights, kv_bytes = _precision(args)
    return SimConfig(
        get_model(args.model), get_gpu(args.gpu), policy=policy,
        tokens_per_page=args.tokens_per_page, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_utilization=args.gpu_utilization, fp8_weights=fp8_weights, kv_dtype_bytes=kv_bytes,
        tp=args.tp, enable_caching=not args.no_prefix_caching,
        mem_every=(0 if args.instances else 1) if args.mem_every is None else args.mem_every,
        host_bytes=int(args.host_memory * 1e9),
    )


def main(args: argparse.Namespace) -> None:
    from kvserve.sim.metrics import summary, to_json
    from kvserve.sim.simulator import OutOfMemory, simulate

    trace = load_trace(args.trace)
    if args.save_trace:
        write_jsonl(args.save_trace, trace)
    if args.instances:
        return cluster_cli.main(args, trace, lambda policy: _config(args, policy))
    runs = []
    for policy in args.policy:
        t0 = time.perf_counter()
        try:
            res = simulate(trace, _config(args, policy))
        except OutOfMemory as e:
            raise SystemExit(f"kvserve sim: {e}") from None
        runs.append(res)
        _print_row(summary(res), time.perf_counter() - t0, header=len(runs) == 1)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"trace": args.trace, "runs": [to_json(r) for r in runs]}, f)
    if args.plot_dir:
        from kvserve.sim.plots import plot_runs

        for path in plot_runs(runs, args.plot_dir):
            print(f"wrote {path}")


def _print_row(s: dict, wall: float, header: bool) -> None:
    if header:
        print(f"{s['model']} on {s['gpu']} x{s['tp']}, KV pool {s['kv_pool_bytes'] / 1e9:.1f} GB")
        print(f"{'policy':<9}{'done':>6}{'rej':>5}{'steps':>7}{'sim s':>9}{'out tok/s':>11}"
              f"{'dec batch':>10}{'hit':>7}{'waste':>8}{'preempt':>8}{'wall s':>8}")
    print(f"{s['policy']:<9}{s['finished']:>6}{s['rejected']:>5}{s['steps']:>7}"
          f"{s['sim_seconds']:>9.1f}{s['output_tokens_per_s']:>11.1f}"
          f"{s['avg_decode_batch']:>10.2f}{s['hit_rate']:>7.1%}{s['waste_of_held']:>8.2%}"
          f"{s['preemptions']:>8}{wall:>8.1f}")
