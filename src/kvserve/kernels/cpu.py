"""CPU kernels in C, built once per machine with the system compiler and called via ctypes.

Plain C with no PyTorch headers compiles in about a second (a torch C++ extension takes
tens of seconds), so the first start of a fresh machine stays fast. Built with
-march=native for the machine it runs on and cached under kvserve's cache dir, keyed by
the source, the compiler and the CPU's flags. Where no compiler works the callers keep
their PyTorch path: `decode_kernel()` is then None.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from kvserve.paths import default_cache_dir

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def _build(compiler: str, flags: list[str]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    parts = [*(src.read_text() for src in _SOURCES), version, " ".join(flags), _cpu_flags()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    target = default_cache_dir() / "kernels" / f"cpu-{key[:16]}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent first starts never load half a file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, "-o", tmp, *map(str, _SOURCES), "-lm"],
                           capture_output=True, text=True, check=True)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


class CpuKernels:
    """The compiled library's entry points, taking and returning torch tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, i32p, c_int = ctypes.c_int64, ctypes.POINTER(ctypes.c_int32), ctypes.c_int
        lib.kvs_paged_decode.restype = c_int
        lib.kvs_paged_decode.argtypes = [
            ctypes.c_void_p, i64, i64,
            ctypes.c_void_p, i64, i64, i64, i64,
            i32p, i64, i32p, i32p,
            c_int, c_int, c_int, c_int, c_int, ctypes.c_float, c_int, ctypes.c_void_p, c_int,
        ]
        vp, f32p, i64p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p
        lib.kvs_norm_rope.restype = None
        lib.kvs_norm_rope.argtypes = [vp, i64, i64, c_int, c_int, c_int, f32p, ctypes.c_float,
                                      vp, vp, c_int, vp, i64, i64, c_int]
        lib.kvs_add_norm.restype = None
        lib.kvs_add_norm.argtypes = [vp, vp, c_int, c_int, f32p, f32p, ctypes.c_float, c_int,
                                     vp, c_int]
        lib.kvs_gelu_mul.restype = None
        lib.kvs_gelu_mul.argtypes = [vp, c_int, c_int, c_int, vp, c_int]
        lib.kvs_argmax.restype = None
        lib.kvs_argmax.argtypes = [vp, c_int, i64, c_int, i64p, c_int]
        self.lib = lib

    def norm_rope(self, x: torch.Tensor, scale: torch.Tensor, eps: float,
                  cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of each head row of x [n, H, D] with scale [H, D] (float32, 1 + w), then
        RoPE with cos/signed_sin [n, 1, D] if given. Into `out` (x itself is fine), else a
        new contiguous tensor."""
        n, H, D = x.shape
        if x.dtype not in _DTYPES or x.stride(-1) != 1 or D > 4096 or D % 2:
            raise ValueError("norm_rope: float32/bfloat16 rows of even D <= 4096")
        out = torch.empty((n, H, D), dtype=x.dtype) if out is None else out
        assert out.shape == x.shape and out.dtype == x.dtype and out.stride(-1) == 1
        cos, sin = cos_sin if cos_sin is not None else (None, None)
        if cos is not None:
            assert cos.dtype == sin.dtype == x.dtype and cos.is_contiguous()
            assert sin.is_contiguous() and cos.numel() == sin.numel() == n * D
        self.lib.kvs_norm_rope(
            x.data_ptr(), x.stride(0), x.stride(1), n, H, D, _f32_ptr(scale, H * D), eps,
            None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
            _DTYPES[x.dtype], out.data_ptr(), out.stride(0), out.stride(1),
            torch.get_num_threads())
        return out

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, w_add: torch.Tensor, eps: float,
                 w_next: torch.Tensor | None = None) -> torch.Tensor | None:
        """x += norm(h, w_add) in place; returns norm(x, w_next) when w_next is given.
        x, h: contiguous [n, D]; the w are float32 (1 + weight) [D]."""
        n, D = x.shape
        if (x.dtype not in _DTYPES or h.dtype != x.dtype or h.shape != x.shape
                or not (x.is_contiguous() and h.is_contiguous()) or D > 8192):
            raise ValueError("add_norm: two contiguous float32/bfloat16 [n, D <= 8192]")
        y = torch.empty_like(x) if w_next is not None else None
        self.lib.kvs_add_norm(
            x.data_ptr(), h.data_ptr(), n, D, _f32_ptr(w_add, D),
            None if w_next is None else _f32_ptr(w_next, D), eps, _DTYPES[x.dtype],
            None if y is None else y.data_ptr(), torch.get_num_threads())
        return y

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up for gate_up [n, 2I] = [gate | up] (contiguous) -> [n, I]."""
        n, I2 = gate_up.shape
        if gate_up.dtype not in _DTYPES or not gate_up.is_contiguous() or I2 % 2:
            raise ValueError("gelu_mul: contiguous float32/bfloat16 [n, 2I]")
        out = torch.empty((n, I2 // 2), dtype=gate_up.dtype)
        self.lib.kvs_gelu_mul(gate_up.data_ptr(), n, I2 // 2, _DTYPES[gate_up.dtype],
                              out.data_ptr(), torch.get_num_threads())
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """First index of each row's maximum, logits [B, V] contiguous -> int64 [B]."""
        if logits.dtype not in _DTYPES or not logits.is_contiguous() or logits.dim() != 2:
            raise ValueError("argmax: contiguous float32/bfloat16 [B, V]")
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.lib.kvs_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1],
                            _DTYPES[logits.dtype], out.data_ptr(), torch.get_num_threads())
        return out

    def paged_decode(self, q: torch.Tensor, cache: torch.Tensor, pages: torch.Tensor,
                     lo: torch.Tensor, n_keys: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode attention over pages in place: q [B, Hq, D] -> [B, Hq, D].

        cache is one layer's pool view [num_pages, 2, T, Hkv, D]; sequence b attends to keys
        [lo[b], lo[b] + n_keys[b]) and pages[b, j] holds keys from (lo[b] // T + j) * T on.
        pages, lo and n_keys are contiguous int32 and every page id they name must be valid.
        """
        if q.dtype != cache.dtype or q.dtype not in _DTYPES or q.stride(-1) != 1:
            raise ValueError("paged_decode: q and cache must share float32 or bfloat16, "
                             "with unit stride in head_dim")
        B, Hq, D = q.shape
        _, _, T, Hkv, _ = cache.shape
        out = torch.empty((B, Hq, D), dtype=q.dtype)
        rc = self.lib.kvs_paged_decode(
            q.data_ptr(), q.stride(0), q.stride(1),
            cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            _int32_ptr(pages), pages.stride(0), _int32_ptr(lo), _int32_ptr(n_keys),
            B, Hq, Hkv, D, T, scale, _DTYPES[q.dtype], out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("paged_decode: no scratch memory")
        return out


def _f32_ptr(t: torch.Tensor, numel: int) -> ctypes._Pointer:
    if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != numel:
        raise ValueError(f"expected a contiguous float32 scale of {numel} values")
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_float))


def _int32_ptr(t: torch.Tensor) -> ctypes._Pointer:
    assert t.dtype == torch.int32 and t.is_contiguous()
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_int32))


@functools.cache
def cpu_kernels(extra_flags: tuple[str, ...] = ()) -> CpuKernels | None:
    """The kernels built for this machine (tests add flags, e.g. to take the portable
    paths), or None with a warning where they cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("kvserve: no C compiler found; CPU attention uses PyTorch ops",
                      stacklevel=2)
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(_build(compiler, [*_FLAGS, *extra_flags]))))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"kvserve: CPU kernels did not build ({detail}); using PyTorch ops",
                      stacklevel=2)
        return None


def kernels_for(x: torch.Tensor) -> CpuKernels | None:
    """The kernels where they apply to x: CPU float32/bfloat16 without autograd (they have
    no backward)."""
    if x.device.type != "cpu" or x.dtype not in _DTYPES or x.requires_grad:
        return None
    return cpu_kernels()
