"""Fill a pool with synthetic requests until it is full; report what fits and the waste.

Shared by `kvserve demo` and benchmarks/memory_core.py: the same model mixes
under every policy show what Jenga's layout buys.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvserve.memory.baselines import POLICIES
from kvserve.memory.manager import KVCacheManager
from kvserve.memory.prefix_cache import ImageInput
from kvserve.memory.spec import KVSpec, LayerKind

KiB, MiB = 1 << 10, 1 << 20

# Gemma 3 270M: 1 KV head x 256 dims, K+V in bf16 = 1 KiB per token per layer.
GEMMA3_MIX = (
    KVSpec("full", LayerKind.FULL, 3, 1 * KiB),
    KVSpec("sliding", LayerKind.SLIDING, 15, 1 * KiB, window=512),
)
# Llama 3.2 11B Vision: 8 KV heads x 128 dims, K+V in bf16 = 4 KiB per token per layer.
VISION_MIX = (
    KVSpec("self", LayerKind.FULL, 32, 4 * KiB),
    KVSpec("cross", LayerKind.CROSS, 8, 4 * KiB),
)


@dataclass
class FillResult:
    policy: str
    admitted: int
    waste_fraction: float
    used_bytes: int
    ideal_bytes: int


def fill(mgr: KVCacheManager, make_request, limit: int = 100_000) -> int:
    """Admit requests (tokens, images) until one no longer fits; returns how many fit."""
    for rid in range(limit):
        tokens, images = make_request(rid)
        mgr.add_request(rid, tokens, images)
        mgr.lookup(rid)
        if not mgr.allocate_slots(rid, len(tokens)):
            mgr.abort(rid)
            return rid
        mgr.advance(rid, len(tokens))
    return limit


def long_text_requests(seed: int = 0, lo: int = 500, hi: int = 8000):
    """Distinct prompts of uniform random length in [lo, hi)."""
    rng = random.Random(seed)

    def make(rid: int):
        n = rng.randrange(lo, hi)
        return list(range(rid * hi, rid * hi + n)), ()

    return make


def image_requests(text_tokens: int = 43, image_tokens: int = 6193):
    """MMMU-pro shapes: one image of 6193 tokens and 43 text tokens per request."""

    def make(rid: int):
        return list(range(text_tokens)), (ImageInput(("image", rid), 0, image_tokens),)

    return make


def compare_policies(specs, pool_bytes: int, make_requests, tokens_per_page: int = 16):
    """FillResult of every policy on the same request stream."""
    out = []
    for policy in POLICIES:
        mgr = KVCacheManager(specs, pool_bytes, tokens_per_page, policy=policy)
        admitted = fill(mgr, make_requests())
        st = mgr.stats()
        out.append(FillResult(policy, admitted, st.waste_fraction, st.used, st.ideal))
    return out
