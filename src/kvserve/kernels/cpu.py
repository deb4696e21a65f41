"""CPU kernels in C, built once per machine with the system compiler and called via ctypes.

Plain C with no PyTorch headers compiles in about a second (a torch C++ extension takes
tens of seconds), so the first start of a fresh machine stays fast. Built with
-march=native for the machine it runs on and cached under kvserve's cache dir, keyed by
the sources, the compiler and the CPU's flags (one cache entry per feature set: every
AVX-512 path in the sources is guarded by the compiler's feature macros, so the same sources
build for AVX2-only CPUs and take the float32 paths there). Where no compiler works, `cpu_kernels()`
and `kernels_for()` return None (after one warning) and the callers keep their PyTorch
ops, which do the same arithmetic.
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
from typing import Any

import torch

from kvserve.cpu_features import cpu_flags, masked
from kvserve.paths import default_cache_dir

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _isa_flags() -> list[str]:
    """-march=native's ISAs that KVSERVE_CPU_FLAGS hides, turned off."""
    if not masked():
        return []
    flags = cpu_flags()
    off = [] if "avx512f" in flags else ["-mno-avx512f"]
    off += [] if "avx_vnni" in flags else ["-mno-avxvnni"]  # 256-bit VNNI, apart from AVX-512's
    return off + ([] if {"avx2", "fma"} <= flags else ["-mno-avx2", "-mno-fma"])


@functools.cache
def _accepts(compiler: str, flag: str) -> bool:
    """Whether the compiler takes this option. An ISA a compiler does not know (GCC 10 has no
    -mno-avxvnni) is one -march=native never turns on there, so dropping its -mno- is
    safe."""
    try:
        probe = subprocess.run([compiler, flag, "-fsyntax-only", "-x", "c", os.devnull],
                               capture_output=True)
    except OSError:  # no such compiler: the build that follows says so
        return False
    return probe.returncode == 0


def _build(compiler: str, flags: list[str]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True).stdout
    texts = [src.read_text() for src in _SOURCES + _HEADERS]
    parts = [*texts, version, " ".join(flags), " ".join(sorted(cpu_flags()))]
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


_VP, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# name: (result, argument types). Pointers travel as plain addresses (tensor.data_ptr()).
_SIGNATURES = {
    "kvs_paged_attention": (_INT, [_VP, _I64, _I64, _VP, _VP, _I64, _I64, _I64, _I64, _I64,
                                   _VP, _I64, _VP, _VP, _VP, _INT, _INT, _INT, _INT, _INT, _F32,
                                   _INT, _VP, _VP, _INT]),
    "kvs_store_kv": (None, [_VP, _I64, _I64, _VP, _I64, _I64, _INT, _INT, _INT, _VP, _VP, _I64,
                            _I64, _I64, _I64, _I64, _VP, _VP, _INT]),
    "kvs_norm_rope": (None, [_VP, _I64, _I64, _INT, _INT, _INT, _VP, _F32, _VP, _VP, _INT,
                             _VP, _I64, _I64, _INT]),
    "kvs_add_norm": (None, [_VP, _VP, _INT, _INT, _VP, _VP, _F32, _INT, _VP, _INT]),
    "kvs_gelu_mul": (None, [_VP, _INT, _INT, _INT, _VP, _INT]),
    "kvs_silu_mul": (None, [_VP, _INT, _INT, _INT, _VP, _INT]),
    "kvs_argmax": (None, [_VP, _INT, _I64, _INT, _VP, _INT]),
    "kvs_sample": (None, [_VP, _VP, _INT, _I64, _INT, _VP, _VP, _VP, _VP, _VP, _VP, _INT]),
    "kvs_q8_matmul": (_INT, [_VP, _VP, _VP, _I64, _INT, _I64, _INT, _VP, _INT, _INT]),
    "kvs_q8_pack": (None, [_VP, _VP, _I64, _INT, _VP, _VP, _INT]),
    "kvs_q8_quantize": (None, [_VP, _I64, _INT, _VP, _VP, _INT]),
    "kvs_q5_matmul": (_INT, [_VP, _VP, _VP, _I64, _INT, _I64, _INT, _VP, _INT, _INT]),
    "kvs_q5_pack": (None, [_VP, _VP, _I64, _INT, _VP, _VP, _INT]),
    "kvs_q5_quantize": (_I64, [_VP, _I64, _INT, _VP, _VP, _INT]),
    "kvs_i8_pack": (None, [_VP, _I64, _INT, _VP, _VP, _INT]),
    "kvs_i8_matmul": (_INT, [_VP, _VP, _VP, _I64, _INT, _I64, _INT, _VP, _INT, _INT]),
    "kvs_amx_ready": (_INT, []),
    "kvs_bf16_ready": (_INT, []),
    "kvs_bf16_pack": (None, [_VP, _I64, _INT, _VP, _INT]),
    "kvs_bf16_matmul": (_INT, [_VP, _VP, _VP, _I64, _INT, _I64, _INT, _VP, _INT, _INT]),
    "kvs_decoder_layers": (_INT, [_VP, _INT, _VP, _VP, _INT, _INT, _INT, _INT, _INT, _INT, _INT,
                                _F32, _VP, _INT, _VP, _INT]),
}


