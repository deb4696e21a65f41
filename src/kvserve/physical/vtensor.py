"""vTensor: each request's KV is one contiguous virtual tensor over physical chunks.

vTensor (§5) decouples the address range a kernel sees from the memory behind
it. A request reserves a virtual range for its longest possible KV (vAlloc)
and physical chunks are mapped into it as it grows (pAlloc + Map), so the
kernel gets a plain contiguous tensor while memory follows actual use.

The paper's operations and where they live here:

  vAlloc / vFree   `VTensor(...)` reserves a range, `VTensor.free()` drops it
  pAlloc / pFree   `ChunkPool.alloc()` / `ChunkPool.decref()` (reference counted)
  Map / Unmap      `VTensor.map()` / `VTensor.unmap()` (at the tail), and
                   `VTensor.unmap_head()` (what left a sliding window, at the head)
  rPush            `PrefixTree.push()`
  rPrefixMatch     `PrefixTree.match()`

and the scheduler operations of §5.4 (Create, Extend, Prefix Record / Match,
Release) are the methods of `VTensorPool`.

The CPU backend uses a memfd as the physical pool: chunk `i` is the file range
[i * chunk_bytes, (i + 1) * chunk_bytes). Ranges are reserved with PROT_NONE
anonymous mappings, a chunk is mapped with MAP_FIXED | MAP_SHARED over the
reservation, and unmapping maps PROT_NONE back, so the reservation stays.
Memory goes back to the OS only when `trim()` punches holes in chunks no one
references. All system calls go through ctypes to libc: nothing is compiled.

Three things the paper's GPU setting does not have to face:

* Stale views. A torch view of a range outlives the pool's idea of what is
  mapped there; touching PROT_NONE would kill the process with SIGSEGV. So an
  unmap under a live view maps a *placeholder* instead: private anonymous
  read-write memory (NORESERVE). Stale reads see zeros, stale writes land in
  private pages thrown away later; neither can crash, and neither can see or
  corrupt a chunk that has since gone to another request. The placeholder turns
  back into PROT_NONE once the views die, and a range freed under live views is
  kept (a *zombie*) until then. Views are tracked by weak references to the
  ctypes buffer that backs every tensor derived from a view. Raw pointers taken
  with `data_ptr()` are not tracked.
* vm.max_map_count (65,530 by default). Every run of a range with one kind of
  backing is a kernel VMA, and adjacent mappings of consecutive file offsets
  merge. Chunks are handed out consecutively where possible (a request's next
  chunk is the one after its last), the pool counts the VMAs it creates, and an
  operation that would pass its budget raises `MappingLimitError` first.
* Physical capacity. Running out raises `OutOfPhysicalMemory` before anything
  changes; reclaiming cached vTensors and prefix-tree chunks comes first.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import sys
import time
import weakref
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from heapq import heappop, heappush

import torch

from kvserve.physical.pool import runs as _runs

DEFAULT_CHUNK_BYTES = 2 << 20  # the paper's 2 MiB, also a huge page on x86-64
PAGE_BYTES = mmap.PAGESIZE

RequestId = Hashable


class OutOfPhysicalMemory(MemoryError):
    """The physical pool cannot supply the chunks asked for; nothing was changed."""


class MappingLimitError(MemoryError):
    """The operation would pass the pool's share of vm.max_map_count; nothing was changed."""


# ------------------------------------------------------------------ libc

PROT_NONE, PROT_READ, PROT_WRITE = 0, mmap.PROT_READ, mmap.PROT_WRITE
MAP_SHARED, MAP_PRIVATE, MAP_ANONYMOUS = mmap.MAP_SHARED, mmap.MAP_PRIVATE, mmap.MAP_ANONYMOUS
MAP_FIXED, MAP_NORESERVE, MAP_POPULATE = 0x10, 0x4000, 0x8000  # Linux values
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    """libc with the prototypes we call (loaded on first use: Linux only)."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.fallocate.restype = ctypes.c_int
        lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        _libc = lib
    return _libc


def _oserror(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def _mmap(addr: int | None, nbytes: int, prot: int, flags: int, fd: int = -1, off: int = 0) -> int:
    got = _lib().mmap(addr, nbytes, prot, flags, fd, off)
    if got in (None, _MAP_FAILED):
        raise _oserror("mmap")
    if addr is not None and got != addr:  # MAP_FIXED cannot move; guard anyway
        raise OSError(f"mmap placed {nbytes} B at {got:#x}, asked for {addr:#x}")
    return got


def max_map_count() -> int:
    """The kernel's per-process VMA limit (vm.max_map_count)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return 65530


