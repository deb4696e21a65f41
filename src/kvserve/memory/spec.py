"""Layer-type KV specs as plain data, and the page layout they imply.

A *spec* is one group of layers that share a KV shape and a dependency rule
(all full-attention layers of a model, its sliding-window layers, a draft
model's layers, ...). Its small page holds `tokens_per_page` tokens of every
layer of the group contiguously (Jenga's page-layer partition), so one page id
addresses the KV of all its layers. The large page is the LCM of all small
page sizes, so any large page can be cut into small pages of any spec.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

MAX_SMALL_PAGES_PER_LARGE = 256
MAX_LARGE_PAGE_BYTES = 64 << 20


class LayerKind(str, enum.Enum):
    FULL = "full"
    SLIDING = "sliding"
    CHUNKED = "chunked"
    MAMBA = "mamba"
    CROSS = "cross"  # cross-attention KV over image/encoder tokens
    VISION = "vision"  # vision-embedding cache of image tokens

    @property
    def over_images(self) -> bool:
        """Specs whose pages hold image tokens rather than the text stream."""
        return self in (LayerKind.CROSS, LayerKind.VISION)


@dataclass(frozen=True)
class KVSpec:
    """One group of layers with the same KV shape and hit/eviction rule.

    bytes_per_token is per layer (K and V together); for MAMBA it is the bytes
    of one layer's recurrent state, and a page holds one state of every layer.
    """

    name: str
    kind: LayerKind
    num_layers: int
    bytes_per_token: int
    window: int = 0  # SLIDING: a prefix hit needs its last `window` tokens
    chunk: int = 0  # CHUNKED: attention stays inside aligned chunks of this size
    checkpoint_every: int = 512  # MAMBA: cache the state every N tokens
    # MAMBA: of the checkpoints one allocation (a step) reaches, keep only the last, as
    # vLLM's mamba_cache_mode="align" saves one state per step, at a block boundary
    checkpoint_last_only: bool = False

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.bytes_per_token <= 0:
            raise ValueError(f"spec {self.name!r}: num_layers and bytes_per_token must be > 0")
        if self.kind is LayerKind.SLIDING and self.window <= 0:
            raise ValueError(f"spec {self.name!r}: sliding spec needs window > 0")
        if self.kind is LayerKind.CHUNKED and self.chunk <= 0:
            raise ValueError(f"spec {self.name!r}: chunked spec needs chunk > 0")
        if self.kind is LayerKind.MAMBA and self.checkpoint_every <= 0:
            raise ValueError(f"spec {self.name!r}: mamba spec needs checkpoint_every > 0")

    def page_bytes(self, tokens_per_page: int) -> int:
        """Bytes of one small page: all layers of the group, contiguous."""
        if self.kind is LayerKind.MAMBA:
            return self.num_layers * self.bytes_per_token
        return tokens_per_page * self.num_layers * self.bytes_per_token

    def token_bytes(self) -> int:
        """Bytes one token occupies across the group (0 for fixed-size state)."""
        return 0 if self.kind is LayerKind.MAMBA else self.num_layers * self.bytes_per_token


@dataclass(frozen=True)
class Layout:
    """Page sizes of every spec and the large page that all of them tile.

    `page_bytes` may exceed a spec's natural size (the max_page baseline pads);
    the padding then counts as waste.
    """

    specs: tuple[KVSpec, ...]
    tokens_per_page: int
    page_bytes: tuple[int, ...]
    large_page_bytes: int

    @property
    def pages_per_large(self) -> tuple[int, ...]:
        return tuple(self.large_page_bytes // b for b in self.page_bytes)

    def index(self, name: str) -> int:
        for i, s in enumerate(self.specs):
            if s.name == name:
                return i
        raise KeyError(f"no spec named {name!r}; have {[s.name for s in self.specs]}")


def make_layout(
    specs: Sequence[KVSpec],
    tokens_per_page: int = 16,
    page_bytes: Sequence[int] | None = None,
) -> Layout:
    """Build the two-level layout; refuse an unreasonable LCM, after padding fixed-size
    state pages (`_padded_states`) where that makes it reasonable or costs little."""
    specs = tuple(specs)
    if not specs:
        raise ValueError("at least one KV spec is needed")
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"spec names must be unique: {[s.name for s in specs]}")
    if tokens_per_page <= 0:
        raise ValueError("tokens_per_page must be > 0")
    for s in specs:
        _check_alignment(s, tokens_per_page)
    sizes = tuple(page_bytes) if page_bytes is not None else tuple(
        s.page_bytes(tokens_per_page) for s in specs
    )
    large = math.lcm(*sizes)
    if page_bytes is None:
        padded = _padded_states(specs, sizes)
        if not _reasonable(sizes, large) or _cheap(sizes, padded):
            sizes = padded
            large = math.lcm(*sizes)
    _check_lcm(specs, sizes, large)
    return Layout(specs, tokens_per_page, sizes, large)


def _padded_states(specs: tuple[KVSpec, ...], sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Mamba state pages rounded up to a multiple of the other pages' LCM, as vLLM pads
    them: a state's odd size (Bamba 9B: 2^9 x 5 x 839 B a layer) shares few factors with
    a token page's, so the plain LCM would be gigabytes. The padding counts as waste."""
    others = [b for s, b in zip(specs, sizes) if s.kind is not LayerKind.MAMBA]
    if not others or len(others) == len(sizes):
        return sizes
    unit = math.lcm(*others)
    return tuple(-(-b // unit) * unit if s.kind is LayerKind.MAMBA else b
                 for s, b in zip(specs, sizes))


# Padding a state page costs at most this share of it where the plain LCM is reasonable.
# Jamba 1.5 Mini: 8,716,288 B states and 262,144 B token pages tile a 34.9 MB large
# page of 4 states or 133 token pages, so either type takes room from the other four
# states at a time; padded by 2.2% to 34 token pages, a state is a large page, and
# jenga's hits at 32 articles shuffled, 1/s, went from 52.0% to 65.9%.
CHEAP_STATE_PADDING = 1 / 16


def _cheap(sizes: Sequence[int], padded: Sequence[int]) -> bool:
    return padded != tuple(sizes) and all(
        (p - b) <= p * CHEAP_STATE_PADDING for b, p in zip(sizes, padded))


def _reasonable(sizes: Sequence[int], large: int) -> bool:
    return large // min(sizes) <= MAX_SMALL_PAGES_PER_LARGE and large <= MAX_LARGE_PAGE_BYTES


def _check_alignment(spec: KVSpec, tokens_per_page: int) -> None:
    # Chunk and checkpoint boundaries must fall on page boundaries so that a
    # page never straddles two chunks and a checkpoint names a whole block.
    if spec.kind is LayerKind.CHUNKED and spec.chunk % tokens_per_page:
        raise ValueError(
            f"spec {spec.name!r}: chunk {spec.chunk} is not a multiple of "
            f"tokens_per_page {tokens_per_page}"
        )
    if spec.kind is LayerKind.MAMBA and spec.checkpoint_every % tokens_per_page:
        raise ValueError(
            f"spec {spec.name!r}: checkpoint_every {spec.checkpoint_every} is not a multiple "
            f"of tokens_per_page {tokens_per_page}"
        )


def _check_lcm(specs: tuple[KVSpec, ...], sizes: tuple[int, ...], large: int) -> None:
    if _reasonable(sizes, large):
        return
    ratio = large // min(sizes)
    detail = ", ".join(f"{s.name}={b} B" for s, b in zip(specs, sizes))
    raise ValueError(
        f"LCM large page of {large} B is unreasonable: it is {ratio}x the smallest small page "
        f"(limit {MAX_SMALL_PAGES_PER_LARGE}x) and the byte limit is {MAX_LARGE_PAGE_BYTES} B "
        f"(over by {max(0, large - MAX_LARGE_PAGE_BYTES)} B). Small pages: {detail}. "
        "Change tokens_per_page or the specs so their page sizes share more factors."
    )