class Projection(ctypes.Structure):
    """decoder.c's kvs_linear: a QMatmul's kernel and weight."""
    _fields_ = [("fn", _VP), ("q", _VP), ("d", _VP), ("N", _I64), ("K", _INT)]


class DecoderLayer(ctypes.Structure):
    """decoder.c's kvs_layer: what one layer reads."""
    _fields_ = [*((name, Projection) for name in ("qkv", "o", "gate_up", "down")),
                *((name, _VP) for name in ("w_in", "w_post_attn", "w_pre_ff", "w_post_ff",
                                           "w_qk", "cache")),
                *((name, _I64) for name in ("s_page", "s_kv", "s_tok", "s_head")),
                ("view", _INT), ("scale", _F32), ("silu", _INT)]


class AttentionView(ctypes.Structure):
    """decoder.c's kvs_view: what a kind of layer sees this step."""
    _fields_ = [("tables", _VP), ("tables_stride", _I64),
                *((name, _VP) for name in ("seq", "lo", "n_keys", "pages", "offs", "cos", "sin",
                                           "steps")),
                ("ss_page", _I64)]

    @classmethod
    def of(cls, tables: torch.Tensor, seq: torch.Tensor, lo: torch.Tensor, n_keys: torch.Tensor,
           pages: torch.Tensor, offs: torch.Tensor, step_pages: torch.Tensor | None,
           cos: torch.Tensor, sin: torch.Tensor) -> AttentionView:
        """From the tensors paged_attention and store_kv take (checked as they check them,
        but the step pages only for contiguity: no cache here to hold their layout against;
        PagedAttention makes them from the pool's own view), and cos/signed sin [R, 1, D]
        in the rows' dtype."""
        R = seq.numel()
        return cls(_ptr(tables, torch.int32), tables.stride(0),
                   *(_ptr(t, torch.int32, R) for t in (seq, lo, n_keys)),
                   *(_ptr(t, torch.int64, R) for t in (pages, offs)),
                   *(_ptr(t, cos.dtype, cos.numel()) for t in (cos, sin)),
                   *_step_pages(step_pages))


