"""vTensor on a GPU: a `Backend` over the CUDA driver's virtual memory management (VMM) API.

The device-neutral pool in `kvserve.physical.vtensor` (`ChunkPool`, `VTensor`,
`VTensorPool`) hands a backend chunk indices and byte addresses; this one turns
them into driver calls through NVIDIA's `cuda-python` bindings
(`cuda.bindings.driver`, the `cuda` extra: `pip install 'kvserve[cuda]'`):

  reserve / release   cuMemAddressReserve / cuMemAddressFree
  map                 cuMemCreate (a chunk's handle, made on its first map), then
                      cuMemMap per chunk and one cuMemSetAccess (read-write for the
                      device) over the run
  unmap               cuMemUnmap, and with a placeholder the sink chunk mapped back
  punch               cuMemRelease of the chunks' handles
  granularity         cuMemGetAllocationGranularity (MINIMUM, pinned device memory)
  buffer              an object with `__cuda_array_interface__`, through torch.as_tensor

Every driver call returns a tuple whose first element is a CUresult; `_call`
checks it and raises `CudaDriverError` naming the call and the error.

How the CPU backend's three concerns look on a GPU:

* Chunks. cuMemMap maps a whole allocation at offset 0, so each chunk is its
  own cuMemCreate handle; consecutive chunks are separate mappings (one
  cuMemMap each) that share one cuMemSetAccess. A chunk's memory exists from
  its first map until `punch` releases its handle (the CPU backend's memory
  exists from first touch until the hole is punched), so `allocated_bytes` is
  the chunks holding a handle times the chunk size.
* Stale views. Touching an address with nothing mapped is an illegal address
  on the device, which poisons the whole CUDA context, so an unmap under a
  live view maps a *placeholder* as on CPU. CUDA has no anonymous memory: the
  placeholder is one shared *sink* chunk, made on first need and mapped
  read-write at every placeholder slot. Stale reads see the sink (zeroed when
  it is made; after a stale write, whatever was written there), stale writes
  land in it; neither can reach a chunk another request holds. The sink is not
  counted in `allocated_bytes` (it is one chunk, whatever the pool holds).
* Mapping limits. There is no vm.max_map_count for device mappings: they live
  in the GPU's page tables, which the driver manages. `VTensor` still counts
  runs through `charge` (the same bookkeeping: `stats().mappings`), but the
  budget is unlimited unless one is given.

cuMemUnmap does not wait for queued work, so an unmap or a release first
synchronizes the device's primary context (kernels still reading a chunk finish
before it goes to another request). The paper overlaps these calls with compute
(§6); this engine steps synchronously, where that wait costs nothing extra.

Bindings are imported on first use: this module imports without cuda-python,
and constructing a backend without it, or without a CUDA device, raises
`CudaUnavailableError` with what is missing.

Only the pool level runs on CUDA so far (`VTensorPool(..., device="cuda")`):
`VirtualAttention` and the runner still build CPU tensors around the views
(positions, masks, the empty view), so `kv_backend 'vtensor'` stays CPU-only.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kvserve.physical.vtensor import Backend, OutOfPhysicalMemory

SINK = -1  # slot state: the sink chunk is mapped there (a placeholder)


class CudaUnavailableError(RuntimeError):
    """The CUDA backend cannot run here: no cuda-python, no CUDA device, or no VMM support."""


class CudaDriverError(RuntimeError):
    """A CUDA driver call returned an error."""

    def __init__(self, call: str, result: Any, name: str, text: str) -> None:
        super().__init__(f"{call} failed: {name} ({text})")
        self.call = call
        self.result = result
        self.name = name


def _driver() -> types.ModuleType:
    """`cuda.bindings.driver`, imported on first use (cuda-python is an optional extra)."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise CudaUnavailableError(
            "the CUDA vTensor backend needs NVIDIA's cuda-python (>= 12.8, which provides "
            "cuda.bindings.driver): pip install 'kvserve[cuda]'"
        ) from e
    return driver


def _call(drv: Any, name: str, *args: Any) -> Any:
    """Run driver call `name`; raise on a CUresult other than CUDA_SUCCESS.

    Returns the call's outputs: None, the one value, or a tuple of them.
    """
    ret = getattr(drv, name)(*args)
    err, out = (ret[0], ret[1:]) if isinstance(ret, tuple) else (ret, ())
    if err != drv.CUresult.CUDA_SUCCESS:
        raise _error(drv, name, err)
    if not out:
        return None
    return out[0] if len(out) == 1 else out


def _error(drv: Any, call: str, err: Any) -> CudaDriverError:
    def text(fn: str) -> str:
        try:
            res, s = getattr(drv, fn)(err)
            if res == drv.CUresult.CUDA_SUCCESS and s:
                return s.decode() if isinstance(s, bytes) else str(s)
        except Exception:  # the error path must not raise something else
            pass
        return str(err)

    return CudaDriverError(call, err, text("cuGetErrorName"), text("cuGetErrorString"))


