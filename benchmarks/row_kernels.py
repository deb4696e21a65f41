"""The row kernels a decode step calls per layer (kernels/norms.c, activations.c) at Gemma 3
270M's shapes, µs a call, best of 5 loops of 300 calls, bfloat16 rows (float32 with --dtype).

    python benchmarks/row_kernels.py [--rows 1,8,32] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.cpu_features import summary
from kvserve.kernels.cpu import cpu_kernels


def best_us(fn, calls: int = 300, loops: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def row(k, rows: int, bf: torch.dtype) -> list[float]:
    """µs a call of each kernel at `rows` rows of dtype bf."""
    gate_up = torch.randn(rows, 4096).to(bf)
    x, h, w = torch.randn(rows, 640).to(bf), torch.randn(rows, 640).to(bf), torch.randn(640)
    q, scale = torch.randn(rows, 4, 256).to(bf), torch.randn(4, 256)
    cos_sin = (torch.randn(rows, 1, 256).to(bf), torch.randn(rows, 1, 256).to(bf))
    return [best_us(lambda: k.gelu_mul(gate_up)),
            best_us(lambda: k.add_norm(x, h, w, 1e-6, w)),
            best_us(lambda: k.norm_rope(q, scale, 1e-6, cos_sin))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    k = cpu_kernels()
    if k is None:
        raise SystemExit("the C kernels did not build here")
    print(f"cpu: {summary()}")
    print("| rows | gelu_mul (2 x 2048) | add_norm (640) | norm_rope (4 x 256) |")
    for rows in map(int, args.rows.split(",")):
        cells = row(k, rows, getattr(torch, args.dtype))
        print(f"| {rows} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
