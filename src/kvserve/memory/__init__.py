"""The memory core: heterogeneous two-level KV allocation and layer-aware prefix caching.

Pure Python over page ids and token ids; it never imports torch.
"""

from kvserve.memory.allocator import OutOfPages, TwoLevelAllocator
from kvserve.memory.layer_types import NO_PAGE
from kvserve.memory.manager import KVCacheManager, SpecStats, Stats
from kvserve.memory.prefix_cache import ImageInput
from kvserve.memory.spec import KVSpec, LayerKind, Layout, make_layout

__all__ = [
    "NO_PAGE", "ImageInput", "KVCacheManager", "KVSpec", "LayerKind", "Layout", "OutOfPages",
    "SpecStats", "Stats", "TwoLevelAllocator", "make_layout",
]
