"""Host memory of the host tier: a byte buffer cut by the device pool's layout.

A page of spec s is the same bytes on both tiers (Jenga's page-layer
partition keeps all layers of T tokens in one small page), so moving pages
between tiers needs no reshaping, and moving many pages of one spec is one
gather and one scatter (MemServe's block aggregation, §5.2): `copy_pages`.
On CUDA the buffer is pinned so the copies run asynchronously on the
stream, ordered before the forward that reads them; on CPU it can be backed
by a file, so the tier may exceed RAM (the OS pages it in and out).
"""

from __future__ import annotations

import os

import torch

from kvserve.memory.spec import Layout
from kvserve.physical.pool import page_rows


class HostPool:
    """`num_large` large pages of host memory, viewed per spec like the device pool."""

    def __init__(self, layout: Layout, num_large: int, pin: bool = False,
                 path: str | None = None) -> None:
        self.layout = layout
        nbytes = num_large * layout.large_page_bytes
        if path is not None:
            if os.path.exists(path):
                raise ValueError(f"host KV file {path!r} exists; kvserve will not overwrite it")
            # A sparse file: blocks are allocated as pages are written, and the kernel
            # writes cold ones back to the file instead of holding them in RAM.
            self.buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        else:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.path = path

    def pages(self, s: int) -> torch.Tensor:
        return page_rows(self.buffer, self.layout, s)


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int],
               dst_ids: list[int]) -> None:
    """dst[dst_ids] = src[src_ids] for [pages, page_bytes] tensors on any devices: one
    gather, one transfer and one scatter however many pages move."""
    index = torch.tensor(src_ids, device=src.device)
    rows = src.index_select(0, index)
    if rows.device != dst.device:  # async only into device memory, which the stream orders
        rows = rows.to(dst.device, non_blocking=dst.device.type == "cuda")
    dst.index_copy_(0, torch.tensor(dst_ids, device=dst.device), rows)
