"""The KV byte pool: zeros from the start, memory only where pages are written, and given
back when the memory core says a large page is free."""

from __future__ import annotations

import torch

from kvserve.memory import KVCacheManager, KVSpec, LayerKind
from kvserve.physical.pool import KVPool, zeroed_bytes


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


def _shmem_bytes() -> int:
    with open("/proc/self/status") as fh:
        line = next(x for x in fh if x.startswith("RssShmem:"))
    return int(line.split()[1]) << 10


def test_a_kv_pool_takes_memory_as_pages_are_written_and_gives_free_ones_back() -> None:
    specs = [KVSpec("full", LayerKind.FULL, 2, 1024), KVSpec("swa", LayerKind.SLIDING, 3, 1024,
                                                             window=64)]
    kv = KVCacheManager(specs, 64 << 20, tokens_per_page=16)
    pool = KVPool(kv.layout, kv.num_large_pages, {})
    size = kv.layout.large_page_bytes
    assert pool.memory.elastic and pool.physical_bytes() == 0  # a ceiling, nothing taken
    shmem = _shmem_bytes()
    rows = pool.buffer.view(kv.num_large_pages, size)
    rows[2:10].fill_(7)
    assert pool.physical_bytes() == 8 * size and pool.memory.written(size) == set(range(2, 10))
    assert _shmem_bytes() - shmem >= 8 * size - (1 << 20)
    assert pool.give_back([2, 3, 4, 40]) == 3 * size  # free pages with memory behind them
    assert pool.physical_bytes() == 5 * size and pool.memory.written(size) == set(range(5, 10))
    assert pool.give_back([2, 3, 4]) == 0
    # A punched page reads zeros (on tmpfs the read itself faults a page back in).
    assert int(rows[3].count_nonzero()) == 0 and int(rows[5, ::4096].min()) == 7
    assert pool.give_back([3]) == size
    assert pool.give_back(range(kv.num_large_pages)) == 5 * size
    assert pool.physical_bytes() == 0 and _shmem_bytes() - shmem < (1 << 20)