class CpuKernels:
    """The compiled library's entry points, taking and returning torch tensors."""

    MAX_ROW = 8192  # the longest row the norm kernels take (norms.c's MAX_ROW)

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (result, args) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = result, args
        self.lib = lib

    def paged_attention(self, q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor,
                        seq: torch.Tensor, lo: torch.Tensor, n_keys: torch.Tensor,
                        scale: float, lse: torch.Tensor | None = None,
                        step_pages: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over pages in place, one query row at a time, or runs of 16 rows of
        one sequence as blocks (bf16 on AVX-512 BF16 builds: AMX tiles where granted,
        vdpbf16ps elsewhere; float32 on every build, the rows in vector lanes):
        q [R, Hq, D] -> [R, Hq, D].

        cache is one layer's pool view [num_pages, 2, T, Hkv, D]. Row r belongs to sequence
        seq[r], whose pages are tables[seq[r]] (page j holds keys [j T, (j + 1) T)), and
        attends to its keys [lo[r], lo[r] + n_keys[r]) (causal and windowed masks are these
        ranges). tables, seq, lo and n_keys are contiguous int32; every page a range
        touches must be valid: a pool page (>= 0) or a step page (p <= -2 is step_pages[-2
        - p], [n, 2, T, Hkv, D] contiguous: store_kv writes them). `lse`
        (contiguous float32 [R, Hq]) receives each row's log-sum-exp of its scaled scores
        (-inf for an empty range, whose output is 0): what DistAttention merges partial
        results by.
        """
        if q.dtype != cache.dtype or q.dtype not in _DTYPES or q.stride(-1) != 1:
            raise ValueError("paged_attention: q and cache must share float32 or bfloat16, "
                             "with unit stride in head_dim")
        R, Hq, D = q.shape
        _, _, T, Hkv, _ = cache.shape
        out = torch.empty((R, Hq, D), dtype=q.dtype)
        rc = self.lib.kvs_paged_attention(
            q.data_ptr(), q.stride(0), q.stride(1),
            cache.data_ptr(), *_pages(cache, step_pages),
            _ptr(tables, torch.int32), tables.stride(0), _ptr(seq, torch.int32, R),
            _ptr(lo, torch.int32, R), _ptr(n_keys, torch.int32, R),
            R, Hq, Hkv, D, T, scale, _DTYPES[q.dtype], out.data_ptr(),
            None if lse is None else _ptr(lse, torch.float32, R * Hq), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("paged_attention: no scratch memory")
        return out

    def store_kv(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 pages: torch.Tensor, offs: torch.Tensor,
                 step_pages: torch.Tensor | None = None) -> None:
        """cache[pages[t], 0, offs[t]] = k[t] and [.., 1, ..] = v[t] for k, v [n, Hkv, D]
        (unit stride in D); pages/offs int64 [n]; a page p <= -2 is step_pages[-2 - p]
        (paged_attention's step pages)."""
        n, Hkv, D = k.shape
        if (k.dtype != cache.dtype or v.dtype != k.dtype or v.shape != k.shape
                or k.stride(-1) != 1 or v.stride(-1) != 1 or cache.shape[3:] != k.shape[1:]):
            raise ValueError("store_kv: k and v must match the cache's dtype and head shape")
        self.lib.kvs_store_kv(
            k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
            n, Hkv, D,
            cache.data_ptr(), *_pages(cache, step_pages), _ptr(pages, torch.int64, n),
            _ptr(offs, torch.int64, n), k.element_size())

    def norm_rope(self, x: torch.Tensor, scale: torch.Tensor | None, eps: float,
                  cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of each head row of x [n, H, D] with scale [H, D] (float32, 1 + w; no norm
        where None), then RoPE with cos/signed_sin [n, 1, D] if given. Into `out` (x itself
        is fine), else a new contiguous tensor."""
        n, H, D = x.shape
        if x.dtype not in _DTYPES or x.stride(-1) != 1 or D > self.MAX_ROW or D % 2:
            raise ValueError(f"norm_rope: float32/bfloat16 rows of even D <= {self.MAX_ROW}")
        out = torch.empty((n, H, D), dtype=x.dtype) if out is None else out
        assert out.shape == x.shape and out.dtype == x.dtype and out.stride(-1) == 1
        cos, sin = [_ptr(t, x.dtype, n * D) for t in cos_sin] if cos_sin else (None, None)
        self.lib.kvs_norm_rope(
            x.data_ptr(), x.stride(0), x.stride(1), n, H, D,
            None if scale is None else _ptr(scale, torch.float32, H * D),
            eps, cos, sin, _DTYPES[x.dtype], out.data_ptr(), out.stride(0), out.stride(1),
            torch.get_num_threads())
        return out

    def add_norm(self, x: torch.Tensor, h: torch.Tensor, w_add: torch.Tensor | None,
                 eps: float, w_next: torch.Tensor | None = None) -> torch.Tensor | None:
        """x += norm(h, w_add) in place (x += h where w_add is None); returns norm(x,
        w_next) when w_next is given. x, h: contiguous [n, D]; the w are float32 (1 +
        weight) [D]."""
        n, D = x.shape
        if (x.dtype not in _DTYPES or h.dtype != x.dtype or h.shape != x.shape
                or not (x.is_contiguous() and h.is_contiguous()) or D > self.MAX_ROW):
            raise ValueError(f"add_norm: two contiguous float32/bfloat16 [n, D <= {self.MAX_ROW}]")
        y = torch.empty_like(x) if w_next is not None else None
        self.lib.kvs_add_norm(
            x.data_ptr(), h.data_ptr(), n, D,
            None if w_add is None else _ptr(w_add, torch.float32, D),
            None if w_next is None else _ptr(w_next, torch.float32, D), eps, _DTYPES[x.dtype],
            None if y is None else y.data_ptr(), torch.get_num_threads())
        return y

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up for gate_up [n, 2I] = [gate | up] (contiguous) -> [n, I]."""
        return self._act_mul("gelu_mul", gate_up)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up (SwiGLU), as gelu_mul."""
        return self._act_mul("silu_mul", gate_up)

    def _act_mul(self, name: str, gate_up: torch.Tensor) -> torch.Tensor:
        n, I2 = gate_up.shape
        if gate_up.dtype not in _DTYPES or not gate_up.is_contiguous() or I2 % 2:
            raise ValueError(f"{name}: contiguous float32/bfloat16 [n, 2I]")
        out = torch.empty((n, I2 // 2), dtype=gate_up.dtype)
        getattr(self.lib, f"kvs_{name}")(gate_up.data_ptr(), n, I2 // 2, _DTYPES[gate_up.dtype],
                                         out.data_ptr(), torch.get_num_threads())
        return out

    Q8_GROUP = 128  # qmatmul.c interleaves the weights in groups of 4 blocks
    # The version of what q8_pack / q8_quantize / i8_pack write (the interleaving, the
    # padding, the rounding): saved packed weights (models/packed.py) are kept under it, so bump it
    # whenever any of those change or old files would be read as the new layout.
    Q8_LAYOUT = 1

    def q8_pack(self, q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Q8_0 blocks (q int8 [N, K], d float32 [N, K / 32]) in q8_matmul's layout: K padded
        with zero blocks to Kp, a multiple of 128, and each 4 blocks' values interleaved so
        that one vector multiply-add sums a pair of every block (qmatmul.c, kvs_q8_pack)."""
        N, K = q.shape
        if K % 32 or d.shape != (N, K // 32):
            raise ValueError("q8_pack: q int8 [N, K], d [N, K/32], K a multiple of 32")
        Kp = -(-K // self.Q8_GROUP) * self.Q8_GROUP
        qp = torch.empty((N, Kp), dtype=torch.int8)
        dp = torch.empty((N, Kp // 32), dtype=torch.float32)
        self.lib.kvs_q8_pack(_ptr(q, torch.int8), _ptr(d, torch.float32), N, K, qp.data_ptr(),
                             dp.data_ptr(), torch.get_num_threads())
        return qp, dp

    def q8_quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A float weight [N, K] rounded to Q8_0 blocks (as models/quant.py's q8_blocks
        does) and laid out as q8_pack lays them, in one pass."""
        N, K = w.shape
        if K % 32:
            raise ValueError("q8_quantize: w [N, K], K a multiple of 32")
        Kp = -(-K // self.Q8_GROUP) * self.Q8_GROUP
        qp = torch.empty((N, Kp), dtype=torch.int8)
        dp = torch.empty((N, Kp // 32), dtype=torch.float32)
        self.lib.kvs_q8_quantize(_ptr(w, torch.float32), N, K, qp.data_ptr(), dp.data_ptr(),
                                 torch.get_num_threads())
        return qp, dp

    def q8_matmul(self, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 or bfloat16 (unit stride in K, any M >= 0) @ W.T for W in Q8_0
        blocks packed by q8_pack (q int8 [N, Kp], d float32 [N, Kp / 32]) -> [M, N] in x's
        dtype."""
        return self.q8_bound(q, d, x.shape[-1])(x)

    def q8_bound(self, q: torch.Tensor, d: torch.Tensor, K: int) -> QMatmul:
        """q8_matmul with its weight checked once: what a layer calls every step."""
        N, Kp = q.shape
        if K % 32 or Kp != -(-K // self.Q8_GROUP) * self.Q8_GROUP or d.shape != (N, Kp // 32):
            raise ValueError("q8_matmul: K a multiple of 32, and q, d from q8_pack for that K")
        return QMatmul(self.lib.kvs_q8_matmul, "q8_matmul", (q, torch.int8),
                       (d, torch.float32), N, K)

    def q8_values(self, q: torch.Tensor, d: torch.Tensor, K: int) -> torch.Tensor:
        """The float32 weight [N, K] that q8_pack's blocks hold (q * d, each value exact)."""
        N, Kp = q.shape
        vals = q.view(N, Kp // self.Q8_GROUP, self.Q8_GROUP)[..., _GROUP_ORDER]
        return _scaled(vals.reshape(N, Kp), d, K)

    def q5_values(self, q: torch.Tensor, d: torch.Tensor, K: int) -> torch.Tensor:
        """The float32 weight [N, K] that q5_pack's blocks hold (d * (code - 16))."""
        N = q.shape[0]
        g = q.view(N, -1, self.Q5_GROUP_BYTES)
        low = torch.cat([g[..., :64] & 15, g[..., :64] >> 4], dim=-1)  # positions 0-63, 64-127
        bits = g[..., 64:].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8) & 1
        codes = (low | bits.flatten(-2) << 4)[..., _GROUP_ORDER].to(torch.int16) - 16
        return _scaled(codes.reshape(N, -1), d, K)

    Q5_GROUP_BYTES = 80  # a packed Q5_0 group of 128 weights: 64 nibble bytes + 16 of bits

    def _q5_empty(self, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
        groups = -(-K // self.Q8_GROUP)
        return (torch.empty((N, groups * self.Q5_GROUP_BYTES), dtype=torch.uint8),
                torch.empty((N, groups * 4), dtype=torch.float16))

    def q5_pack(self, codes: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Q5_0 blocks (codes uint8 0-31 [N, K], W = d * (code - 16); d float16 [N, K / 32])
        in q5_matmul's layout: q8_pack's order, each group of 128 codes as 64 bytes of
        nibbles and 16 of fifth bits (qmatmul.c, kvs_q5_pack); scales stay fp16."""
        N, K = codes.shape
        if K % 32 or d.shape != (N, K // 32):
            raise ValueError("q5_pack: codes uint8 [N, K], d float16 [N, K/32], K a multiple "
                             "of 32")
        qp, dp = self._q5_empty(N, K)
        self.lib.kvs_q5_pack(_ptr(codes, torch.uint8), _ptr(d, torch.float16), N, K,
                             qp.data_ptr(), dp.data_ptr(), torch.get_num_threads())
        return qp, dp

    def q5_quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A float weight [N, K] rounded to Q5_0 blocks (as kernels/q5.py's q5_blocks does)
        and laid out as q5_pack lays them, in one pass; with the number of weights the
        blocks do not hold exactly (0: w was Q5_0 already, as a GGUF's Q5_0 tensors are)."""
        N, K = w.shape
        if K % 32:
            raise ValueError("q5_quantize: w [N, K], K a multiple of 32")
        qp, dp = self._q5_empty(N, K)
        inexact = self.lib.kvs_q5_quantize(_ptr(w, torch.float32), N, K, qp.data_ptr(),
                                           dp.data_ptr(), torch.get_num_threads())
        return qp, dp, inexact

    def q5_matmul(self, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 or bfloat16 (unit stride in K, any M >= 0) @ W.T for W in Q5_0
        blocks packed by q5_pack or q5_quantize -> [M, N] in x's dtype."""
        return self.q5_bound(q, d, x.shape[-1])(x)

    def q5_bound(self, q: torch.Tensor, d: torch.Tensor, K: int) -> QMatmul:
        """q5_matmul with its weight checked once."""
        N = q.shape[0]
        groups = -(-K // self.Q8_GROUP)
        if K % 32 or q.shape != (N, groups * self.Q5_GROUP_BYTES) or d.shape != (N, groups * 4):
            raise ValueError("q5_matmul: K a multiple of 32, and q, d from q5_pack for that K")
        return QMatmul(self.lib.kvs_q5_matmul, "q5_matmul", (q, torch.uint8),
                       (d, torch.float16), N, K)

    I8_LANES = 16  # i8matmul.c stores the weights of 16 output columns side by side

    def i8_pack(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A float weight [N, K] (N a multiple of 16, K of 32) rounded to int8 blocks of 32
        (Q8_0's values) in i8_matmul's layout (i8matmul.c, kvs_i8_pack): uint8 [N, K] and
        float32 scales [N, K / 32], neither of them row-major."""
        N, K = w.shape
        if K % 32 or N % self.I8_LANES:
            raise ValueError("i8_pack: w [N, K], N a multiple of 16, K of 32")
        q = torch.empty((N, K), dtype=torch.uint8)
        d = torch.empty((N, K // 32), dtype=torch.float32)
        self.lib.kvs_i8_pack(_ptr(w, torch.float32, N * K), N, K, q.data_ptr(), d.data_ptr(),
                             torch.get_num_threads())
        return q, d

    def i8_matmul(self, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 or bfloat16 (unit stride in K, any M >= 0) @ W.T for W [N, K]
        packed by i8_pack (q, d), the activations rounded to int8 blocks of 32 -> [M, N]
        in x's dtype."""
        return self.i8_bound(q, d, x.shape[-1])(x)

    def i8_bound(self, q: torch.Tensor, d: torch.Tensor, K: int) -> QMatmul:
        """i8_matmul with its weight checked once."""
        N = q.shape[0]
        if K % 32 or q.shape != (N, K) or N % self.I8_LANES or d.shape != (N, K // 32):
            raise ValueError("i8_matmul: K a multiple of 32, and q, d from i8_pack for that K")
        return QMatmul(self.lib.kvs_i8_matmul, "i8_matmul", (q, torch.uint8),
                       (d, torch.float32), N, K)

    def amx_ready(self) -> bool:
        """Whether AMX's tiles run here (bf16_bound's GEMM, the attention's blocks): built
        with AMX-BF16 and granted the tiles."""
        return bool(self.lib.kvs_amx_ready())

    def bf16_ready(self) -> bool:
        """Whether bf16_bound's GEMM runs here: built with AVX-512 BF16 (vectors), AMX's
        tiles where granted."""
        return bool(self.lib.kvs_bf16_ready())

    def bf16_pack(self, w: torch.Tensor) -> torch.Tensor:
        """A bfloat16 weight [N, K] (N a multiple of 16, K of 32) in bf16_bound's layout
        (kernels/bf16gemm.c, kvs_bf16_pack): as many bytes, not row-major."""
        N, K = w.shape
        if K % 32 or N % 16 or not self.bf16_ready():
            raise ValueError("bf16_pack: w [N, K], N a multiple of 16, K of 32, on a build "
                             "with native bf16")
        out = torch.empty((N, K), dtype=torch.bfloat16)
        self.lib.kvs_bf16_pack(_ptr(w, torch.bfloat16), N, K, out.data_ptr(),
                               torch.get_num_threads())
        return out

    def bf16_bound(self, packed: torch.Tensor) -> QMatmul:
        """x [M, K] bfloat16 (unit stride in K) @ W.T -> [M, N] bfloat16 for W packed by
        bf16_pack: on AMX's tiles or with vdpbf16ps (oneDNN's products and float32 order at
        Gemma 3's width, to a rounding in ten thousand)."""
        N, K = packed.shape
        return QMatmul(self.lib.kvs_bf16_matmul, "bf16_matmul", (packed, torch.bfloat16), None,
                       N, K)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """First index of each row's maximum, logits [B, V] contiguous -> int64 [B]."""
        if logits.dtype not in _DTYPES or not logits.is_contiguous() or logits.dim() != 2:
            raise ValueError("argmax: contiguous float32/bfloat16 [B, V]")
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.lib.kvs_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1],
                            _DTYPES[logits.dtype], out.data_ptr(), torch.get_num_threads())
        return out

    def sample(self, logits: torch.Tensor, rows: list[int], temperatures: list[float],
               u: torch.Tensor, top_k: list[int] | None = None,
               top_p: list[float] | None = None) -> list[int]:
        """For each of `rows` of logits [B, V] (contiguous), a token drawn with probability
        softmax(logits[row] / temperature) over the row's top_k (0: all) and top_p nucleus
        (1.0: all; ties with the last token kept are kept too), u float64 uniforms in [0, 1)
        (one a row)."""
        if logits.dtype not in _DTYPES or not logits.is_contiguous() or logits.dim() != 2:
            raise ValueError("sample: contiguous float32/bfloat16 [B, V]")
        K = len(rows)
        index = torch.tensor(rows, dtype=torch.int32)
        inv_t = torch.tensor([1.0 / t for t in temperatures], dtype=torch.float32)
        ks = torch.tensor(top_k or [0] * K, dtype=torch.int32)
        ps = torch.tensor(top_p or [1.0] * K, dtype=torch.float64)
        threads = torch.get_num_threads()
        # A row's candidates for top-k/top-p: (key, e) pairs, 8 bytes a token, a row a thread.
        limited = bool(ks.any() or (ps < 1).any())
        scratch = torch.empty(threads * logits.shape[1] * 2 if limited else 0, dtype=torch.int32)
        out = torch.empty(K, dtype=torch.int64)
        self.lib.kvs_sample(logits.data_ptr(), index.data_ptr(), K, logits.shape[1],
                            _DTYPES[logits.dtype], inv_t.data_ptr(), ks.data_ptr(),
                            ps.data_ptr(), _ptr(u, torch.float64, K), scratch.data_ptr(),
                            out.data_ptr(), threads)
        return out.tolist()

    def decoder_layers(self, layers: ctypes.Array, views: ctypes.Array, x: torch.Tensor,
                       dims: tuple[int, int, int, int, int], eps: float,
                       w_out: torch.Tensor) -> torch.Tensor:
        """kvs_decoder_layers: x [M, hidden] (contiguous, the residual stream: updated in
        place) through `layers`; returns the last layer's output normed by w_out [hidden].
        dims: (Hq, Hkv, head_dim, intermediate, page size). The arrays' pointers must stay
        valid for the call (models/fused_layers.py holds their tensors)."""
        M, hidden = x.shape
        Hq, Hkv, D, inter, T = dims
        if x.dtype not in _DTYPES or not x.is_contiguous() or max(hidden, D) > self.MAX_ROW:
            raise ValueError(f"decoder_layers: contiguous float32/bfloat16 rows <= {self.MAX_ROW}")
        buf = torch.empty(M * (2 * hidden + (2 * Hq + 2 * Hkv) * D + 3 * inter), dtype=x.dtype)
        rc = self.lib.kvs_decoder_layers(
            ctypes.addressof(layers), len(layers), ctypes.addressof(views), x.data_ptr(), M,
            hidden, Hq, Hkv, D, inter, T, eps, _ptr(w_out, torch.float32, hidden),
            _DTYPES[x.dtype], buf.data_ptr(), torch.get_num_threads())
        if rc == 1:
            raise ValueError("decoder_layers: a projection refused its rows")
        if rc:
            raise MemoryError("decoder_layers: no scratch memory for attention")
        return buf[: M * hidden].view(M, hidden)


class QMatmul:
    """kvs_q8_matmul, kvs_q5_matmul, kvs_i8_matmul or kvs_bf16_matmul bound to one packed
    weight (its blocks and scales, each with the dtype the kernel reads, kept alive here; the
    bf16 kernel has no scales and takes bfloat16 only): x [M, K] float32 or bfloat16, unit
    stride in K -> x @ W.T [M, N] in x's dtype. A layer binds
    its weight once, so each of a decode step's 73 calls checks only x (a loop of o_proj
    calls at one row: 5-10 us less a call; a whole step showed no change, docs)."""

    def __init__(self, fn: Any, name: str, q: tuple[torch.Tensor, torch.dtype],
                 d: tuple[torch.Tensor, torch.dtype] | None, N: int, K: int) -> None:
        self.fn, self.name, self.weight = fn, name, (q[0], d and d[0])
        self.q_ptr, self.d_ptr, self.N, self.K = _ptr(*q), d and _ptr(*d), N, K

    def projection(self) -> Projection:
        """The call as decoder.c takes it (valid while this object lives)."""
        return Projection(ctypes.cast(self.fn, _VP).value, self.q_ptr, self.d_ptr, self.N,
                          self.K)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.K or x.stride(1) != 1 or x.dtype not in _DTYPES:
            raise ValueError(f"{self.name}: x float32 or bfloat16 [M, {self.K}], unit stride "
                             "in K")
        y = torch.empty((x.shape[0], self.N), dtype=x.dtype)
        rc = self.fn(self.q_ptr, self.d_ptr, x.data_ptr(), x.stride(0), x.shape[0], self.N,
                     self.K, y.data_ptr(), _DTYPES[x.dtype], torch.get_num_threads())
        if rc == 1:
            raise ValueError(f"{self.name}: the kernel does not take {x.dtype} rows here")
        if rc:
            raise MemoryError(f"{self.name}: no scratch memory")
        return y


def _step_pages(steps: torch.Tensor | None) -> tuple[int | None, int]:
    """Step pages' address and page stride (none: NULL, 0)."""
    if steps is None:
        return None, 0
    if not steps.is_contiguous():
        raise ValueError("step pages must be contiguous [n, 2, T, Hkv, D]")
    return steps.data_ptr(), steps.stride(0)


def _pages(cache: torch.Tensor, steps: torch.Tensor | None) -> tuple[int | None, ...]:
    """The kernels' page arguments after the pool view's address: the step pages'
    address, both page strides, the strides within a page (the step pages must share them)."""
    s_page, *inner = cache.stride()[:4]
    if steps is not None and (steps.dtype != cache.dtype or steps.shape[1:] != cache.shape[1:]
                              or list(steps.stride()[1:4]) != inner):
        raise ValueError("step pages must be laid out as the pool's pages")
    ptr, ss_page = _step_pages(steps)
    return ptr, s_page, ss_page, *inner


# Where value j of block k of a packed group of 128 lies (qmatmul.c's group_pos), in the
# blocks' own order: indexing a group with it undoes the interleave.
_GROUP_ORDER = torch.tensor([16 * ((j % 16) // 2) + 2 * (4 * (j // 16) + k) + j % 2
                             for k in range(4) for j in range(32)])


def _scaled(vals: torch.Tensor, d: torch.Tensor, K: int) -> torch.Tensor:
    """Integer block values [N, Kp] times their blocks' scales d [N, Kp / 32], the padding
    past K cut off."""
    N, Kp = vals.shape
    out = vals.view(N, Kp // 32, 32).float() * d.float().unsqueeze(-1)
    return out.view(N, Kp)[:, :K].contiguous()


def _ptr(t: torch.Tensor, dtype: torch.dtype, numel: int | None = None) -> int:
    """t's address, once t is a contiguous `dtype` tensor of `numel` values (any count if
    None): the kernels read it as a flat array."""
    if t.dtype != dtype or not t.is_contiguous() or numel is not None and t.numel() != numel:
        raise ValueError(f"expected a contiguous {dtype} tensor"
                         + (f" of {numel} values" if numel is not None else ""))
    return t.data_ptr()


@functools.cache
def cpu_kernels(extra_flags: tuple[str, ...] = ()) -> CpuKernels | None:
    """The kernels built for this machine (tests add flags, e.g. to take the portable
    paths), or None with a warning where they cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("kvserve: no C compiler found; CPU kernels: using PyTorch ops",
                      stacklevel=2)
        return None
    flags = [f for f in [*_FLAGS, *_isa_flags(), *extra_flags]
             if not f.startswith("-mno-") or _accepts(compiler, f)]
    try:
        return CpuKernels(ctypes.CDLL(str(_build(compiler, flags))))
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
