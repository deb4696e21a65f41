"""The reference for benchmarks/memory_core.py: vLLM's pure-Python BlockPool on the
same operations, the same pool size and the same workloads, on the same machine.

vLLM is not a dependency of kvserve; install it beside it, without its dependencies,
and add what its imports ask for (docs/benchmarks.md lists the exact commands):

    python benchmarks/vllm_blockpool.py                 # Python's hash() for blocks
    python benchmarks/vllm_blockpool.py --hash sha256   # vLLM's default block hash

kvserve hashes blocks with Python's hash(), so `builtin` is the like-for-like figure.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool

T = 16
REPEATS = 5


def _builtin(obj: object) -> bytes:
    return hash(obj).to_bytes(8, "little", signed=True)


class _Request:
    """What BlockPool.cache_full_blocks reads from a request."""

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes


class Bench:
    def __init__(self, num_blocks: int, hash_fn) -> None:
        self.n = num_blocks
        self.hash_fn = hash_fn
        kv_cache_utils.init_none_hash(hash_fn)

    def pool(self, half_full: bool) -> BlockPool:
        pool = BlockPool(self.n, True, T)
        if half_full:  # as memory_core.py: half the pool stays in use
            self._held = [pool.get_new_blocks(64) for _ in range(self.n // 2 // 64)]
        return pool

    def hashes(self, tokens: list[int]) -> list[bytes]:
        out, prev = [], None
        for i in range(0, len(tokens) // T * T, T):
            prev = kv_cache_utils.hash_block_tokens(self.hash_fn, prev, tokens[i:i + T])
            out.append(prev)
        return out

    def alloc_free(self, batch: int, rounds: int) -> float:
        pool = self.pool(half_full=True)
        t0 = time.perf_counter()
        for _ in range(rounds):
            pool.free_blocks(pool.get_new_blocks(batch))
        return (time.perf_counter() - t0) / (rounds * batch) * 1e6

    def decode(self, rounds: int, pages: int = 5) -> float:
        pool = self.pool(half_full=True)
        t0 = time.perf_counter()
        for _ in range(rounds):
            pool.free_blocks([pool.get_new_blocks(1)[0] for _ in range(pages)])
        return (time.perf_counter() - t0) / (rounds * pages) * 1e6

    def _serve(self, pool: BlockPool, tokens: list[int]) -> None:
        bh = self.hashes(tokens)
        blocks = pool.get_new_blocks(len(bh))
        pool.cache_full_blocks(_Request(bh), blocks, 0, len(bh), T, 0)
        pool.free_blocks(reversed(blocks))

    def prefix_hit(self, prompt_pages: int) -> float:
        """Hash the prompt, find its cached blocks and take a reference on them."""
        pool, rng = self.pool(half_full=False), random.Random(1)
        prompts = [[rng.randrange(50000) for _ in range(prompt_pages * T)] for _ in range(8)]
        for p in prompts:
            self._serve(pool, p + [0])
        elapsed, pages = 0.0, 0
        for i in range(200):
            tokens = prompts[i % 8] + [1]
            t0 = time.perf_counter()
            hit = []
            for h in self.hashes(tokens):
                got = pool.get_cached_block(h, [0])
                if got is None:
                    break
                hit.append(got[0])
            pool.touch(hit)
            elapsed += time.perf_counter() - t0
            pages += len(hit)
            pool.free_blocks(reversed(hit))
        assert pages == 200 * prompt_pages
        return elapsed / pages * 1e6

    def evict_alloc(self, prompt_pages: int) -> float:
        """A pool full of cache: hash a new prompt, miss, evict to allocate, publish."""
        pool, rng = self.pool(half_full=False), random.Random(0)
        n = prompt_pages * T
        for _ in range((self.n - 1) // prompt_pages):
            self._serve(pool, [rng.randrange(50000) for _ in range(n)])
        elapsed, pages = 0.0, 0
        for _ in range(300):
            tokens = [rng.randrange(50000) for _ in range(n)]
            t0 = time.perf_counter()
            bh = self.hashes(tokens)
            assert pool.get_cached_block(bh[0], [0]) is None
            blocks = pool.get_new_blocks(len(bh))
            pool.cache_full_blocks(_Request(bh), blocks, 0, len(bh), T, 0)
            elapsed += time.perf_counter() - t0
            pool.free_blocks(reversed(blocks))
            pages += len(bh)
        return elapsed / pages * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hash", choices=["builtin", "sha256"], default="builtin")
    ap.add_argument("--pages", type=int, default=131072)
    args = ap.parse_args()
    b = Bench(args.pages, _builtin if args.hash == "builtin" else sha256_cbor)
    runs = {
        "alloc_free_1": lambda: b.alloc_free(1, 50_000),
        "alloc_1_decode_free": lambda: b.decode(10_000),
        "alloc_free_64": lambda: b.alloc_free(64, 1_000),
        "prefix_hit": lambda: b.prefix_hit(128),
        "evict_alloc_hashed": lambda: b.evict_alloc(64),
    }
    us = {op: round(min(run() for _ in range(REPEATS)), 3) for op, run in runs.items()}
    print(json.dumps({"hash": args.hash, "pages": args.pages, "us_per_page": us}, indent=2))


if __name__ == "__main__":
    main()
