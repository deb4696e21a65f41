"""One byte pool for every layer type, cut by the memory core's layout.

Jenga's page-layer partition: spec s sees the pool as pages of
`layout.page_bytes[s]` bytes, and one page holds T tokens of *every* layer of
the spec, laid out [layer, K/V, token, kv_head, head_dim]. A layer's view is
then a strided tensor [num_pages, 2, T, kv_heads, head_dim] at a fixed offset
inside each page, so kernels index it by page id as if it were a plain
per-layer paged cache (Jenga §4.2: start pointer + page stride). K and V are
separate blocks of a page so that gathering a sequence's keys (or values)
yields one contiguous [tokens, kv_heads, head_dim] tensor.

The bytes are elastic on a CPU: a memfd mapped once, whose blocks exist only
where a page was written (the OS allocates them on first touch), so memory
follows use; `give_back` punches the large pages the memory core no longer
holds (free, or cached and unused past --kv-idle-release-s) and their memory
returns to the OS. Large pages are the physical chunks: large page i is the
file range [i * L, (i + 1) * L). A punched page reads as zeros again, as a
fresh one does. On a GPU the pool is one allocation, kept.

A state spec (Mamba) has no tokens: its page holds one sequence's state of every
layer of the spec, [layer, part...], each layer's parts (a Mamba layer's conv and SSM
states) one after the other; a part's view is [num_pages, *part shape].
"""

from __future__ import annotations

import math
import mmap
import os
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvserve.memory.spec import Layout


@dataclass(frozen=True)
class AttentionShape:
    """Per-layer KV shape of an attention spec."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * _itemsize(self.dtype)


@dataclass(frozen=True)
class StateShape:
    """Per-layer state of a state spec: the shapes of its tensors, in `dtype`."""

    parts: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    def bytes(self) -> int:
        """One sequence's state of one layer."""
        return _itemsize(self.dtype) * sum(math.prod(p) for p in self.parts)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class KVPool:
    """The byte pool plus a per-layer view for every layer of every spec."""

    def __init__(
        self, layout: Layout, num_large_pages: int,
        shapes: dict[str, AttentionShape | StateShape], device: torch.device | str = "cpu",
    ) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.memory = PoolMemory(num_large_pages * layout.large_page_bytes, self.device)
        self.buffer = self.memory.tensor
        self.views: dict[str, list[torch.Tensor]] = {}  # attention specs
        self.states: dict[str, list[tuple[torch.Tensor, ...]]] = {}  # state specs
        for s, spec in enumerate(layout.specs):
            shape = shapes.get(spec.name)
            if isinstance(shape, StateShape):
                self.states[spec.name] = self._state_views(s, shape, num_large_pages)
            elif shape is not None:
                self.views[spec.name] = self._spec_views(s, shape, num_large_pages)

    def _spec_views(self, s: int, shape: AttentionShape, num_large: int) -> list[torch.Tensor]:
        spec, T = self.layout.specs[s], self.layout.tokens_per_page
        page_bytes = self.layout.page_bytes[s]
        if spec.bytes_per_token != shape.bytes_per_token():
            raise ValueError(
                f"spec {spec.name!r} says {spec.bytes_per_token} B per token per layer but "
                f"its attention shape needs {shape.bytes_per_token()} B"
            )
        num_pages = num_large * self.layout.pages_per_large[s]
        item = _itemsize(shape.dtype)
        pages = self.buffer.view(num_pages, page_bytes)
        # Padding (max_page baseline) sits at the end of each page, unused.
        used = pages[:, : spec.page_bytes(T)].view(shape.dtype)
        per_page = page_bytes // item
        token = shape.num_kv_heads * shape.head_dim
        typed = torch.as_strided(
            used,
            (num_pages, spec.num_layers, 2, T, shape.num_kv_heads, shape.head_dim),
            (per_page, 2 * T * token, T * token, token, shape.head_dim, 1),
        )
        return [typed[:, j] for j in range(spec.num_layers)]

    def _state_views(self, s: int, shape: StateShape,
                     num_large: int) -> list[tuple[torch.Tensor, ...]]:
        spec, page_bytes = self.layout.specs[s], self.layout.page_bytes[s]
        if spec.bytes_per_token != shape.bytes():
            raise ValueError(f"spec {spec.name!r} says {spec.bytes_per_token} B per layer but "
                             f"its state shape needs {shape.bytes()} B")
        item = _itemsize(shape.dtype)
        if page_bytes % item or self.buffer.data_ptr() % item:
            raise ValueError(f"spec {spec.name!r}: pages of {page_bytes} B do not align "
                             f"to its state dtype {shape.dtype}")
        num_pages = num_large * self.layout.pages_per_large[s]
        used = self.buffer.view(num_pages, page_bytes)[:, : spec.page_bytes(0)]
        typed = used.view(shape.dtype).view(num_pages, spec.num_layers, -1)
        out = []
        for j in range(spec.num_layers):
            parts, offset = [], 0
            for part in shape.parts:
                n = math.prod(part)
                parts.append(typed[:, j, offset:offset + n].unflatten(1, part))
                offset += n
            out.append(tuple(parts))
        return out

    def state(self, spec_name: str, index: int) -> tuple[torch.Tensor, ...]:
        """Views [num_pages, *part] of one layer's state tensors of a state spec."""
        return self.states[spec_name][index]

    def pages(self, s: int) -> torch.Tensor:
        """[num_pages, page_bytes] bytes of spec s: one row holds a page of every layer."""
        return page_rows(self.buffer, self.layout, s)

    def layer(self, spec_name: str, index: int) -> torch.Tensor:
        """[num_pages, 2, T, kv_heads, head_dim] view of one layer of one spec."""
        return self.views[spec_name][index]

    def give_back(self, free: Iterable[int]) -> int:
        """Return the memory of free large pages to the OS; returns the bytes it held.

        Only pages with memory behind them are punched (the file's extents say which),
        so an idle poll over a pool given back already costs a few system calls.
        """
        if not self.memory.elastic:
            return 0
        size = self.layout.large_page_bytes
        todo = sorted(set(free) & self.memory.written(size))
        before = self.memory.physical_bytes()
        for first, count in runs(todo):
            self.memory.punch(first * size, count * size)
        return before - self.memory.physical_bytes()

    def physical_bytes(self) -> int:
        """Memory the pool holds now (on a GPU: all of it)."""
        return self.memory.physical_bytes()


