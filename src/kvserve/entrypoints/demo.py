"""`kvserve demo`: fill a KV pool with long requests under each policy; print what fits."""

from __future__ import annotations

import argparse

from kvserve.memory.fill import (
    GEMMA3_MIX,
    VISION_MIX,
    MiB,
    compare_policies,
    image_requests,
    long_text_requests,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pool-mib", type=int, default=2048, help="KV pool size in MiB")


def main(args: argparse.Namespace) -> None:
    mixes = [
        ("Gemma 3 (15 sliding + 3 full layers), prompts of 500-8000 tokens",
         GEMMA3_MIX, args.pool_mib * MiB, long_text_requests),
        ("Llama 3.2 Vision (32 self + 8 cross layers), 6193 image + 43 text tokens",
         VISION_MIX, 4 * args.pool_mib * MiB, image_requests),
    ]
    for title, specs, pool, make in mixes:
        print(f"\n{title}; KV pool {pool // MiB} MiB")
        print(f"  {'policy':<10}{'requests':>10}{'used MiB':>10}{'ideal MiB':>11}{'waste':>9}")
        for r in compare_policies(specs, pool, make):
            print(f"  {r.policy:<10}{r.admitted:>10}{r.used_bytes / MiB:>10.1f}"
                  f"{r.ideal_bytes / MiB:>11.1f}{r.waste_fraction:>9.1%}")
