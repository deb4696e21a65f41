"""One prefill chunk's attention in kernels/paged_attention.c at Gemma 3 270M's shapes (4
query heads on 1 KV head of 256, pages of 16). bf16, three ways: blocks of 16 rows on AMX's
tiles (the machine's build, where the CPU has them), blocks with vdpbf16ps (a build without
AMX) and row by row (the machine's build called 15 rows at a time: blocks need 16 rows of
one sequence). float32: blocks (the rows in a vector's lanes) in the machine's build and in
an AVX2 one (-mno-avx512f: what AVX2-only CPUs run), and row by row in both. ms a call,
best of 3, and GFLOP/s counting the two products (4 flops a query head, key and dim).

    python benchmarks/prefill_attention.py [--chunk 2048] [--before 0,5952] [--window 0,512]
        [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.cpu_features import summary
from kvserve.kernels.cpu import cpu_kernels

HQ, HKV, D, T = 4, 1, 256, 16


def chunk(before: int, new: int, window: int,
          dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """One sequence's pages (shuffled in the pool) and its chunk's rows: q, cache, the
    table and each row's (seq, lo, n)."""
    g = torch.Generator().manual_seed(0)
    pages = -(-(before + new) // T)
    cache = torch.randn(pages + 2, 2, T, HKV, D, generator=g).to(dtype)
    table = torch.randperm(pages + 2, generator=g)[:pages].int()[None]
    pos = torch.arange(before, before + new)
    lo = (pos - window + 1).clamp(min=0) if window else torch.zeros_like(pos)
    n = pos + 1 - lo
    q = torch.randn(new, HQ, D, generator=g).to(dtype)
    return q, cache, table, torch.zeros(new, dtype=torch.int32), lo.int(), n.int()


class RowByRow:
    """A build's paged_attention called on at most 15 rows at a time: below a block's 16
    rows every row takes the row path."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def __getattr__(self, name: str):  # every other entry point as the build has it
        return getattr(self.kernels, name)

    def paged_attention(self, q, cache, tables, seq, lo, n, scale, lse=None, step_pages=None):
        parts = []
        for a in range(0, q.shape[0], 15):
            rows = slice(a, a + 15)
            part = None if lse is None else lse[rows]
            parts.append(self.kernels.paged_attention(q[rows], cache, tables, seq[rows], lo[rows],
                                                      n[rows], scale, part, step_pages))
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
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16:
        builds = {"tiles": cpu_kernels(), "vectors": cpu_kernels(("-mno-amx-tile",)),
                  "rows": RowByRow(cpu_kernels())}
    else:
        avx2 = cpu_kernels(("-mno-avx512f",))
        builds = {"blocks": cpu_kernels(), "blocks, AVX2 build": avx2,
                  "rows": RowByRow(cpu_kernels()), "rows, AVX2 build": RowByRow(avx2)}
    print(f"cpu: {summary()}; AMX tiles granted: {cpu_kernels().amx_ready()}; {args.dtype}")
    print(f"| keys before | chunk | window | {' | '.join(builds)} |")
    print("|---|---|---|" + "---|" * len(builds))
    for before in map(int, args.before.split(",")):
        for window in map(int, args.window.split(",")):
            case = chunk(before, args.chunk, window, dtype)
            flop = float(case[5].double().sum()) * HQ * D * 4
            ms = {name: best_ms(k, case) for name, k in builds.items()}
            cells = [f"{ms[k]:.1f} ({flop / ms[k] / 1e6:.0f})" for k in builds]
            print(f"| {before} | {args.chunk} | {window or 'full'} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