def process_mappings() -> int:
    """How many VMAs this process has now."""
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def default_mapping_budget() -> int:
    """Half of the VMAs still free: the rest of the process (malloc, torch) needs some too."""
    return max(0, (max_map_count() - process_mappings()) // 2)


# ------------------------------------------------------------------ backends


class Backend(ABC):
    """Physical chunks and virtual ranges of one device.

    The pool above is device-neutral: it hands the backend chunk indices and
    byte addresses and keeps every reference count itself. The backend also
    keeps the VMA count, so pools sharing a backend share its budget.

    `CpuBackend` below is the host's; `kvserve.physical.cuda_vmm.CudaBackend`
    is a GPU's, over the driver's VMM API (cuMemAddressReserve / cuMemCreate /
    cuMemMap, one handle per chunk, a shared sink chunk as the placeholder).
    `backend_for` picks one for a device.
    """

    def __init__(self, chunk_bytes: int, num_chunks: int, max_mappings: int | None) -> None:
        if chunk_bytes <= 0 or chunk_bytes % self.granularity():
            raise ValueError(f"chunk size {chunk_bytes} B is not a multiple of "
                             f"{self.granularity()} B")
        if num_chunks <= 0:
            raise ValueError("the physical pool must hold at least one chunk")
        self.chunk_bytes = chunk_bytes
        self.num_chunks = num_chunks
        self.max_mappings = default_mapping_budget() if max_mappings is None else max_mappings
        self.mappings = 0
        self.map_calls = 0  # `map` calls so far (one per run of consecutive chunks)

    def granularity(self) -> int:
        """Chunk sizes must be a multiple of this."""
        return PAGE_BYTES

    def charge(self, delta: int, strict: bool = True) -> None:
        """Account `delta` more VMAs; with `strict`, refuse to pass the budget.

        Unmaps are not strict: at worst they add one placeholder run, and they
        must not fail halfway through a release.
        """
        if strict and delta > 0 and self.mappings + delta > self.max_mappings:
            raise MappingLimitError(
                f"{self.mappings} + {delta} mappings would pass this pool's budget of "
                f"{self.max_mappings} (vm.max_map_count is {max_map_count()}); "
                "use larger chunks or fewer, longer requests"
            )
        self.mappings += delta

    @abstractmethod
    def reserve(self, nbytes: int) -> int:
        """vAlloc: reserve `nbytes` of address space, inaccessible, no memory behind it."""

    @abstractmethod
    def release(self, addr: int, nbytes: int) -> None:
        """vFree: give a reserved range back."""

    @abstractmethod
    def map(self, addr: int, chunk: int, count: int) -> None:
        """Map chunks [chunk, chunk + count) at `addr`, read-write."""

    @abstractmethod
    def unmap(self, addr: int, nbytes: int, placeholder: bool) -> None:
        """Take the chunks off [addr, addr + nbytes); keep the range reserved.

        With `placeholder`, the range must stay harmless to read and write
        (a live tensor view still points at it).
        """

    @abstractmethod
    def punch(self, chunk: int, count: int) -> None:
        """Return the memory of unreferenced chunks [chunk, chunk + count) to the device."""

    @abstractmethod
    def allocated_bytes(self) -> int:
        """Physical memory the pool holds now."""

    @abstractmethod
    def buffer(self, addr: int, nbytes: int) -> tuple[torch.Tensor, object]:
        """A uint8 tensor over [addr, addr + nbytes) and the object that owns it.

        The owner must support weak references and stay alive exactly as long
        as any tensor sharing the storage: that is how views are tracked.
        """

    @abstractmethod
    def close(self) -> None:
        """Release the device resources (ranges must be gone or be zombies)."""


class CpuBackend(Backend):
    """A memfd as the physical pool, mapped with mmap into PROT_NONE reservations.

    `populate` fills the page tables when a chunk is mapped (MAP_POPULATE).
    Demand faults on first touch cost about 860 us per 2 MiB chunk (512 minor
    faults) against about 180 us populated, and Extend maps ahead of compute,
    so the cost moves off the step that uses the memory.
    """

    def __init__(self, chunk_bytes: int, num_chunks: int, max_mappings: int | None = None,
                 name: str = "kvserve-vtensor", populate: bool = True) -> None:
        if not sys.platform.startswith("linux"):
            raise OSError("the CPU vTensor backend needs Linux (memfd, MAP_FIXED, punch-hole)")
        super().__init__(chunk_bytes, num_chunks, max_mappings)
        self.name = name
        self.map_flags = MAP_SHARED | MAP_FIXED | (MAP_POPULATE if populate else 0)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        # Sparse: the file's size is the ceiling; blocks exist only where written.
        os.ftruncate(self.fd, chunk_bytes * num_chunks)

    def reserve(self, nbytes: int) -> int:
        return _mmap(None, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)

    def release(self, addr: int, nbytes: int) -> None:
        if _lib().munmap(addr, nbytes) != 0:
            raise _oserror("munmap")

    def map(self, addr: int, chunk: int, count: int) -> None:
        try:
            _mmap(addr, count * self.chunk_bytes, PROT_READ | PROT_WRITE, self.map_flags, self.fd,
                  chunk * self.chunk_bytes)
        except OSError as e:
            if e.errno == errno.ENOMEM:  # with MAP_FIXED over a reservation: the VMA limit
                raise MappingLimitError(f"the kernel refused a mapping: {e}") from e
            raise

    def unmap(self, addr: int, nbytes: int, placeholder: bool) -> None:
        prot = PROT_READ | PROT_WRITE if placeholder else PROT_NONE
        _mmap(addr, nbytes, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED)

    def punch(self, chunk: int, count: int) -> None:
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        off, n = chunk * self.chunk_bytes, count * self.chunk_bytes
        if _lib().fallocate(self.fd, mode, off, n) != 0:
            raise _oserror("fallocate(PUNCH_HOLE)")

    def allocated_bytes(self) -> int:
        return os.fstat(self.fd).st_blocks * 512

    def buffer(self, addr: int, nbytes: int) -> tuple[torch.Tensor, object]:
        owner = (ctypes.c_ubyte * nbytes).from_address(addr)
        return torch.frombuffer(owner, dtype=torch.uint8), owner

    def close(self) -> None:
        """Close the memfd; chunks still mapped keep the file alive until unmapped."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def backend_for(device: torch.device | str | None, chunk_bytes: int, num_chunks: int,
                max_mappings: int | None = None) -> Backend:
    """The backend for `device`: `CpuBackend` for the CPU (or None), `CudaBackend` for CUDA."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cpu":
        return CpuBackend(chunk_bytes, num_chunks, max_mappings)
    if dev.type == "cuda":
        from kvserve.physical.cuda_vmm import CudaBackend  # cuda-python is optional

        return CudaBackend(chunk_bytes, num_chunks, max_mappings, device=dev)
    raise ValueError(f"no vTensor backend for device {dev}")


# ------------------------------------------------------------------ pSet


class ChunkPool:
    """Physical chunks with reference counts: the paper's pSet.

    Every holder of a chunk holds one reference: each virtual slot mapping it,
    each prefix-tree node recording it, and an allocation until it is mapped.
    A chunk with no references is free; it keeps its memory (it is *dirty*)
    until `punch()` returns it.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.ref = [0] * backend.num_chunks
        self.free: set[int] = set(range(backend.num_chunks))
        # The same as a byte per chunk (1: free): lowest-first searches run in C
        # (bytearray.find), where sorting the free set cost ~0.5 ms per miss at 32K chunks.
        self._free_map = bytearray(b"\x01") * backend.num_chunks
        self.dirty: set[int] = set()

    @property
    def chunk_bytes(self) -> int:
        return self.backend.chunk_bytes

    def alloc(self, n: int, after: int | None = None) -> list[int]:
        """pAlloc: take `n` free chunks, each with one reference for the caller.

        Consecutive chunks map as one VMA, so the chunks after `after` (the
        caller's last chunk) come first, then the lowest run of `n` free chunks,
        then the lowest free chunks one by one.
        """
        if n > len(self.free):
            raise OutOfPhysicalMemory(
                f"need {n} chunks of {self.chunk_bytes} B, {len(self.free)} free "
                f"of {self.backend.num_chunks}"
            )
        got: list[int] = []
        if after is not None:
            while len(got) < n and after + 1 + len(got) in self.free:
                got.append(after + 1 + len(got))
        for c in got:
            self._free_map[c] = 0  # before the search below, which must skip them
        if len(got) < n:
            got += self._lowest_run(n - len(got))
        for c in got:
            self.free.discard(c)
            self._free_map[c] = 0
            self.dirty.discard(c)
            self.ref[c] = 1
        return got

    def _lowest_run(self, n: int) -> list[int]:
        """The lowest `n` consecutive free chunks, or the lowest `n` free ones."""
        m = self._free_map
        first = m.find(b"\x01" * n)
        if first >= 0:
            return list(range(first, first + n))
        got, i = [], -1
        while len(got) < n:
            i = m.find(1, i + 1)
            got.append(i)
        return got

    def incref(self, chunks: Iterable[int]) -> None:
        for c in chunks:
            if self.ref[c] <= 0:
                raise ValueError(f"chunk {c} is free; only held chunks can be shared")
            self.ref[c] += 1

    def decref(self, chunks: Iterable[int]) -> None:
        """pFree: drop one reference each; chunks left with none become free."""
        for c in chunks:
            if self.ref[c] <= 0:
                raise ValueError(f"chunk {c} released more often than held")
            self.ref[c] -= 1
            if self.ref[c] == 0:
                self.free.add(c)
                self._free_map[c] = 1
                self.dirty.add(c)

    def punch(self) -> int:
        """Give the memory of every dirty free chunk back; returns the bytes punched."""
        runs = _runs(sorted(self.dirty))
        for first, count in runs:
            self.backend.punch(first, count)
        self.dirty.clear()
        return sum(count for _, count in runs) * self.chunk_bytes


# ------------------------------------------------------------------ vSet entry


UNMAPPED = -1  # `VTensor.chunks` entry of a slot before the head: its chunk was unmapped


class VTensor:
    """One reserved virtual range with chunks mapped at its start.

    Slot `j` covers bytes [j * chunk_bytes, (j + 1) * chunk_bytes) of the
    range. Slots [0, head) are a placeholder (`unmap_head`: KV that left a
    sliding window; `chunks[j]` is UNMAPPED there); `chunks[j]` is mapped at
    slot j for head <= j < len(chunks); slots [len(chunks), placeholder_end)
    hold placeholders; the rest is PROT_NONE. Chunks are mapped and unmapped at
    the tail and dropped at the head, so a view from slot 0 is one contiguous
    tensor whose token positions never move. The first `need` slots are the
    ones its owner asked for (Create, Extend); chunks past them were mapped
    ahead and may be taken back when memory is short.

    The head is a placeholder, not PROT_NONE, because every view starts at
    slot 0 and so covers it: a stray read there sees zeros instead of killing
    the process. It is always one VMA (each `unmap_head` remaps all of it in
    one call), so it costs a vTensor at most one mapping over its lifetime.
    """

    def __init__(self, pool: ChunkPool, slots: int,
                 on_view_death: Callable[[VTensor], None] | None = None) -> None:
        backend = pool.backend
        backend.charge(1)
        try:
            self.addr = backend.reserve(slots * pool.chunk_bytes)
        except BaseException:
            backend.charge(-1)
            raise
        self.pool = pool
        self.slots = slots
        self.chunks: list[int] = []
        self._starts: list[int] = []  # indices into `chunks` where a run of consecutive ids begins
        self.head = 0  # slots before it were unmapped by `unmap_head`
        self.need = 0
        self.placeholder_end = 0
        self.views: list[tuple[weakref.ref, int]] = []  # (owner, slots it covers)
        self.on_view_death = on_view_death
        self.alive = True

    @property
    def nbytes(self) -> int:
        return self.slots * self.pool.chunk_bytes

    @property
    def num_mapped(self) -> int:
        """Chunks mapped now (slots [head, len(chunks)))."""
        return len(self.chunks) - self.head

    def mapped_chunks(self) -> list[int]:
        return self.chunks[self.head:]

    def last_chunk(self) -> int | None:
        """The chunk at the tail, where the next chunk should follow (None: none mapped)."""
        return self.chunks[-1] if self.num_mapped else None

    def vmas(self, appended: Sequence[int] = ()) -> int:
        """Kernel VMAs the range takes (now, or with `appended` mapped at the tail): one per run.

        A run is consecutive chunks (the kernel merges their mappings), the
        placeholders, or the PROT_NONE rest. Runs are counted as chunks come
        and go, so this costs O(len(appended)), not O(mapped chunks): a long
        request's every Extend asks.
        """
        runs, prev = len(self._starts), self.last_chunk()
        for c in appended:
            if prev is None or c != prev + 1:
                runs += 1
            prev = c
        n, ph = len(self.chunks) + len(appended), self.placeholder_end
        if n > self.head:  # the head and tail placeholders lie apart
            placeholders = (self.head > 0) + (ph > n)
        else:  # nothing mapped between them: they are one mapping (see `unmap_head`)
            placeholders = int(self.head > 0 or ph > n)
        return runs + placeholders + (self.slots > max(ph, n))

    def map(self, chunks: Sequence[int]) -> None:
        """Map: append `chunks` at the tail; each slot takes one reference."""
        start = len(self.chunks)
        if start + len(chunks) > self.slots:
            raise ValueError(f"{start} + {len(chunks)} chunks exceed {self.slots} slots")
        if not chunks:
            return
        pool, backend = self.pool, self.pool.backend
        grown = self.vmas(chunks) - self.vmas()
        backend.charge(grown, strict=True)
        slot = start
        try:
            for first, count in _runs(chunks):
                backend.map(self.addr + slot * pool.chunk_bytes, first, count)
                backend.map_calls += 1
                slot += count
        except BaseException:
            # Put back what the part that did map covered; the count is restored too.
            self._clear(start, slot, self.placeholder_end)
            backend.charge(-grown, strict=False)
            raise
        pool.incref(chunks)
        prev = self.last_chunk()
        for i, c in enumerate(chunks):
            if prev is None or c != prev + 1:
                self._starts.append(start + i)
            prev = c
        self.chunks.extend(chunks)
        if self.placeholder_end <= len(self.chunks):
            self.placeholder_end = 0

    def unmap(self, keep: int) -> None:
        """Unmap: take every chunk from slot `keep` on off the range (their references go).

        Slots a live view covers get a placeholder, the rest PROT_NONE. With
        `keep` below the head nothing of the request's KV is left, so the
        head goes too: the range starts over empty, as a fresh one.
        """
        n = len(self.chunks)
        if keep >= n:
            return
        head = self.head
        if keep < head:
            keep = head = 0
        ph_end = max(self.viewed_slots(), self.placeholder_end if self.placeholder_end > n else 0)
        before = self.vmas()
        lo = keep
        if head and keep == head:
            # Nothing stays mapped between the head and the tail placeholders: remap them
            # as one, so the kernel's count is the one `vmas()` gives.
            lo, ph_end = 0, max(ph_end, head)
        self._clear(lo, max(n, ph_end), ph_end)  # past n: one placeholder, not two abutting
        gone = [c for c in self.chunks[max(keep, self.head):] if c != UNMAPPED]
        del self.chunks[keep:]
        del self._starts[bisect_left(self._starts, keep):]
        self.head = head
        self.need = min(self.need, keep)
        self.placeholder_end = ph_end if ph_end > keep else 0
        self.pool.backend.charge(self.vmas() - before, strict=False)
        self.pool.decref(gone)

    def unmap_head(self, upto: int) -> int:
        """Unmap the chunks of slots before `upto` (KV no attention will read again).

        The slots keep their place, so token positions stay where they were;
        they become part of the head placeholder, remapped in one call so it
        stays one VMA. Only this range's references go: a chunk the prefix
        tree or another request still holds keeps its memory. Returns the
        chunks unmapped.
        """
        n = len(self.chunks)
        upto = min(upto, n)
        if upto <= self.head:
            return 0
        before = self.vmas()
        ph = self.placeholder_end
        # When nothing stays mapped, the tail placeholder joins the head's (one mapping).
        end = upto if upto < n else max(n, ph)
        self.pool.backend.unmap(self.addr, end * self.pool.chunk_bytes, placeholder=True)
        gone = self.chunks[self.head:upto]
        self.chunks[self.head:upto] = [UNMAPPED] * len(gone)
        self.head = upto
        starts = self._starts[bisect_left(self._starts, upto):]
        if upto < n and (not starts or starts[0] != upto):
            starts.insert(0, upto)  # the run it cut through now begins here
        self._starts = starts
        self.need = max(self.need, upto)  # an unmapped slot can no longer be a head start
        # At most one more VMA ever (the head's own), so not strict: it must not fail halfway.
        self.pool.backend.charge(self.vmas() - before, strict=False)
        self.pool.decref(gone)
        return len(gone)

    def _clear(self, lo: int, hi: int, ph_end: int) -> None:
        """Back slots [lo, hi) with placeholders below `ph_end` and PROT_NONE from there."""
        backend, cb = self.pool.backend, self.pool.chunk_bytes
        split = min(hi, max(lo, ph_end))
        if split > lo:
            backend.unmap(self.addr + lo * cb, (split - lo) * cb, placeholder=True)
        if hi > split:
            backend.unmap(self.addr + split * cb, (hi - split) * cb, placeholder=False)

    def view(self) -> torch.Tensor:
        """A uint8 tensor over the mapped prefix; tracked so unmaps under it stay safe."""
        nbytes = len(self.chunks) * self.pool.chunk_bytes
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        tensor, owner = self.pool.backend.buffer(self.addr, nbytes)
        self.viewed_slots()  # prune dead views: one view per step must not pile up
        self.views.append((weakref.ref(owner, self._view_died), len(self.chunks)))
        return tensor

    def _view_died(self, _ref: weakref.ref) -> None:
        # Runs inside the garbage collector: only note it, the pool acts later.
        if self.on_view_death is not None:
            self.on_view_death(self)

    def viewed_slots(self) -> int:
        """How many leading slots some live view covers (dead views pruned)."""
        self.views = [(r, n) for r, n in self.views if r() is not None]
        return max((n for _, n in self.views), default=0)

    def settle(self) -> None:
        """Turn placeholders no live view covers back into PROT_NONE."""
        lo = max(len(self.chunks), self.viewed_slots())
        if self.placeholder_end > lo and self.alive:
            cb = self.pool.chunk_bytes
            before = self.vmas()
            self.pool.backend.unmap(self.addr + lo * cb, (self.placeholder_end - lo) * cb,
                                    placeholder=False)
            self.placeholder_end = lo if lo > len(self.chunks) else 0
            self.pool.backend.charge(self.vmas() - before, strict=False)

    def free(self) -> bool:
        """vFree: unmap everything and give the range back.

        Under a live view the range stays reserved (placeholders where viewed)
        and False is returned: call `free()` again once the views are gone.
        """
        if not self.alive:
            return True
        self.unmap(0)
        self.settle()
        if self.viewed_slots():
            return False
        backend = self.pool.backend
        backend.release(self.addr, self.nbytes)
        backend.charge(-self.vmas(), strict=False)
        self.alive = False
        return True


# ------------------------------------------------------------------ rTree


@dataclass
class _Node:
    key: tuple[int, tuple[int, ...]]  # (parent node id, token block)
    chunk: int
    children: int
    last_use: float


ROOT = 0


class PrefixTree:
    """Radix tree over chunk-sized token blocks: the paper's rTree.

    A node is one block of `tokens_per_chunk` token ids under its parent, and
    holds one reference to the chunk whose KV has them. Edges are keyed by the
    exact token block, so a match can never be a hash collision.
    """

    def __init__(self, pool: ChunkPool, tokens_per_chunk: int) -> None:
        self.pool = pool
        self.tpc = tokens_per_chunk
        self.edges: dict[tuple[int, tuple[int, ...]], int] = {}
        self.nodes: dict[int, _Node] = {}
        self._next_id = ROOT + 1

    def __len__(self) -> int:
        return len(self.nodes)

    def _blocks(self, tokens: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        n = min(len(tokens) // self.tpc, limit)
        return [tuple(tokens[j * self.tpc : (j + 1) * self.tpc]) for j in range(n)]

    def push(self, tokens: Sequence[int], chunks: Sequence[int], now: float) -> int:
        """rPush: record that `chunks[j]` holds the KV of block j of `tokens`.

        Blocks already recorded keep their chunk (the first one computed wins).
        A block whose chunk was unmapped (UNMAPPED) and that no node holds ends
        the walk. Returns how many leading blocks are recorded now.
        """
        parent, depth = ROOT, 0
        for block, chunk in zip(self._blocks(tokens, len(chunks)), chunks):
            key = (parent, block)
            nid = self.edges.get(key)
            if nid is None and chunk == UNMAPPED:
                break  # its chunk left the window before it was recorded: nothing to hold
            if nid is None:
                nid = self._next_id
                self._next_id += 1
                self.pool.incref([chunk])
                self.edges[key] = nid
                self.nodes[nid] = _Node(key, chunk, 0, now)
                if parent != ROOT:
                    self.nodes[parent].children += 1
            else:
                self.nodes[nid].last_use = now
            parent = nid
            depth += 1
        return depth

    def match(self, tokens: Sequence[int], now: float, max_chunks: int | None = None) -> list[int]:
        """rPrefixMatch: the chunks of the longest recorded prefix of `tokens`.

        The record stays; the caller takes its own references when it maps them.
        """
        limit = len(tokens) if max_chunks is None else max_chunks
        parent, got = ROOT, []
        for block in self._blocks(tokens, limit):
            nid = self.edges.get((parent, block))
            if nid is None:
                break
            node = self.nodes[nid]
            node.last_use = now
            got.append(node.chunk)
            parent = nid
        return got

    def evict(self, enough: Callable[[], bool], older_than: float = math.inf) -> int:
        """Drop least recently used leaves until `enough()`; returns nodes dropped.

        Only nodes last used at or before `older_than` go. A parent is used
        whenever a child is, so leaves-first is also oldest-first.
        """
        heap = [(n.last_use, nid) for nid, n in self.nodes.items() if n.children == 0]
        heap.sort()
        dropped = 0
        while heap and not enough():
            last_use, nid = heappop(heap)
            if last_use > older_than:
                break
            node = self.nodes.pop(nid)
            del self.edges[node.key]
            self.pool.decref([node.chunk])
            dropped += 1
            parent = node.key[0]
            if parent != ROOT:
                p = self.nodes[parent]
                p.children -= 1
                if p.children == 0:
                    heappush(heap, (p.last_use, parent))
        return dropped


# ------------------------------------------------------------------ scheduler front


@dataclass(frozen=True)
class VTensorStats:
    """Where the pool's memory is. Mapped bytes count a shared chunk once per mapping."""

    reserved_bytes: int
    mapped_bytes: int
    physical_bytes: int  # what the device really holds (the memfd's allocated blocks)
    referenced_bytes: int  # chunks someone holds
    mappings: int  # kernel VMAs of the backend's ranges (its share of vm.max_map_count)
    active: int
    cached: int
    zombies: int
    prefix_nodes: int


def chunk_bytes_for(bytes_per_token: int, target: int = DEFAULT_CHUNK_BYTES,
                    granularity: int = PAGE_BYTES) -> int:
    """The largest chunk size <= target (at least one unit) holding whole tokens and pages."""
    unit = math.lcm(bytes_per_token, granularity)
    return max(1, target // unit) * unit


class VTensorPool:
    """The vTensor scheduler operations (§5.4) over one kind of KV tensor.

    Token t of a request lies at bytes [t * bytes_per_token, (t+1) * bytes_per_token)
    of its vTensor, so a chunk holds `tokens_per_chunk` whole tokens and a
    prefix is shared chunk by chunk. Several pools (say, one per layer group)
    may share one `ChunkPool`; each reclaims only its own caches.
    """

    def __init__(
        self,
        bytes_per_token: int,
        max_tokens: int,
        capacity_bytes: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        *,
        chunks: ChunkPool | None = None,
        max_mappings: int | None = None,
        ahead_chunks: int = 1,
        clock: Callable[[], float] = time.monotonic,
        device: torch.device | str | None = None,
    ) -> None:
        """`device` picks the backend of a pool made here (`backend_for`; default the CPU)."""
        if chunks is None:
            if capacity_bytes is None:
                raise ValueError("give the physical capacity or a ChunkPool to share")
            chunks = ChunkPool(backend_for(device, chunk_bytes, capacity_bytes // chunk_bytes,
                                           max_mappings))
        cb = chunks.chunk_bytes
        if bytes_per_token <= 0 or cb % bytes_per_token:
            raise ValueError(f"a chunk of {cb} B must hold whole tokens of {bytes_per_token} B "
                             f"(try chunk_bytes_for({bytes_per_token}))")
        self.chunks = chunks
        self.backend = chunks.backend
        self.bytes_per_token = bytes_per_token
        self.tokens_per_chunk = cb // bytes_per_token
        self.max_tokens = max_tokens
        self.ahead_chunks = ahead_chunks
        self.clock = clock
        self.tree = PrefixTree(chunks, self.tokens_per_chunk)
        self.active: dict[RequestId, VTensor] = {}
        self.cached: dict[VTensor, float] = {}  # released, still mapped: vTensor -> release time
        self.zombies: set[VTensor] = set()  # freed while viewed
        self._unsettled: set[VTensor] = set()  # views died since the last look

    # -------------------------------------------------------- operations

    def create(self, req: RequestId, prompt: Sequence[int] = (),
               max_tokens: int | None = None) -> int:
        """Create (+ Prefix Match): give `req` a vTensor; returns the prompt tokens already there.

        The longest recorded prefix of `prompt` is mapped shared. A cached
        vTensor is reused when one is free of views, the one already holding
        most of that prefix first, so a follow-up turn often needs no mapping
        at all. Pass the prompt without the tokens that must be recomputed.
        """
        self._settle()
        if req in self.active:
            raise ValueError(f"request {req!r} already has a vTensor")
        slots = math.ceil((self.max_tokens if max_tokens is None else max_tokens)
                          / self.tokens_per_chunk)
        matched = self.tree.match(prompt, self.clock(), max_chunks=slots)
        vt = self._reuse(slots, matched)
        if vt is None:
            vt = VTensor(self.chunks, slots, self._unsettled.add)
            try:
                vt.map(matched)
            except BaseException:
                vt.free()
                raise
        vt.need = len(matched)  # a reused vTensor's own chunks past the match: a head start
        self.active[req] = vt
        return len(matched) * self.tokens_per_chunk

    def _reuse(self, slots: int, matched: list[int]) -> VTensor | None:
        """Take the cached vTensor sharing most of `matched`, set up for it (None if none fits)."""
        best, best_common = None, -1
        for vt in reversed(self.cached):  # most recently released first
            if vt.slots < slots or vt.viewed_slots():
                continue
            common = _common_prefix(vt.chunks, matched)
            if common > best_common:
                best, best_common = vt, common
        if best is None:
            return None
        del self.cached[best]
        keep = best_common
        if keep == len(matched) and not best.head:  # beyond the prefix, its own chunks are
            # fresh space (with a head, its start is gone: it is remapped from slot 0)
            while keep < len(best.chunks) and self.chunks.ref[best.chunks[keep]] == 1:
                keep += 1
        try:
            best.unmap(keep)
            best.map(matched[keep:])
        except BaseException:
            self.cached[best] = self.clock()
            raise
        return best

    def extend(self, req: RequestId, num_tokens: int) -> None:
        """Extend: make sure the first `num_tokens` tokens of `req` are mapped.

        Then map `ahead_chunks` more if free chunks allow (`map_ahead`).
        """
        vt = self.active[req]
        need = math.ceil(num_tokens / self.tokens_per_chunk)
        if need > vt.slots:
            raise ValueError(f"{num_tokens} tokens exceed the {vt.slots * self.tokens_per_chunk} "
                             f"reserved for {req!r}")
        if need > len(vt.chunks):
            # Raised first: its own head start is now needed, `_reclaim` must not take it.
            old, vt.need = vt.need, need
            try:
                self._grow(vt, need - len(vt.chunks), reclaim=True)
            except BaseException:
                vt.need = old
                raise
        vt.need = max(vt.need, need)
        if self.ahead_chunks:
            self.map_ahead(req, (need + self.ahead_chunks) * self.tokens_per_chunk)

    def map_ahead(self, req: RequestId, num_tokens: int) -> int:
        """Extend ahead of need: map up to the first `num_tokens` tokens of `req` from free chunks.

        Best effort, so that a later step finds its memory mapped: it never
        reclaims, never fails, and what it maps stays a head start (`_reclaim`
        takes it back first). Returns the chunks mapped.
        """
        vt = self.active[req]
        want = min(vt.slots, math.ceil(num_tokens / self.tokens_per_chunk)) - len(vt.chunks)
        want = min(want, len(self.chunks.free))
        if want <= 0:
            return 0
        try:
            self._grow(vt, want, reclaim=False)
        except MemoryError:  # the VMA budget: only a head start, the next extend decides
            return 0
        return want

    def drop_ahead(self) -> int:
        """Unmap every active request's head start (chunks past its need); returns chunks freed."""
        free = len(self.chunks.free)
        for vt in self.active.values():
            if len(vt.chunks) > vt.need:
                vt.unmap(vt.need)
        return len(self.chunks.free) - free

    def _grow(self, vt: VTensor, n: int, reclaim: bool) -> None:
        if reclaim and len(self.chunks.free) < n:
            self._reclaim(n)
        new = self.chunks.alloc(n, after=vt.last_chunk())
        try:
            vt.map(new)
        finally:
            self.chunks.decref(new)  # the allocation's reference; the mapping holds its own

    def _reclaim(self, n: int) -> None:
        """Free chunks until `n` are: head starts first (a map to redo later, no KV lost),
        then cached vTensors (LRU), then prefix-tree leaves.

        Checked first, so that when it cannot succeed nothing is dropped.
        """
        live = {c for vt in self.active.values() for c in vt.chunks[vt.head:vt.need]}
        ref = self.chunks.ref
        reclaimable = sum(1 for c in range(len(ref)) if ref[c] and c not in live)
        if len(self.chunks.free) + reclaimable < n:
            raise OutOfPhysicalMemory(
                f"need {n} chunks of {self.chunks.chunk_bytes} B: {len(self.chunks.free)} free, "
                f"{reclaimable} held only by caches, {len(live)} in use by "
                f"{len(self.active)} requests"
            )
        for vt in self.active.values():
            if len(self.chunks.free) >= n:
                return
            if len(vt.chunks) > vt.need:
                vt.unmap(vt.need)
        for vt in list(self.cached):
            if len(self.chunks.free) >= n:
                return
            del self.cached[vt]
            self._drop(vt)
        self.tree.evict(lambda: len(self.chunks.free) >= n)

    def record(self, req: RequestId, tokens: Sequence[int]) -> int:
        """Prefix Record (rPush): `req`'s KV holds `tokens`; returns the tokens recorded.

        Only whole chunks are recorded, and not past a chunk unmapped before it
        was recorded. The caller vouches that their KV is written: a later
        match maps them into other requests as they are.
        """
        vt = self.active[req]
        return self.tree.push(tokens, vt.chunks, self.clock()) * self.tokens_per_chunk

    def release(self, req: RequestId) -> None:
        """Release, lazily: the vTensor stays mapped for reuse until memory is needed."""
        vt = self.active.pop(req)
        self.cached[vt] = self.clock()

    def trim(self, idle_s: float = 0.0) -> int:
        """Give back what sat unused for `idle_s` seconds; returns the bytes punched.

        Cached vTensors released and prefix-tree nodes last used at least
        `idle_s` ago are dropped, then every chunk nobody references is punched.
        """
        cutoff = self.clock() - idle_s
        for vt, released in list(self.cached.items()):
            if released <= cutoff:
                del self.cached[vt]
                self._drop(vt)
        self.tree.evict(lambda: False, older_than=cutoff)
        self._settle()
        return self.chunks.punch()

    def view(self, req: RequestId, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """`req`'s mapped KV as one [tokens, bytes_per_token // itemsize] tensor of `dtype`."""
        flat = self.active[req].view()
        return flat.view(dtype).view(-1, self.bytes_per_token // dtype.itemsize)

    def mapped_tokens(self, req: RequestId) -> int:
        return len(self.active[req].chunks) * self.tokens_per_chunk

    def stats(self) -> VTensorStats:
        self._settle()
        everything = [*self.active.values(), *self.cached, *self.zombies]
        cb = self.chunks.chunk_bytes
        return VTensorStats(
            reserved_bytes=sum(vt.nbytes for vt in everything),
            mapped_bytes=sum(vt.num_mapped for vt in everything) * cb,
            physical_bytes=self.backend.allocated_bytes(),
            referenced_bytes=(len(self.chunks.ref) - len(self.chunks.free)) * cb,
            mappings=self.backend.mappings,
            active=len(self.active),
            cached=len(self.cached),
            zombies=len(self.zombies),
            prefix_nodes=len(self.tree),
        )

    def close(self) -> None:
        """Drop everything and close the backend; ranges under live views stay as zombies."""
        for req in list(self.active):
            self.release(req)
        self.trim()
        self.backend.close()

    # -------------------------------------------------------- housekeeping

    def _drop(self, vt: VTensor) -> None:
        if not vt.free():
            self.zombies.add(vt)

    def _settle(self) -> None:
        """Act on views that died: placeholders back to PROT_NONE, zombies freed."""
        while self._unsettled:
            vt = self._unsettled.pop()
            if vt in self.zombies:
                if vt.free():
                    self.zombies.discard(vt)
            else:
                vt.settle()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
