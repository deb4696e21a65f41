"""Baseline memory policies behind the same facade, for benchmarks and the simulator.

Each is a different layout of the same two-level allocator:

- jenga: the model's specs, large page = LCM of their page sizes.
- max_page: the model's specs, every small page padded to the largest one.
- static: the model's specs and LCM pages, the pool split equally between
  specs at start (no memory moves between layer types).
- uniform: PagedAttention as in vLLM v0: every token, text or image, holds KV
  for every layer, in one page size (Mamba states get pages of that size).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.memory.spec import KVSpec, LayerKind, Layout, make_layout

POLICIES = ("jenga", "max_page", "static", "uniform")


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
