"""vTensor on CUDA (`kvserve.physical.cuda_vmm`): the pool's bookkeeping over device memory.

The scenarios run over both backends: "cpu" everywhere, "cuda" where
cuda-python is installed and torch sees a CUDA device (skipped with the reason
otherwise). Helpers come from the CPU tests (`test_vtensor`); what only the
kernel can referee there (/proc/self/maps, the memfd) stays in those tests.

Without a GPU, the rest still runs: the module imports without cuda-python,
constructing the backend says what is missing, and the backend's driver calls
are played against a stand-in driver that enforces the VMM rules the real one
documents (map only where nothing is mapped, unmap whole mappings, set access
on fully mapped ranges, free a reservation with nothing mapped in it).
"""

import ctypes
import gc
import importlib
import importlib.util
import os
import sys
import types
import weakref
from enum import IntEnum

import pytest
import torch
from test_vtensor import check_refs, check_vmas, read_tokens, visible, write_tokens

import kvserve.physical
from kvserve.physical import cuda_vmm
from kvserve.physical.cuda_vmm import CudaBackend, CudaDriverError, CudaUnavailableError
from kvserve.physical.vtensor import (
    DEFAULT_CHUNK_BYTES,
    UNMAPPED,
    ChunkPool,
    CpuBackend,
    OutOfPhysicalMemory,
    VTensorPool,
    backend_for,
)


def _cuda_missing() -> str | None:
    """Why the CUDA backend cannot run here (None: it can)."""
    try:
        found = importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "cuda-python is not installed (pip install 'kvserve[cuda]')"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)"
    return None


needs_cuda = pytest.mark.skipif(_cuda_missing() is not None, reason=str(_cuda_missing()))
KINDS = ["cpu", pytest.param("cuda", marks=needs_cuda)]
# (chunk, bytes per token): 16 tokens a chunk on CPU; a GPU chunk is the 2 MiB granularity.
SIZES = {"cpu": (16 * 1024, 1024), "cuda": (DEFAULT_CHUNK_BYTES, 64 * 1024)}


