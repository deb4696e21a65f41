"""glibc's heap, told to keep the large blocks a step allocates and frees again.

glibc maps each allocation above its mmap threshold (adjusted as it goes, never above 32 MiB)
fresh from the kernel and unmaps it when freed, so a tensor of that size made every step is
page-faulted in, 4 KiB at a time, every step. The float32 logits of 32 rows of Gemma 3's
262k vocabulary are 33.5 MB: allocating and writing them took 9.4 ms that way against 1.1
ms from memory the heap kept (AVX2 machines run float32, so their batch-32 step paid it on
every token; bf16 logits cross 32 MiB from 64 rows). vLLM preloads tcmalloc for this; glibc
can be told instead (mallopt), without a preload or an environment variable.

The cost: memory freed by a step stays in the process (up to the limit) for the next one,
rather than going back to the kernel, as with tcmalloc.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
LIMIT = 1 << 30  # blocks above this are still mapped fresh (a KV pool, a whole model)


def keep_large_blocks(limit: int = LIMIT) -> bool:
    """Serve allocations of up to `limit` bytes from the heap and keep up to `limit` bytes of
    freed memory at its top. Whether glibc took both settings (False where the C library
    is not glibc, or has no mallopt)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, limit)) and bool(mallopt(M_TRIM_THRESHOLD, limit))
