"""Decode attention alone: --rows query rows of Gemma 3 270M's shapes (4 query heads, 1 KV
head, head_dim 256) over --keys keys each, in pages of 16 tokens placed in random order,
through 18 layers' pools (so the pages come from DRAM, as in a decode step).

    python benchmarks/decode_attention.py [--keys 256] [--dtype bf16|f32] [--lib a.so ...]

Prints ms for the 18 layers (best of 7 interleaved rounds of 3) and the KV read rate, for
this machine's build of kernels/paged_attention.c and each --lib (another build of the
kernels' sources, e.g. an older commit's: `cc -O3 -march=native -fopenmp -shared -fPIC
-o old.so kernels/*.c -lm`), with the largest difference from the first.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from kvserve.cpu_features import summary
from kvserve.kernels.cpu import CpuKernels, cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--keys", type=int, default=256)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--lib", nargs="*", default=[])
    args = ap.parse_args()
    torch.manual_seed(0)
    R, Hq, Hkv, D, T, N = args.rows, 4, 1, 256, 16, args.keys
    pages = R * (N // T)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    pools = [torch.randn(pages, 2, T, Hkv, D).to(dtype) for _ in range(args.layers)]
    tables = torch.randperm(pages).view(R, -1).to(torch.int32)
    seq, lo = torch.arange(R, dtype=torch.int32), torch.zeros(R, dtype=torch.int32)
    n_keys = torch.full((R,), N, dtype=torch.int32)
    q = torch.randn(R, Hq, D).to(dtype)
    builds = {"this build": cpu_kernels(), **{p: CpuKernels(ctypes.CDLL(p)) for p in args.lib}}
    outs = {k: b.paged_attention(q, pools[0], tables, seq, lo, n_keys, 0.0625)
            for k, b in builds.items()}
    first = next(iter(outs.values())).float()
    best = dict.fromkeys(builds, float("inf"))
    for _ in range(7):
        for name, k in builds.items():
            t0 = time.perf_counter()
            for _ in range(3):
                for pool in pools:
                    k.paged_attention(q, pool, tables, seq, lo, n_keys, 0.0625)
            best[name] = min(best[name], (time.perf_counter() - t0) / 3)
    read = args.layers * R * N * 2 * Hkv * D * pools[0].element_size()
    print(summary())
    for name, t in best.items():
        diff = (outs[name].float() - first).abs().max().item()
        print(f"{name}: {t * 1e3:.2f} ms, {read / t / 1e9:.1f} GB/s, max diff {diff:.2g}")


if __name__ == "__main__":
    main()