def make_pool(kind, num_chunks=16, slots=8):
    chunk, bpt = SIZES[kind]
    if kind == "cpu":
        backend = CpuBackend(chunk, num_chunks, 1000, name=f"vt-cuda-test-{os.getpid()}")
    else:
        backend = CudaBackend(chunk, num_chunks)
    return VTensorPool(bpt, slots * (chunk // bpt), chunks=ChunkPool(backend), ahead_chunks=0)


def sync(pool):
    """Surface asynchronous device errors here, not in a later test."""
    if isinstance(pool.backend, CudaBackend):
        torch.cuda.synchronize(pool.backend.device)


# ------------------------------------------------------------------ both backends


@pytest.mark.parametrize("kind", KINDS)
def test_map_unmap_keep_the_reference_counts(kind):
    pool = make_pool(kind)
    tpc, cb = pool.tokens_per_chunk, pool.chunks.chunk_bytes
    tokens = list(range(1, 4 * tpc + 1))
    pool.create("a")
    pool.extend("a", len(tokens))
    write_tokens(pool, "a", tokens, 0, len(tokens))
    vt = pool.active["a"]
    assert vt.chunks == [0, 1, 2, 3] and pool.chunks.ref[:5] == [1, 1, 1, 1, 0]
    assert pool.stats().physical_bytes == 4 * cb  # every chunk written (CPU) / created (CUDA)
    assert pool.view("a").device.type == kind
    vt.unmap(2)
    assert vt.chunks == [0, 1] and pool.chunks.free >= {2, 3}
    assert read_tokens(pool, "a", 2 * tpc) == tokens[: 2 * tpc]
    pool.extend("a", 3 * tpc)  # the chunk after its last one comes back
    assert vt.chunks == [0, 1, 2]
    check_refs(pool)
    sync(pool)
    pool.close()


@pytest.mark.parametrize("kind", KINDS)
def test_shared_prefix_write_is_visible_through_both_views(kind):
    pool = make_pool(kind)
    tpc = pool.tokens_per_chunk
    prompt = list(range(3 * tpc + 5))
    pool.create("a")
    pool.extend("a", len(prompt))
    write_tokens(pool, "a", prompt, 0, len(prompt))
    assert pool.record("a", prompt) == 3 * tpc
    assert pool.create("b", prompt + [7, 8]) == 3 * tpc
    a, b = pool.view("a", torch.int32), pool.view("b", torch.int32)
    assert b[: 3 * tpc, 0].tolist() == prompt[: 3 * tpc]
    assert a.data_ptr() != b.data_ptr()  # two virtual ranges over the same chunks
    assert all(pool.chunks.ref[c] == 3 for c in pool.active["b"].chunks)  # a, b, the tree
    a[5, 1] = 4242
    assert b[5, 1].item() == 4242
    b[2 * tpc + 1, 3] = -7
    assert a[2 * tpc + 1, 3].item() == -7
    check_refs(pool)
    if kind == "cpu":
        check_vmas(pool)  # the kernel's own count of mappings (/proc/self/maps)
    del a, b
    sync(pool)
    pool.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_stale_view_reads_and_writes_a_placeholder_never_another_requests_chunks(kind):
    pool = make_pool(kind, num_chunks=8)
    tpc = pool.tokens_per_chunk
    pool.create("a")
    pool.extend("a", 2 * tpc + 8)
    view = pool.view("a", torch.int32)
    view[:] = 5
    part = view[tpc : 2 * tpc]  # a derived view keeps the range alive too
    del view
    pool.release("a")
    pool.trim()  # the range is freed under a live view: a zombie of placeholders
    assert pool.stats().zombies == 1 and pool.chunks.free == set(range(8))
    pool.create("b")
    pool.extend("b", 3 * tpc)  # a's chunks go to b, and b writes them
    pool.view("b")[:] = 7
    assert int(part.abs().sum()) == 0  # the stale read sees the placeholder, not b's KV
    part[:] = 3  # the stale write lands in the placeholder ...
    assert bool((pool.view("b") == 7).all())  # ... never in b's chunks
    sync(pool)
    del part
    gc.collect()
    s = pool.stats()
    assert s.zombies == 0 and s.active == 1
    check_refs(pool)
    pool.close()


@pytest.mark.parametrize("kind", KINDS)
def test_unmap_head_reads_zeros_and_punch_returns_the_memory(kind):
    pool = make_pool(kind)
    tpc, cb = pool.tokens_per_chunk, pool.chunks.chunk_bytes
    a = list(range(1, 6 * tpc + 1))
    pool.create("a")
    pool.extend("a", len(a))
    write_tokens(pool, "a", a, 0, len(a))
    pool.record("a", a[: 2 * tpc])  # the tree holds chunks 0 and 1
    vt = pool.active["a"]
    assert vt.unmap_head(3) == 3 and vt.chunks == [UNMAPPED] * 3 + [3, 4, 5]
    assert pool.chunks.ref[:6] == [1, 1, 0, 1, 1, 1]
    assert pool.stats().physical_bytes == 6 * cb  # unmapping gives nothing back ...
    assert pool.trim(idle_s=1e9) == cb  # ... until the unreferenced chunk is punched
    assert pool.stats().physical_bytes == 5 * cb
    assert read_tokens(pool, "a", len(a)) == visible(a, len(a), 3 * tpc)  # zeros, no fault
    pool.release("a")
    assert pool.trim() == 5 * cb
    s = pool.stats()
    assert s.physical_bytes == 0 and s.mapped_bytes == 0 and s.reserved_bytes == 0
    sync(pool)
    pool.close()


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_physical_memory_raises_and_changes_nothing(kind):
    pool = make_pool(kind, num_chunks=6)
    tpc = pool.tokens_per_chunk
    a = list(range(4 * tpc))
    pool.create("a")
    pool.extend("a", len(a))
    write_tokens(pool, "a", a, 0, len(a))
    pool.record("a", a[:tpc])
    pool.create("b")
    pool.create("c")
    pool.extend("c", tpc)
    pool.release("c")  # cached: its chunk is reclaimable
    before = (list(pool.chunks.ref), set(pool.chunks.free), pool.backend.mappings,
              len(pool.cached), len(pool.tree), pool.stats())
    with pytest.raises(OutOfPhysicalMemory, match="need 3 chunks"):
        pool.extend("b", 3 * tpc)  # 1 free + 1 cached < 3: the cache is not even touched
    assert before == (list(pool.chunks.ref), set(pool.chunks.free), pool.backend.mappings,
                      len(pool.cached), len(pool.tree), pool.stats())
    assert read_tokens(pool, "a", len(a)) == a
    pool.extend("b", 2 * tpc)  # 1 free + the cached chunk: the cache goes, not "a"'s prefix
    assert len(pool.cached) == 0 and len(pool.tree) == 1
    check_refs(pool)
    if kind == "cpu":
        check_vmas(pool)
    sync(pool)
    pool.close()


@needs_cuda
def test_cuda_pool_is_chosen_for_a_cuda_device_and_views_live_there():
    pool = VTensorPool(64 * 1024, 256, capacity_bytes=4 * DEFAULT_CHUNK_BYTES, device="cuda")
    assert isinstance(pool.backend, CudaBackend)
    assert pool.backend.granularity() <= DEFAULT_CHUNK_BYTES
    assert pool.backend.max_mappings >= 1 << 40  # no vm.max_map_count on a GPU
    pool.create("a")
    pool.extend("a", 40)
    v = pool.view("a", torch.float16)
    assert v.is_cuda and v.data_ptr() == pool.active["a"].addr
    v.fill_(1.5)
    assert float(v.sum(dtype=torch.float32)) == 1.5 * v.numel()  # float16 sums overflow
    del v
    sync(pool)
    pool.close()


# ------------------------------------------------------------------ without a GPU


def test_the_module_imports_without_cuda_python_and_says_what_is_missing(monkeypatch):
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver"):
        monkeypatch.setitem(sys.modules, name, None)  # as if cuda-python were not installed
    monkeypatch.delitem(sys.modules, "kvserve.physical.cuda_vmm")
    monkeypatch.setattr(kvserve.physical, "cuda_vmm", cuda_vmm)  # the import rebinds it
    fresh = importlib.import_module("kvserve.physical.cuda_vmm")
    assert fresh is not cuda_vmm
    with pytest.raises(fresh.CudaUnavailableError, match="cuda-python"):
        fresh._driver()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(fresh.CudaUnavailableError, match=r"pip install 'kvserve\[cuda\]'"):
        fresh.CudaBackend(DEFAULT_CHUNK_BYTES, 4, device=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_the_backend_refuses_clearly():
    with pytest.raises(CudaUnavailableError, match="needs a CUDA device"):
        CudaBackend(DEFAULT_CHUNK_BYTES, 4)
    with pytest.raises(CudaUnavailableError, match="needs a CUDA device"):
        VTensorPool(1024, 2048, capacity_bytes=4 * DEFAULT_CHUNK_BYTES, device="cuda")
    with pytest.raises(ValueError, match="needs a CUDA device, not cpu"):
        CudaBackend(DEFAULT_CHUNK_BYTES, 4, device="cpu")
    with pytest.raises(ValueError, match="no vTensor backend"):
        backend_for("meta", DEFAULT_CHUNK_BYTES, 4)
    backend = backend_for(None, 16 * 1024, 4, 10)
    assert isinstance(backend, CpuBackend)
    backend.close()


# ------------------------------------------------------------------ a stand-in driver

G = 16 * 1024  # the stand-in's granularity


class R(IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_CONTEXT = 201


def _ns(**kw):
    return types.SimpleNamespace(**kw)


class FakeDriver:
    """The VMM calls the backend makes, with the rules of the driver's documentation.

    Memory is bookkeeping only: which handles exist, what is mapped where, with
    what access. `device_handles` caps live handles (the device's memory).
    """

    CUresult = R
    CUdevice_attribute = _ns(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=102)
    CUmemAllocationType = _ns(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = _ns(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = _ns(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = _ns(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)

    def __init__(self, device_handles=100):
        self.device_handles = device_handles
        self.handles: dict[int, int] = {}  # live handle -> size
        self.ranges: dict[int, int] = {}  # reservation -> size
        self.maps: dict[int, tuple[int, int]] = {}  # mapped address -> (size, handle)
        self.access: set[int] = set()  # mapped addresses with read-write access
        self.ctx_refs = 0
        self.ctx_stack: list[str] = []
        self.syncs = 0
        self.memsets = 0
        self._next = 1 << 40

    @staticmethod
    def CUmemAllocationProp():  # noqa: N802 (the driver's names)
        return _ns(type=None, location=_ns(type=None, id=None))

    @staticmethod
    def CUmemAccessDesc():  # noqa: N802
        return _ns(location=_ns(type=None, id=None), flags=None)

    def cuGetErrorName(self, err):  # noqa: N802
        return R.CUDA_SUCCESS, R(err).name.encode()

    def cuGetErrorString(self, err):  # noqa: N802
        return R.CUDA_SUCCESS, b"stand-in driver"

    def cuInit(self, flags):  # noqa: N802
        return (R.CUDA_SUCCESS,)

    def cuDeviceGet(self, ordinal):  # noqa: N802
        return R.CUDA_SUCCESS, ordinal

    def cuDeviceGetAttribute(self, attr, dev):  # noqa: N802
        return R.CUDA_SUCCESS, 1

    def cuMemGetAllocationGranularity(self, prop, option):  # noqa: N802
        assert prop.type == 1 and prop.location.type == 1 and prop.location.id == 0
        return R.CUDA_SUCCESS, G

    def cuDevicePrimaryCtxRetain(self, dev):  # noqa: N802
        self.ctx_refs += 1
        return R.CUDA_SUCCESS, "ctx"

    def cuDevicePrimaryCtxRelease(self, dev):  # noqa: N802
        self.ctx_refs -= 1
        return (R.CUDA_SUCCESS,)

    def cuCtxPushCurrent(self, ctx):  # noqa: N802
        self.ctx_stack.append(ctx)
        return (R.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self):  # noqa: N802
        return R.CUDA_SUCCESS, self.ctx_stack.pop()

    def cuCtxSynchronize(self):  # noqa: N802
        if not self.ctx_stack:
            return (R.CUDA_ERROR_INVALID_CONTEXT,)
        self.syncs += 1
        return (R.CUDA_SUCCESS,)

    def cuMemCreate(self, size, prop, flags):  # noqa: N802
        if size % G or flags:
            return R.CUDA_ERROR_INVALID_VALUE, None
        if len(self.handles) >= self.device_handles:
            return R.CUDA_ERROR_OUT_OF_MEMORY, None
        h, self._next = self._next, self._next + 1
        self.handles[h] = size
        return R.CUDA_SUCCESS, h

    def cuMemRelease(self, h):  # noqa: N802
        if self.handles.pop(h, None) is None:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        return (R.CUDA_SUCCESS,)

    def cuMemAddressReserve(self, size, align, addr, flags):  # noqa: N802
        if size % G or align or addr or flags:
            return R.CUDA_ERROR_INVALID_VALUE, 0
        base = max((a + n for a, n in self.ranges.items()), default=1 << 30) + G  # a gap
        self.ranges[base] = size
        return R.CUDA_SUCCESS, base

    def cuMemAddressFree(self, addr, size):  # noqa: N802
        if self.ranges.get(addr) != size or self._mapped_in(addr, size):
            return (R.CUDA_ERROR_INVALID_VALUE,)
        del self.ranges[addr]
        return (R.CUDA_SUCCESS,)

    def _mapped_in(self, lo, size):
        return sorted(a for a, (n, _) in self.maps.items() if a < lo + size and a + n > lo)

    def _reserved(self, lo, size):
        return any(a <= lo and lo + size <= a + n for a, n in self.ranges.items())

    def _whole(self, lo, size):
        """The mappings that exactly tile [lo, lo + size), or None."""
        got, at = self._mapped_in(lo, size), lo
        for a in got:
            if a != at:
                return None
            at += self.maps[a][0]
        return got if at == lo + size else None

    def cuMemMap(self, ptr, size, offset, h, flags):  # noqa: N802
        ok = (offset == 0 and flags == 0 and self.handles.get(h) == size
              and self._reserved(ptr, size) and not self._mapped_in(ptr, size))
        if not ok:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        self.maps[ptr] = (size, h)
        return (R.CUDA_SUCCESS,)

    def cuMemUnmap(self, ptr, size):  # noqa: N802
        got = self._whole(ptr, size)
        if not got:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        for a in got:
            del self.maps[a]
            self.access.discard(a)
        return (R.CUDA_SUCCESS,)

    def cuMemSetAccess(self, ptr, size, desc, count):  # noqa: N802
        got = self._whole(ptr, size)
        if not got or count != 1 or desc[0].flags != 3 or desc[0].location.id != 0:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        self.access.update(got)
        return (R.CUDA_SUCCESS,)

    def cuMemsetD8(self, ptr, value, n):  # noqa: N802
        if not self.ctx_stack or ptr not in self.access:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        self.memsets += 1
        return (R.CUDA_SUCCESS,)

    def accessible(self, lo, size):
        got = self._whole(lo, size)
        return got is not None and all(a in self.access for a in got)


@pytest.fixture
def fake(monkeypatch):
    """CudaBackend over the stand-in driver; `buffer` hands out host stand-ins for views."""
    drv = FakeDriver()
    monkeypatch.setattr(cuda_vmm, "_driver", lambda: drv)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    drv.views = []

    def buffer(self, addr, nbytes):
        owner = (ctypes.c_ubyte * nbytes)()  # the bookkeeping of a view, not its memory
        drv.views.append((addr, nbytes, weakref.ref(owner)))
        return torch.frombuffer(owner, dtype=torch.uint8), owner

    monkeypatch.setattr(CudaBackend, "buffer", buffer)
    return drv


def fake_pool(num_chunks=8, slots=8):
    backend = CudaBackend(G, num_chunks, device=0)
    return VTensorPool(1024, slots * G // 1024, chunks=ChunkPool(backend), ahead_chunks=0)


def check_driver(pool, drv):
    """The driver holds what the pool says: handles, mappings, access under live views."""
    backend, tpc = pool.backend, pool.tokens_per_chunk
    assert backend.allocated_bytes() == len(backend._handles) * G
    assert len(drv.handles) == len(backend._handles) + (backend._sink is not None)
    assert set(drv.ranges) == set(backend._ranges)
    want = {}
    for vt in [*pool.active.values(), *pool.cached, *pool.zombies]:
        for j, c in enumerate(vt.chunks):
            if c != UNMAPPED:
                want[vt.addr + j * G] = backend._handles[c]
    mapped = {a: h for a, (_, h) in drv.maps.items() if h != backend._sink}
    assert mapped == want  # every chunk slot maps its chunk's handle, nothing else does
    assert drv.access == set(drv.maps)  # nothing mapped without access
    for addr, nbytes, ref in drv.views:
        if ref() is not None:  # a live view never faults
            assert drv.accessible(addr, nbytes)
    assert tpc == G // 1024


def test_driver_calls_follow_the_vmm_rules(fake):
    pool = fake_pool()
    assert fake.ctx_refs == 1
    a = list(range(3 * 16))
    pool.create("a")
    pool.extend("a", len(a))
    check_driver(pool, fake)
    assert len(fake.handles) == 3 and pool.stats().physical_bytes == 3 * G
    pool.record("a", a[: 2 * 16])
    assert pool.create("b", a[: 2 * 16] + [1]) == 2 * 16  # the prefix maps the same handles
    check_driver(pool, fake)
    view = pool.view("a")
    pool.release("a")
    pool.trim()  # a: a zombie under its view, its own chunk punched
    assert pool.stats().zombies == 1
    assert pool.backend._sink is not None and fake.memsets == 1  # made and zeroed once
    assert pool.stats().physical_bytes == 2 * G  # the tree's two chunks; the sink not counted
    check_driver(pool, fake)
    pool.extend("b", 5 * 16)  # the punched chunk comes back as a new handle
    check_driver(pool, fake)
    vt = pool.active["b"]
    bview = pool.view("b")
    assert vt.unmap_head(3) == 3  # the head becomes placeholders under b's view
    vt.unmap(4)
    check_driver(pool, fake)
    del view
    gc.collect()
    assert pool.stats().zombies == 0 and len(fake.ranges) == 1  # a's range freed
    check_driver(pool, fake)
    del bview
    gc.collect()
    pool.extend("b", 6 * 16)  # maps over the placeholder b's view left: the sink goes first
    check_driver(pool, fake)
    assert fake.syncs > 0  # every unmap waited for the device first
    pool.close()
    assert fake.handles == {} and fake.ranges == {} and fake.maps == {} and fake.ctx_refs == 0


def test_device_out_of_memory_raises_and_changes_nothing(fake):
    pool = fake_pool()
    fake.device_handles = 3  # the device holds 3 chunks, though the pool has 8
    pool.create("a")
    pool.extend("a", 2 * 16)
    pool.create("b")
    view = pool.view("a")
    before = (list(pool.chunks.ref), set(pool.chunks.free), pool.backend.mappings,
              dict(fake.maps), set(fake.handles))
    with pytest.raises(OutOfPhysicalMemory, match="CUDA_ERROR_OUT_OF_MEMORY"):
        pool.extend("b", 3 * 16)  # the third chunk's cuMemCreate fails
    after = (list(pool.chunks.ref), set(pool.chunks.free), pool.backend.mappings,
             dict(fake.maps))
    assert after == before[:4] and pool.active["b"].chunks == []
    check_refs(pool)
    check_driver(pool, fake)
    assert pool.map_ahead("b", 3 * 16) == 0  # best effort: no error
    del view
    pool.close()
    assert fake.handles == {} and fake.ranges == {}


def test_driver_errors_name_the_call_and_the_error(fake):
    backend = CudaBackend(G, 4, device=0)
    with pytest.raises(CudaDriverError, match="cuMemAddressFree failed: CUDA_ERROR_INVALID_VALUE"):
        backend.release(1 << 20, G)
    with pytest.raises(ValueError, match="multiple of 16384"):
        CudaBackend(G + 4096, 4, device=0)
    backend.close()
    backend.close()  # idempotent
    assert fake.ctx_refs == 0
