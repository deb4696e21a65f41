"""One prompt prefilled in one step, one sliding-window layer at Gemma 3 12B's shapes (16
query heads on 8 KV heads of 256, bf16, window 1024, pages of 16): the pool bytes the
layer's spec holds during the step and ms of its attention through PagedAttention's torch
path, with the chunk's keys read back from pages (every key written, as before) and from
the step's k and v (`window_only`: pages only for the window at the step's end and the prompt's
end region). Best of 5 calls after a warm-up; the device's clock where it is a GPU.

    python benchmarks/extend_attention.py [--device cuda] [--tokens 4096 16384]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvserve.memory import KVCacheManager, KVSpec, LayerKind
from kvserve.models.paged_attention import LayerBinding, PagedAttention, SeqStep
from kvserve.physical.pool import AttentionShape, KVPool

HQ, HKV, D, W, T = 16, 8, 256, 1024, 16
DTYPE = torch.bfloat16


def run(tokens: int, window_only: bool, device: str) -> dict:
    shape = AttentionShape(HKV, D, DTYPE)
    spec = KVSpec("sliding", LayerKind.SLIDING, 1, shape.bytes_per_token(), window=W)
    kv = KVCacheManager([spec], 2 * tokens * shape.bytes_per_token() + (64 << 20), T,
                        window_only=window_only)
    pool = KVPool(kv.layout, kv.num_large_pages, {"sliding": shape}, device)
    attn = PagedAttention(pool, [LayerBinding("sliding", 0, window=W, scale=D**-0.5)], T)
    # torch's path, the GPU's (forced on CPU); with every key paged, the chunk reads its
    # own keys back from the pages, as before window_only
    attn.kernels, attn.kernel_prefill = None, False
    if not window_only:
        attn._fresh = lambda key: False
    kv.add_request("r", list(range(tokens)))
    kv.lookup("r")
    assert kv.allocate_slots("r", tokens)
    held = kv.alloc.specs[0].n_used * kv.layout.page_bytes[0]  # the end region's too
    attn.prepare([SeqStep(0, tokens, kv.block_tables("r"))])
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(tokens, h, D, generator=g, device=device, dtype=DTYPE)
               for h in (HQ, HKV, HKV))
    out = attn(0, q, k, v)
    best = float("inf")
    for _ in range(5):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        attn(0, q, k, v)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return {"held_mib": round(held / 2**20, 1), "ms": round(best * 1e3, 2),
            "out": out.float().cpu()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    args = ap.parse_args()
    rows = {"device": torch.cuda.get_device_name(args.device) if args.device != "cpu"
            else "cpu", "torch": torch.__version__}
    for n in args.tokens:
        every, only = run(n, False, args.device), run(n, True, args.device)
        # The same keys either way: only where they are read from differs.
        diff = float((every.pop("out") - only.pop("out")).abs().max())
        rows[n] = {"every key paged": every, "window_only": only, "max_abs_diff": diff}
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
