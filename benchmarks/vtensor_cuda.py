"""vTensor's CUDA backend on a GPU: what mapping costs per 2 MiB chunk, and whether
kernels read a virtual, contiguous KV tensor as fast as ordinary device memory.

    python benchmarks/vtensor_cuda.py            # needs a CUDA device and cuda-python

map: per chunk, median microseconds of Extend by one chunk that the device must
create (cuMemCreate + cuMemMap + cuMemSetAccess), of one taken from the pool's
free chunks (map only), of Unmap, and of punching the freed chunks
(cuMemRelease). read / attention: a K and a V of `--tokens` tokens, each a
vTensor view, against the same data in tensors from torch's allocator: GB/s of
a sum over K, and decode SDPA (one query token) over K and V.

Imports only kvserve.physical and torch, so it runs where the engine's model
packages are not installed (a bare GPU machine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvserve.physical.cuda_vmm import CudaBackend
from kvserve.physical.vtensor import DEFAULT_CHUNK_BYTES, ChunkPool, VTensorPool

HEADS, DIM = 8, 128  # a KV head group of a 7B-class model, float16
BYTES_PER_TOKEN = HEADS * DIM * 2


def make_pool(num_chunks: int) -> VTensorPool:
    backend = CudaBackend(DEFAULT_CHUNK_BYTES, num_chunks)
    return VTensorPool(BYTES_PER_TOKEN, num_chunks * DEFAULT_CHUNK_BYTES // BYTES_PER_TOKEN,
                       chunks=ChunkPool(backend), ahead_chunks=0)


def map_costs(num_chunks: int, reps: int) -> dict[str, float]:
    pool = make_pool(num_chunks)
    tpc = pool.tokens_per_chunk
    times: dict[str, list[float]] = {k: [] for k in ("create+map", "map", "unmap", "punch")}

    def grow(kind: str) -> None:
        for i in range(1, num_chunks + 1):  # one chunk at a time, as a decode Extend does
            t = time.perf_counter()
            pool.extend("a", i * tpc)
            times[kind].append(time.perf_counter() - t)

    for _ in range(reps):
        pool.create("a")
        vt = pool.active["a"]
        grow("create+map")
        vt.unmap(0)  # back to the free chunks, memory kept
        grow("map")
        for i in reversed(range(num_chunks)):
            t = time.perf_counter()
            vt.unmap(i)
            times["unmap"].append(time.perf_counter() - t)
        t = time.perf_counter()
        punched = pool.chunks.punch() // DEFAULT_CHUNK_BYTES
        times["punch"].append((time.perf_counter() - t) / max(punched, 1))
        pool.release("a")
    pool.close()
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def timed(fn, reps: int = 50) -> float:
    """Median seconds of fn() on the device."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def reads(tokens: int) -> dict[str, tuple[float, float]]:
    """(GB/s of a sum over K, ms of decode SDPA over K and V) per kind of memory."""
    chunks = 2 * -(-tokens * BYTES_PER_TOKEN // DEFAULT_CHUNK_BYTES)
    pool = make_pool(chunks)
    for req in ("k", "v"):
        pool.create(req)
        pool.extend(req, tokens)
    virt = [pool.view(req, torch.float16)[:tokens].view(tokens, HEADS, DIM) for req in "kv"]
    for t in virt:
        t.normal_()
    plain = [t.clone() for t in virt]
    q = torch.randn(1, HEADS, 1, DIM, device="cuda", dtype=torch.float16)
    out, attended = {}, []
    for name, (k, v) in (("vtensor", virt), ("torch allocator", plain)):
        s = timed(lambda k=k: k.sum(dtype=torch.float32))
        kk, vv = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, heads, tokens, dim]
        a = timed(lambda kk=kk, vv=vv: F.scaled_dot_product_attention(q, kk, vv))
        out[name] = (k.numel() * 2 / s / 1e9, a * 1e3)
        attended.append(F.scaled_dot_product_attention(q, kk, vv))
    assert torch.equal(*attended), "a vTensor view must compute exactly what a copy does"
    del virt, plain
    torch.cuda.synchronize()
    for req in "kv":
        pool.release(req)
    pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=512, help="map: chunks per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072])
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    c = map_costs(args.chunks, args.reps)
    print("| Extend, chunk created | Extend, chunk reused | Unmap | punch (cuMemRelease) |")
    print("|---|---|---|---|")
    print(f"| {c['create+map']:.1f} us | {c['map']:.1f} us | {c['unmap']:.1f} us | "
          f"{c['punch']:.1f} us |")
    print("\n| tokens | memory | sum over K, GB/s | decode SDPA, ms |")
    print("|---|---|---|---|")
    for n in args.tokens:
        for name, (gbs, ms) in reads(n).items():
            print(f"| {n} | {name} | {gbs:.0f} | {ms:.3f} |")


if __name__ == "__main__":
    main()
