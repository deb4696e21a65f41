"""The KV byte pool: zeros from the start, memory only where pages are written."""

from __future__ import annotations

import torch

from kvserve.physical.pool import zeroed_bytes


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def test_a_cpu_pool_reads_zero_and_takes_memory_only_where_written() -> None:
    nbytes = 256 << 20
    before = _rss_bytes()
    buf = zeroed_bytes(nbytes, torch.device("cpu"))
    assert buf.shape == (nbytes,) and buf.dtype == torch.uint8
    assert _rss_bytes() - before < nbytes // 4  # not written up front
    pages = buf.view(-1, 1 << 20)
    assert int(pages[::7, ::4096].count_nonzero()) == 0
    pages[3].fill_(5)
    assert int(pages[3].sum()) == 5 << 20 and int(pages[2].count_nonzero()) == 0


def test_an_empty_pool_is_an_empty_tensor() -> None:
    assert zeroed_bytes(0, torch.device("cpu")).numel() == 0
