"""One prefill chunk's attention in kernels/paged_attention.c at Gemma 3 270M's shapes (4
query heads on 1 KV head of 256, bf16, pages of 16), three ways: blocks of 16 rows on AMX's
tiles (the machine's build, where the CPU has them), blocks with vdpbf16ps (a build without
AMX) and row by row (the machine's build called 15 rows at a time: blocks need 16 rows of
one sequence). ms a call, best of 3, and GFLOP/s counting the two products (4 flops a
query head, key and dim).

    python benchmarks/prefill_attention.py [--chunk 2048] [--before 0,5952] [--window 0,512]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.cpu_features import summary
from kvserve.kernels.cpu import cpu_kernels

HQ, HKV, D, T = 4, 1, 256, 16


def chunk(before: int, new: int, window: int) -> tuple[torch.Tensor, ...]:
    """One sequence's pages (shuffled in the pool) and its chunk's rows: q, cache, the
    table and each row's (seq, lo, n)."""
    g = torch.Generator().manual_seed(0)
    pages = -(-(before + new) // T)
    cache = torch.randn(pages + 2, 2, T, HKV, D, generator=g).bfloat16()
    table = torch.randperm(pages + 2, generator=g)[:pages].int()[None]
    pos = torch.arange(before, before + new)
    lo = (pos - window + 1).clamp(min=0) if window else torch.zeros_like(pos)
    n = pos + 1 - lo
    q = torch.randn(new, HQ, D, generator=g).bfloat16()
    return q, cache, table, torch.zeros(new, dtype=torch.int32), lo.int(), n.int()


class RowByRow:
    """A build's paged_attention called on at most 15 rows at a time: below a block's 16
    rows every row takes the row path."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def __getattr__(self, name: str):  # every other entry point as the build has it
        return getattr(self.kernels, name)

    def paged_attention(self, q, cache, tables, seq, lo, n, scale, lse=None):
        parts = []
        for a in range(0, q.shape[0], 15):
            rows = slice(a, a + 15)
            part = None if lse is None else lse[rows]
            parts.append(self.kernels.paged_attention(q[rows], cache, tables, seq[rows], lo[rows],
                                                      n[rows], scale, part))
            if lse is not None:
                lse[rows] = part
        return torch.cat(parts)


def best_ms(kernels, args: tuple[torch.Tensor, ...]) -> float:
    kernels.paged_attention(*args[:6], D**-0.5)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        kernels.paged_attention(*args[:6], D**-0.5)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--before", default="0,5952", help="keys cached before the chunk")
    ap.add_argument("--window", default="0,512", help="0: full attention")
    args = ap.parse_args()
    builds = {"tiles": cpu_kernels(), "vectors": cpu_kernels(("-mno-amx-tile",)),
              "rows": RowByRow(cpu_kernels())}
    print(f"cpu: {summary()}; AMX tiles granted: {builds['tiles'].amx_ready()}")
    print("| keys before | chunk | window | tiles, ms (GFLOP/s) | vectors | rows |")
    print("|---|---|---|---|---|---|")
    for before in map(int, args.before.split(",")):
        for window in map(int, args.window.split(",")):
            case = chunk(before, args.chunk, window)
            flop = float(case[5].double().sum()) * HQ * D * 4
            ms = {name: best_ms(k, case) for name, k in builds.items()}
            cells = [f"{ms[k]:.1f} ({flop / ms[k] / 1e6:.0f})" for k in builds]
            print(f"| {before} | {args.chunk} | {window or 'full'} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