def _runs(addrs: Iterable[int], step: int) -> list[tuple[int, int]]:
    """(first address, bytes) of each run of consecutive `step`-sized slots, in order."""
    runs: list[tuple[int, int]] = []
    for a in sorted(addrs):
        if runs and runs[-1][0] + runs[-1][1] == a:
            runs[-1] = (runs[-1][0], runs[-1][1] + step)
        else:
            runs.append((a, step))
    return runs


class _DeviceBytes:
    """A uint8 device array over [addr, addr + nbytes): what a `buffer` tensor keeps alive.

    torch.as_tensor holds a reference to it for as long as any tensor shares
    the storage; `VTensor` tracks views by weak references to it.
    """

    __slots__ = ("addr", "nbytes", "__weakref__")

    def __init__(self, addr: int, nbytes: int) -> None:
        self.addr = addr
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # stream None: no synchronization needed, the mapping is complete when this is made.
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.addr, False),
                "strides": None, "version": 3, "stream": None}


def _device(device: int | str | torch.device | None) -> torch.device:
    dev = torch.device("cuda") if device is None else (
        torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
    if dev.type != "cuda":
        raise ValueError(f"the CUDA vTensor backend needs a CUDA device, not {dev}")
    return dev


class CudaBackend(Backend):
    """Physical chunks as cuMemCreate handles, mapped into cuMemAddressReserve ranges.

    `device`: a CUDA device (index, "cuda:N" or torch.device; default the
    current one). `max_mappings`: a budget for `charge` (default unlimited:
    GPUs have no vm.max_map_count). Chunk sizes must be a multiple of the
    allocation granularity (2 MiB on current GPUs).
    """

    def __init__(self, chunk_bytes: int, num_chunks: int, max_mappings: int | None = None,
                 device: int | str | torch.device | None = None) -> None:
        dev = _device(device)
        if not torch.cuda.is_available():
            raise CudaUnavailableError(
                f"the CUDA vTensor backend needs a CUDA device; torch {torch.__version__} "
                "sees none (torch.cuda.is_available() is False)"
            )
        self.drv = drv = _driver()
        self.device = torch.device("cuda", torch.cuda.current_device() if dev.index is None
                                   else dev.index)
        self._ctx = None
        _call(drv, "cuInit", 0)
        self._cu_device = _call(drv, "cuDeviceGet", self.device.index)
        vmm = _call(drv, "cuDeviceGetAttribute",
                    drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                    self._cu_device)
        if not vmm:
            raise CudaUnavailableError(f"{self.device} does not support CUDA virtual memory "
                                       "management (cuMemCreate / cuMemMap)")
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        self._prop = prop
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._granularity = int(_call(
            drv, "cuMemGetAllocationGranularity", prop,
            drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        # No vm.max_map_count on a GPU: count runs as the pool does, refuse nothing by default.
        super().__init__(chunk_bytes, num_chunks,
                         (1 << 62) if max_mappings is None else max_mappings)
        # The device's primary context (torch's): only to synchronize before unmapping.
        self._ctx = _call(drv, "cuDevicePrimaryCtxRetain", self._cu_device)
        self._handles: dict[int, Any] = {}  # chunk -> its cuMemCreate handle
        self._sink: Any = None  # the placeholder chunk's handle, made on first need
        self._ranges: dict[int, int] = {}  # reserved address -> bytes
        self._slots: dict[int, int] = {}  # mapped slot address -> chunk, or SINK
        self.closed = False

    # -------------------------------------------------------- helpers

    def granularity(self) -> int:
        return self._granularity

    def _sync(self) -> None:
        """Wait for the device's queued work (cuMemUnmap does not)."""
        drv = self.drv
        _call(drv, "cuCtxPushCurrent", self._ctx)
        try:
            _call(drv, "cuCtxSynchronize")
        finally:
            _call(drv, "cuCtxPopCurrent")

    def _create(self) -> Any:
        try:
            return _call(self.drv, "cuMemCreate", self.chunk_bytes, self._prop, 0)
        except CudaDriverError as e:
            if e.result == self.drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise OutOfPhysicalMemory(f"{self.device} has no {self.chunk_bytes} B left for "
                                          f"a chunk ({e})") from e
            raise

    def _handle(self, chunk: int) -> Any:
        h = self._handles.get(chunk)
        if h is None:
            h = self._handles[chunk] = self._create()
        return h

    def _slot_addrs(self, addr: int, nbytes: int) -> Iterator[int]:
        if addr % self.chunk_bytes or nbytes % self.chunk_bytes:
            # Reservations are granularity-aligned, slots whole chunks: anything else is a bug.
            raise ValueError(f"[{addr:#x}, +{nbytes}) is not whole chunks of {self.chunk_bytes} B")
        return iter(range(addr, addr + nbytes, self.chunk_bytes))

    def _unmap_slots(self, slots: Iterable[int]) -> None:
        """cuMemUnmap each run of these mapped slots (a run: whole mappings, one call)."""
        for a, n in _runs(slots, self.chunk_bytes):
            _call(self.drv, "cuMemUnmap", a, n)
            for s in range(a, a + n, self.chunk_bytes):
                del self._slots[s]

    def _map_sink(self, slots: list[int]) -> None:
        """Map the sink chunk read-write at each of `slots` (unmapped now)."""
        drv, cb = self.drv, self.chunk_bytes
        fresh = self._sink is None
        if fresh:
            self._sink = self._create()
        done: list[int] = []
        try:
            for s in slots:
                _call(drv, "cuMemMap", s, cb, 0, self._sink, 0)
                self._slots[s] = SINK
                done.append(s)
            for a, n in _runs(slots, cb):
                _call(drv, "cuMemSetAccess", a, n, self._access, 1)
        except BaseException:
            self._unmap_slots(done)
            raise
        if fresh and slots:  # new memory holds anything: stale reads start out seeing zeros
            _call(drv, "cuCtxPushCurrent", self._ctx)
            try:
                _call(drv, "cuMemsetD8", slots[0], 0, cb)
                _call(drv, "cuCtxSynchronize")
            finally:
                _call(drv, "cuCtxPopCurrent")

    # -------------------------------------------------------- Backend

    def reserve(self, nbytes: int) -> int:
        addr = int(_call(self.drv, "cuMemAddressReserve", nbytes, 0, 0, 0))
        self._ranges[addr] = nbytes
        return addr

    def release(self, addr: int, nbytes: int) -> None:
        mapped = [s for s in self._slot_addrs(addr, nbytes) if s in self._slots]
        if mapped:  # VTensor.free unmaps first; never leave a mapping in a freed range
            self._sync()
            self._unmap_slots(mapped)
        _call(self.drv, "cuMemAddressFree", addr, nbytes)
        del self._ranges[addr]

    def map(self, addr: int, chunk: int, count: int) -> None:
        drv, cb = self.drv, self.chunk_bytes
        slots = list(self._slot_addrs(addr, count * cb))
        placeholders = [s for s in slots if self._slots.get(s) == SINK]
        if len(placeholders) != sum(s in self._slots for s in slots):
            raise ValueError(f"mapping over chunks still mapped at [{addr:#x}, +{count * cb})")
        if placeholders:  # cuMemMap maps only where nothing is: the sink goes first
            self._sync()
            self._unmap_slots(placeholders)
        done: list[int] = []
        try:
            for s, c in zip(slots, range(chunk, chunk + count)):
                _call(drv, "cuMemMap", s, cb, 0, self._handle(c), 0)
                self._slots[s] = c
                done.append(s)
            _call(drv, "cuMemSetAccess", addr, count * cb, self._access, 1)
        except BaseException:
            # Leave the slots as they were: a live view may still cover the placeholders.
            # Handles made here stay with their chunks (freed, dirty: `punch` returns them).
            self._unmap_slots(done)
            if placeholders:
                self._map_sink(placeholders)
            raise

    def unmap(self, addr: int, nbytes: int, placeholder: bool) -> None:
        slots = list(self._slot_addrs(addr, nbytes))
        if placeholder:  # a slot that holds the sink already stays as it is
            gone = [s for s in slots if s in self._slots and self._slots[s] != SINK]
        else:
            gone = [s for s in slots if s in self._slots]
        if gone:
            self._sync()
            self._unmap_slots(gone)
        if placeholder:
            self._map_sink([s for s in slots if s not in self._slots])

    def punch(self, chunk: int, count: int) -> None:
        for c in range(chunk, chunk + count):
            h = self._handles.pop(c, None)
            if h is not None:  # unreferenced, so mapped nowhere: the memory goes now
                _call(self.drv, "cuMemRelease", h)

    def allocated_bytes(self) -> int:
        return len(self._handles) * self.chunk_bytes

    def buffer(self, addr: int, nbytes: int) -> tuple[torch.Tensor, object]:
        owner = _DeviceBytes(addr, nbytes)
        with torch.cuda.device(self.device):
            tensor = torch.as_tensor(owner, device=self.device)
        if tensor.data_ptr() != addr:  # a copy would silently break every view's writes
            raise RuntimeError(f"torch copied the device array at {addr:#x} instead of viewing it")
        return tensor, owner

    def close(self) -> None:
        """Release every chunk handle, the sink's, and every range with nothing mapped.

        A range still mapped keeps its mappings (a zombie's placeholders: a live
        view), as the CPU backend keeps its mappings: unmapping under a view
        would make it fault. A released handle's memory goes with its last
        mapping, so for those at the latest when the process exits.
        """
        if self.closed:
            return
        drv = self.drv
        for c in sorted(self._handles):
            _call(drv, "cuMemRelease", self._handles.pop(c))
        if self._sink is not None:
            _call(drv, "cuMemRelease", self._sink)
            self._sink = None
        for addr, nbytes in list(self._ranges.items()):
            if not any(s in self._slots for s in self._slot_addrs(addr, nbytes)):
                _call(drv, "cuMemAddressFree", addr, nbytes)
                del self._ranges[addr]
        _call(drv, "cuDevicePrimaryCtxRelease", self._cu_device)
        self.closed = True