class PoolMemory:
    """The pool's bytes: on a Linux CPU a sparse memfd mapped shared, else one tensor.

    madvise(MADV_REMOVE) on a shared file mapping punches a hole in the file: the
    blocks go back to the OS, the mapping stays valid and reads zeros. No view can
    fault and no mapping changes, so punching needs no care for live tensors.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.elastic = device.type == "cpu" and nbytes > 0 and hasattr(os, "memfd_create") \
            and hasattr(mmap, "MADV_REMOVE")
        if not self.elastic:
            self.fd, self.area = -1, None
            self.tensor = zeroed_bytes(nbytes, device)
            return
        self.fd = os.memfd_create("kvserve-kv-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)  # sparse: no block exists before it is written
        self.area = mmap.mmap(self.fd, nbytes, flags=mmap.MAP_SHARED)
        self.tensor = torch.frombuffer(self.area, dtype=torch.uint8)
        weakref.finalize(self, os.close, self.fd)

    def punch(self, offset: int, nbytes: int) -> None:
        """Free the whole OS pages inside [offset, offset + nbytes)."""
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self.area.madvise(mmap.MADV_REMOVE, start, end - start)

    def written(self, unit: int) -> set[int]:
        """Indices of the `unit`-byte blocks with memory behind any of their bytes."""
        out: set[int] = set()
        end = 0
        while True:
            try:
                start = os.lseek(self.fd, end, os.SEEK_DATA)
            except OSError:  # ENXIO: no data past `end`
                return out
            end = os.lseek(self.fd, start, os.SEEK_HOLE)
            out.update(range(start // unit, (end - 1) // unit + 1))

    def physical_bytes(self) -> int:
        if not self.elastic:
            return self.nbytes
        return os.fstat(self.fd).st_blocks * 512


def zeroed_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """nbytes of zeros. On a CPU, fresh private anonymous pages, which the kernel zero-fills
    on first touch: torch.zeros writes every byte up front, which for the default 2 GiB
    pool took 1.6-5 s of a start on 2 cores and made all of it resident before any
    request. Pages a request never reaches stay unallocated."""
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(area, dtype=torch.uint8)  # the tensor keeps `area` mapped


def page_rows(buffer: torch.Tensor, layout: Layout, s: int) -> torch.Tensor:
    """A byte buffer of whole large pages seen as spec s's small pages, one per row."""
    return buffer.view(-1, layout.page_bytes[s])


def runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs
