"""Baseline memory policies behind the same facade, for benchmarks and the simulator.

Each is a different layout of the same two-level allocator:

- jenga: the model's specs, large page = LCM of their page sizes.
- max_page: the model's specs, every small page padded to the largest one.
- static: the model's specs and LCM pages, the pool split equally between
  specs at start (no memory moves between layer types).
- uniform: PagedAttention as in vLLM v0: every token, text or image, holds KV
  for every layer, in one page size (Mamba states get pages of that size).
- vllm_align: vLLM v1's geometry for Mamba hybrids (`mamba_cache_mode="align"`,
  `Platform._align_hybrid_block_size`): the attention block grows to the
  smallest multiple of the kernel block (`tokens_per_page`) whose per-layer
  page holds one layer's Mamba state, and the state page is padded to it.
  States are cached only at block ends, one per step (the last block end the
  step reaches: the align scheduler stops a prefill there), so hits come in
  whole blocks. Layers are grouped as vLLM groups them (group size = the
  fewest layers of a type, or the most if under 1.5x that), a type's last
  short group padded with layers. Allocation, hits and eviction stay
  kvserve's: only the geometry is vLLM's. Without Mamba layers it is jenga's
  layout (vLLM keeps its 16-token block there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from kvserve.memory.spec import KVSpec, LayerKind, Layout, make_layout

POLICIES = ("jenga", "max_page", "static", "uniform", "vllm_align")


def policy_layout(
    policy: str, specs: Sequence[KVSpec], tokens_per_page: int
) -> tuple[Layout, bool, dict[str, tuple[str, ...]]]:
    """(layout, partitioned, model specs that each layout spec stands for)."""
    specs = tuple(specs)
    identity = {s.name: (s.name,) for s in specs}
    if policy == "jenga":
        return make_layout(specs, tokens_per_page), False, identity
    if policy == "static":
        return make_layout(specs, tokens_per_page), True, identity
    if policy == "max_page":
        return _padded(specs, tokens_per_page), False, identity
    if policy == "uniform":
        return _uniform(specs, tokens_per_page)
    if policy == "vllm_align":
        return _vllm_align(specs, tokens_per_page), False, identity
    raise ValueError(f"unknown policy {policy!r}; choose from {list(POLICIES)}")


def _padded(specs: tuple[KVSpec, ...], tokens_per_page: int) -> Layout:
    biggest = max(s.page_bytes(tokens_per_page) for s in specs)
    return make_layout(specs, tokens_per_page, [biggest] * len(specs))


def _uniform(
    specs: tuple[KVSpec, ...], tokens_per_page: int
) -> tuple[Layout, bool, dict[str, tuple[str, ...]]]:
    attn = [s for s in specs if s.kind is not LayerKind.MAMBA]
    per_token = sum(s.token_bytes() for s in attn)
    text = tuple(s.name for s in attn if s.kind is not LayerKind.CROSS)
    cross = tuple(s.name for s in attn if s.kind is LayerKind.CROSS)
    merged: list[KVSpec] = []
    members: dict[str, tuple[str, ...]] = {}
    if text:
        merged.append(KVSpec("uniform", LayerKind.FULL, 1, per_token))
        members["uniform"] = text
    if cross:
        merged.append(KVSpec("uniform_image", LayerKind.CROSS, 1, per_token))
        members["uniform_image"] = cross
    for s in specs:
        if s.kind is LayerKind.MAMBA:
            merged.append(s)
            members[s.name] = (s.name,)
    return _padded(tuple(merged), tokens_per_page), False, members


def vllm_block_size(specs: Sequence[KVSpec], kernel_block: int = 16) -> int:
    """vLLM's attention block for a Mamba hybrid: kernel_block * cdiv(state, kernel_block *
    one token's KV), per layer (the largest of each); kernel_block if there is no Mamba."""
    attn = [s.bytes_per_token for s in specs if s.kind is not LayerKind.MAMBA]
    states = [s.bytes_per_token for s in specs if s.kind is LayerKind.MAMBA]
    if not states or not attn:
        return kernel_block
    return kernel_block * -(-max(states) // (kernel_block * max(attn)))


def _vllm_align(specs: tuple[KVSpec, ...], tokens_per_page: int) -> Layout:
    mamba = [s for s in specs if s.kind is LayerKind.MAMBA]
    if not mamba or len(mamba) == len(specs):
        return make_layout(specs, tokens_per_page)
    block = vllm_block_size(specs, tokens_per_page)
    layer_page = block * max(s.bytes_per_token for s in specs if s.kind is not LayerKind.MAMBA)
    counts = [s.num_layers for s in specs]
    group = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    aligned = tuple(replace(s, checkpoint_every=block, checkpoint_last_only=True)
                    if s.kind is LayerKind.MAMBA else s for s in specs)
    # Every layer's page is layer_page bytes; a spec's page spans its layers, padded
    # up to whole groups. vLLM has no large page: take the LCM unchecked (a few groups).
    pages = tuple(-(-s.num_layers // group) * group * layer_page for s in specs)
    return Layout(aligned, block, pages, math.lcm(*pages))
