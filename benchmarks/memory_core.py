"""Memory-core micro-benchmarks and the waste of each policy on two model mixes.

    python benchmarks/memory_core.py            # a table
    python benchmarks/memory_core.py --json     # one JSON object

Per-page costs are measured at 100k+ small pages; the reference figures are
vLLM's pure-Python BlockPool on this machine (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict

from kvserve.memory import KVCacheManager, KVSpec, LayerKind
from kvserve.memory.allocator import TwoLevelAllocator
from kvserve.memory.fill import (
    GEMMA3_MIX,
    VISION_MIX,
    KiB,
    MiB,
    compare_policies,
    image_requests,
    long_text_requests,
)

T = 16
GEMMA = GEMMA3_MIX
VLLM_REFERENCE_US = {"alloc_free_1": 0.9, "alloc_1_decode_free": 0.9, "alloc_free_64": 0.23,
                     "prefix_hit": 1.5, "evict_alloc_hashed": 2.2}


def _pool(num_pages: int) -> KVCacheManager:
    """A Gemma-layout manager whose full-attention spec has `num_pages` pages."""
    probe = KVCacheManager(GEMMA, 1 << 30, tokens_per_page=T)
    per_large = probe.layout.pages_per_large[0]
    return KVCacheManager(GEMMA, probe.layout.large_page_bytes * (num_pages // per_large),
                          tokens_per_page=T)


def _request_ids(n: int) -> list[str]:
    """Request ids are strings made before they reach the allocator, as in a server."""
    return [f"req-{i}" for i in range(n)]


def bench_alloc_free(num_pages: int, batch: int, rounds: int) -> float:
    """µs per page to allocate `batch` pages for a new request and free them."""
    alloc: TwoLevelAllocator = _pool(num_pages).alloc
    held = [alloc.allocate(i, [(0, 64)])[0] for i in range(num_pages // 64 // 2)]
    assert held  # half the pool stays in use, as in a busy server
    ids = _request_ids(rounds)
    need = [(0, batch)]
    t0 = time.perf_counter()
    for i, rid in enumerate(ids):
        (pids,) = alloc.allocate(rid, need)
        alloc.free(0, pids, i)
        alloc.forget_request(rid)
    return (time.perf_counter() - t0) / (rounds * batch) * 1e6


def bench_decode_pages(num_pages: int, rounds: int) -> float:
    """µs per page when a running request takes pages one at a time (decode growth)
    and frees them together when it finishes."""
    alloc: TwoLevelAllocator = _pool(num_pages).alloc
    k = alloc.specs[0].k
    held = [alloc.allocate(i, [(0, 64)])[0] for i in range(num_pages // 64 // 2)]
    assert held
    ids = _request_ids(rounds)
    need = [(0, 1)]
    t0 = time.perf_counter()
    for i, rid in enumerate(ids):
        pids = [alloc.allocate(rid, need)[0][0] for _ in range(k)]
        alloc.free(0, pids, i)
        alloc.forget_request(rid)
    return (time.perf_counter() - t0) / (rounds * k) * 1e6


def _full_only(num_pages: int) -> KVCacheManager:
    spec = [KVSpec("full", LayerKind.FULL, 1, 1 * KiB)]
    return KVCacheManager(spec, num_pages * T * KiB, tokens_per_page=T)


def _serve(mgr: KVCacheManager, rid: object, prompt: list[int]) -> None:
    mgr.add_request(rid, prompt)
    mgr.lookup(rid)
    mgr.begin_step()
    assert mgr.allocate_slots(rid, len(prompt))
    mgr.advance(rid, len(prompt))
    mgr.finish(rid)


def bench_prefix_hit(num_pages: int, prompt_pages: int) -> float:
    """µs per page to hash a prompt, find its cached pages and claim them."""
    mgr = _full_only(num_pages)
    rng = random.Random(1)
    prompts = [[rng.randrange(50000) for _ in range(prompt_pages * T)] for _ in range(8)]
    for i, p in enumerate(prompts):
        _serve(mgr, ("warm", i), p + [0])
    rounds, elapsed, pages = 200, 0.0, 0
    for i in range(rounds):
        rid = ("hit", i)
        mgr.add_request(rid, prompts[i % 8] + [1])
        t0 = time.perf_counter()
        pages += mgr.lookup(rid) // T
        elapsed += time.perf_counter() - t0
        mgr.finish(rid)
    assert pages == rounds * prompt_pages
    return elapsed / pages * 1e6


def bench_evict_alloc(num_pages: int, prompt_pages: int) -> float:
    """µs per page to take new prompts into a pool full of cache: hash the prompt, find
    no hit, evict cached pages to allocate, publish the new pages' hashes."""
    mgr = _full_only(num_pages)
    rng = random.Random(0)
    n = prompt_pages * T

    def prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(50000) for _ in range(n)] for _ in range(count)]

    for i, p in enumerate(prompts(num_pages // prompt_pages)):
        _serve(mgr, ("fill", i), p)  # every page now holds evictable cache
    assert mgr.stats().free == 0
    elapsed, pages = 0.0, 0
    for i, p in enumerate(prompts(300)):
        rid = ("new", i)
        mgr.add_request(rid, p)
        mgr.begin_step()
        t0 = time.perf_counter()
        assert mgr.lookup(rid) == 0
        assert mgr.allocate_slots(rid, n)
        mgr.advance(rid, n)
        elapsed += time.perf_counter() - t0
        mgr.finish(rid)
        pages += prompt_pages
    return elapsed / pages * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--pages", type=int, default=131072, help="small pages in the pool")
    args = ap.parse_args()
    random.seed(0)
    n = args.pages
    us = {
        "alloc_free_1": bench_alloc_free(n, 1, 200_000),
        "alloc_1_decode_free": bench_decode_pages(n, 40_000),
        "alloc_free_64": bench_alloc_free(n, 64, 5_000),
        "prefix_hit": bench_prefix_hit(n, 128),
        "evict_alloc_hashed": bench_evict_alloc(n, 64),
    }
    waste = {
        "gemma3_15sliding_3full": compare_policies(GEMMA3_MIX, 2048 * MiB, long_text_requests),
        "llama32_vision_32self_8cross": compare_policies(VISION_MIX, 8192 * MiB, image_requests),
    }
    result = {
        "pages": n,
        "us_per_page": {k: round(v, 3) for k, v in us.items()},
        "vllm_blockpool_us_per_page": VLLM_REFERENCE_US,
        "waste": {mix: [asdict(r) for r in rows] for mix, rows in waste.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'operation':<22}{'kvserve us/page':>16}{'vLLM BlockPool':>16}")
    for k, v in result["us_per_page"].items():
        print(f"{k:<22}{v:>16.3f}{VLLM_REFERENCE_US[k]:>16.2f}")
    for mix, rows in waste.items():
        print(f"\n{mix}")
        for r in rows:
            print(f"  {r.policy:<10} admitted {r.admitted:>4}  waste {r.waste_fraction:.2%}")


if __name__ == "__main__":
    main()
