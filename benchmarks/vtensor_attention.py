"""Attention time on one Gemma-3-270M-shaped layer: contiguous virtual KV vs paged vs gather.

    PYTHONPATH=src python benchmarks/vtensor_attention.py [--contexts 1024,4096,...]

One full-attention layer (4 query heads, 1 KV head, head_dim 256, float32),
one request whose context is L tokens:

* decode: one new token attending to all L keys;
* prefill: the last `--chunk` tokens of the context (a prefill chunk after a
  prefix of L - chunk tokens) attending causally.

Backends, each called exactly as the engine calls it (new K/V written, then
attention):

* vtensor: `VirtualAttention`, SDPA over the request's contiguous virtual KV;
* paged: `PagedAttention` as the engine runs it with the compiled CPU
  kernels (the attention kernel for decode rows, SDPA over gathered pages
  for prefill chunks), pages in a shuffled order (a long-running pool is
  never in order);
* gather: `PagedAttention`'s torch path, which gathers the pages into a
  contiguous copy and then runs matmuls (decode) or SDPA (prefill);
* kernel over vtensor: the same compiled CPU kernel reading the contiguous
  virtual KV in place, as pages of one token with an identity table (no
  write; attention only): the kernel's cost without a scattered layout.

Times are medians of `--repeat` calls, in milliseconds; a markdown table and
the CPU come out on stdout.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvserve.cpu_features import summary
from kvserve.kernels.cpu import kernels_for
from kvserve.memory import KVCacheManager, KVSpec, LayerKind
from kvserve.models.paged_attention import LayerBinding, PagedAttention, SeqStep
from kvserve.models.virtual_attention import VirtualAttention, VirtualSeq
from kvserve.physical.pool import AttentionShape, KVPool

HQ, HKV, D = 4, 1, 256
T = 16  # tokens per page, the engine's default
SCALE = 256 ** -0.5


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm up: first touch, kernel compilation
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def qkv(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (torch.randn(n, HQ, D, dtype=dtype), torch.randn(n, HKV, D, dtype=dtype),
            torch.randn(n, HKV, D, dtype=dtype))


def vtensor_call(ctx: int, n: int, dtype: torch.dtype) -> Callable[[], object]:
    """The request's first ctx - n tokens prefilled (KV random), then a step of n tokens."""
    shape = AttentionShape(HKV, D, dtype)
    attn = VirtualAttention([0], shape, SCALE, 4 * ctx * shape.bytes_per_token(), T)
    tokens = list(range(ctx))
    first = VirtualSeq("r", tokens, 0, ctx - n, ctx)
    attn.prepare([first])
    attn.views[0][0][: ctx - n].normal_()
    attn.commit()
    attn.prepare([VirtualSeq("r", tokens, ctx - n, n, ctx)])
    q, k, v = qkv(n, dtype)
    return lambda: attn(0, q, k, v)


def vtensor_kernel_call(ctx: int, n: int, dtype: torch.dtype) -> Callable[[], object]:
    """The paged CPU kernel over a vTensor: [L, 2, Hkv, D] seen as L pages of one token."""
    shape = AttentionShape(HKV, D, dtype)
    attn = VirtualAttention([0], shape, SCALE, 4 * ctx * shape.bytes_per_token(), T)
    attn.prepare([VirtualSeq("r", list(range(ctx)), 0, ctx, ctx)])
    cache = attn.views[0][0][:ctx].unsqueeze(2).normal_()  # [L, 2, 1, Hkv, D]
    kernels = kernels_for(cache)
    if kernels is None:
        return lambda: None
    pos = torch.arange(ctx - n, ctx, dtype=torch.int32)
    table = torch.arange(ctx, dtype=torch.int32)[None]
    seq, lo = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    q = torch.randn(n, HQ, D, dtype=dtype)
    return lambda: kernels.paged_attention(q, cache, table, seq, lo, pos + 1, SCALE)


def paged_call(ctx: int, n: int, dtype: torch.dtype, kernel: bool) -> Callable[[], object]:
    """PagedAttention over a shuffled page table of ctx tokens; `kernel` False = gather path."""
    shape = AttentionShape(HKV, D, dtype)
    spec = KVSpec("full", LayerKind.FULL, 1, shape.bytes_per_token())
    kv = KVCacheManager([spec], 2 * ctx * shape.bytes_per_token() + (4 << 20), T)
    pool = KVPool(kv.layout, kv.num_large_pages, {"full": shape})
    pool.layer("full", 0).normal_()
    attn = PagedAttention(pool, [LayerBinding("full", 0, scale=SCALE)], T)
    if not kernel:
        attn.kernels = None
    pages = -(-ctx // T)
    num_pages = pool.layer("full", 0).shape[0]
    table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(0))[:pages]
    attn.prepare([SeqStep(ctx - n, n, {"full": table.tolist()})])
    q, k, v = qkv(n, dtype)
    return lambda: attn(0, q, k, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (query tokens)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"CPU: {summary()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.dtype}, 1 layer: {HQ} q heads, {HKV} KV head, head_dim {D}\n")
    print("| context | step | vtensor SDPA (ms) | paged (ms) | gather + SDPA (ms) "
          "| kernel over vtensor (ms) |")
    print("|---:|---|---:|---:|---:|---:|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        for step, n in (("decode", 1), (f"prefill {args.chunk}", min(args.chunk, ctx // 2))):
            row = [median_ms(vtensor_call(ctx, n, dtype), args.repeat),
                   median_ms(paged_call(ctx, n, dtype, kernel=True), args.repeat),
                   median_ms(paged_call(ctx, n, dtype, kernel=False), args.repeat),
                   median_ms(vtensor_kernel_call(ctx, n, dtype), args.repeat)]
            print(f"| {ctx} | {step} | " + " | ".join(f"{t:.3f}" for t in row) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
