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
import time

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
    """dst[dst_ids] = src[src_ids] for [pages, page_bytes] byte tensors on any devices.

    Within one device every run of consecutive pages (write-backs fill host
    pages in turn, a request's pages come in runs) is one memcpy: faster on
    a CPU than a gather and a scatter, which pass over the bytes twice.
    Across devices the pages are gathered into one buffer and moved by one
    transfer (one DMA instead of a call per page), then scattered.
    """
    if src.device == dst.device:
        for (s0, d0, n) in _runs(src_ids, dst_ids):
            dst[d0:d0 + n].copy_(src[s0:s0 + n])
        return
    wide = _widest(src.shape[1])  # index ops move elements: the wider the fewer
    rows = src.view(wide).index_select(0, torch.tensor(src_ids, device=src.device))
    # async only into device memory, which the stream orders before the forward
    rows = rows.to(dst.device, non_blocking=dst.device.type == "cuda")
    dst.view(wide).index_copy_(0, torch.tensor(dst_ids, device=dst.device), rows)


def _runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both ids step by one."""
    out: list[tuple[int, int, int]] = []
    for a, b in zip(src_ids, dst_ids):
        if out and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((a, b, 1))
    return out


def _widest(row_bytes: int) -> torch.dtype:
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0:
            return dtype
    return torch.uint8


def copy_bandwidth(device: torch.device, nbytes: int = 32 << 20) -> float:
    """Bytes/s of one host-to-device copy of `nbytes` (the fastest of three), as
    copy_pages moves a run of pages: what a host-tier load costs per byte."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
