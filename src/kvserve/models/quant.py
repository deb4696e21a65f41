"""Packed weights for CPU serving: q8 (our Q8_0 kernel), q8+fp16, q8+bf16, fp16, int8.

A GGUF ships its linear weights quantized (Gemma 3 270M Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0);
running them as float32 reads 2-8x more bytes per token than llama.cpp does, and a decode
step is bound by those bytes. fbgemm, the GEMM library torch maintains for x86 (AVX2 and
AVX-512/VNNI kernels chosen at run time), multiplies packed fp16 or int8 weights by float32
activations. Measured on a 2-core AVX2 EPYC for Gemma 3 270M's shapes (docs/benchmarks.md):
fp16 1.4-5x and int8 1.0-10x faster than float32 F.linear at 1 and 32 tokens; torch's
weight-only int8/int4 ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) were
3-60x slower than fbgemm there, so they are not used.

What is exact and what is not. fbgemm takes its own layouts, so its copies are
re-quantized from the GGUF's dequantized values.
- q8 (on request: one copy): llama.cpp's Q8_0 blocks (int8, one scale per 32
  weights; the file's own Q8_0 tensors, such as Gemma 3's tied embedding, come back
  exactly) read by kernels/qmatmul.c at every step size, activations rounded to int16
  blocks. 1.125 bytes a weight, one copy; top-1 agreement with the float32 model 98.8%,
  perplexity 8.051 -> 8.056 (whole texts through the batched kernel). A weight the file
  ships as Q5_0 (Gemma 3 270M Q4_K_M: q/k/v, gate, up) keeps its own Q5_0 blocks instead
  where the CPU has AVX-512BW (Q5Linear, 0.6875 bytes a weight, no rounding at all).
- q8+fp16 (the default on CPUs without native bf16, and for float32 models): the q8 copy
  for steps of up to the row count from which fbgemm's fp16 GEMM runs the weight's shape
  faster on this CPU (models/calibrate.py: timed once per CPU and kept), an fp16 copy of
  the Q8_0 values above; a shape where fp16 is not faster keeps q8 alone.
- q8+bf16 (the default where bf16 runs natively, for a bf16 model): the q8 copy for steps
  of up to 8 rows (4 with AMX), and a packed bf16 copy (every weight rounded to bf16,
  activations too; Bf16Gemm: our kernel on AMX's tiles or AVX-512 BF16 vectors, else
  oneDNN) for larger ones, where native bf16 dot products beat our int16 kernel.
- q8+int8 (on request): the q8 copy for steps of up to 16 rows,
  and above them both sides in int8 blocks of 32 (llama.cpp's Q8_0 x Q8_0: the weights as
  Q8_0, each activation block rounded to int8 at each call; kernels/i8matmul.c). 1.3-1.6x
  the bf16 GEMM at 32 rows; 2.25 bytes a weight for both copies. The rounded activations
  cost quality (docs/benchmarks.md), so auto does not pick it.
- The LM head, where the CPU has VNNI or only AVX2 (i8_fast), in every q8 mode but q8+bf16
  with AMX: as q8+int8 serves a linear (the Q8_0 copy up to 16 rows, int8 blocks above;
  serves_i8_head has the measurements).
- fp16: every weight rounded to float16 (11 significant bits, far finer than the 4-8 bits
  the file ships); activations and sums in float32. Top-1 agreement with the float32 model
  99.98%, same perplexity (ShareGPT text, 6144 tokens).
- int8: symmetric int8 with one scale per output row; activations quantized per token at
  each call (fbgemm quantizes per tensor; rows are pre-scaled to make that per token).
  Top-1 agreement 82.6%, perplexity 8.05 -> 9.21: faster, but only on request.
Norms, RoPE, attention, the residual stream and the KV cache keep the model's dtype.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Container
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from kvserve.cpu_features import bf16_native, cpu_flags
from kvserve.kernels.cpu import CpuKernels, QMatmul, cpu_kernels
from kvserve.models.calibrate import fp16_small, i8_wins

QUANTIZATIONS = ("auto", "none", "q8", "q8+fp16", "q8+bf16", "q8+int8", "fp16", "int8")
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def fbgemm_available() -> bool:
    """fbgemm (torch's x86 int8/fp16 GEMM library) is in this torch build and runs here."""
    engines = torch.backends.quantized.supported_engines
    return "fbgemm" in engines and "avx2" in cpu_flags()


def resolve_quantization(mode: str, device: torch.device, source_types: list[str],
                         dtype: torch.dtype = torch.float32) -> str:
    """The quantization to serve with; an explicit choice the device cannot run is refused
    up front.

    "auto" keeps roughly what the file ships at no cost in quality, for a quantized GGUF on
    a CPU: where the CPU computes bf16 natively and the model runs in bf16, q8+bf16 (Q8_0
    for steps of a few tokens, which read the weights 1.8x fewer bytes; oneDNN's bf16 GEMM
    from 17 rows, which it computes faster than our kernel); elsewhere q8+fp16 (Q8_0 blocks
    read by our kernel, and fbgemm's fp16 for the steps and shapes it runs faster on this
    CPU) where the C kernels build, else fp16. none for float
    checkpoints and on GPUs. int8 is faster at large batches but loses quality (82.6% top-1
    agreement on Gemma 3 270M): only on request.
    """
    if mode not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {QUANTIZATIONS}")
    if mode == "auto":
        shipped = any(t not in _FLOAT_TYPES for t in source_types)
        if not (shipped and device.type == "cpu" and fbgemm_available()):
            return "none"
        if bf16_native() and dtype == torch.bfloat16:
            return "q8+bf16" if cpu_kernels() is not None else "none"
        return "q8+fp16" if cpu_kernels() is not None else "fp16"
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"quantization {mode} runs on CPUs (fbgemm); use none on GPUs")
    if mode != "none" and not fbgemm_available():
        raise ValueError(f"quantization {mode} needs fbgemm and a CPU with AVX2; "
                         "this CPU or torch build has neither")
    if mode.startswith("q8") and cpu_kernels() is None:
        raise ValueError(f"quantization {mode} needs kvserve's C kernels, which did not "
                         "build here")
    if mode == "q8+bf16" and not bf16_native():
        raise ValueError("quantization q8+bf16 needs a CPU that computes bf16 natively "
                         "(AVX-512 BF16 or AMX); this one has neither: use q8")
    return mode


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A oneDNN-blocked copy of a bf16 CPU weight (as much memory as the weight). The
    batch-size hint (32) only picks the blocking; any row count runs on it."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 32)


class Bf16Gemm:
    """A bf16 CPU weight [N, K] packed for native bf16 GEMMs (as much memory as the weight):
    rows [M, K] bfloat16 -> [M, N] bfloat16. Our kernel (kernels/bf16gemm.c: AMX's tiles
    where granted, AVX-512 BF16's vdpbf16ps elsewhere) over its own layout, where the build
    has either: at decode-sized steps it overlaps the weights' read with the products that
    oneDNN's calls do one after the other (up to twice oneDNN's rate on AMX, 1.2-1.35x with
    vectors at 32 rows; level with it at prefill's 2048) and gives the same sums. Elsewhere
    (a shape it does not take), or with use_kernel=False (benchmarks comparing the two),
    oneDNN's blocked copy."""

    def __init__(self, weight: torch.Tensor, use_kernel: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        kernels = cpu_kernels() if use_kernel else None
        if (kernels is not None and kernels.bf16_ready() and self.out_features % 16 == 0
                and self.in_features % 32 == 0):
            self._own = kernels.bf16_bound(kernels.bf16_pack(weight.contiguous()))
            self._onednn = None
        else:
            self._own, self._onednn = None, pack_weight(weight)

    @property
    def on_kernel(self) -> bool:
        """Whether this copy runs on our kernel (else on oneDNN)."""
        return self._own is not None

    def kernel(self, rows: int, dtype: torch.dtype) -> QMatmul | None:
        """The kernel call that computes `rows` rows of `dtype` (decoder.c's projections),
        or None where they go elsewhere."""
        return self._own if dtype == torch.bfloat16 else None

    def __call__(self, rows: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._own is None:
            return torch.ops.mkldnn._linear_pointwise(rows, self._onednn, bias, "none", [], "")
        y = self._own(rows)
        return y if bias is None else y + bias


class Fp16Linear:
    """x @ weight.T with the weight stored as float16 (fbgemm's packed fp16 GEMM, float32
    activations and sums): half of float32's bytes, rounding only the weights (to 11 bits)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), None)
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic_fp16(x.float().contiguous(), self.packed)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2

    def kernel(self, rows: int, dtype: torch.dtype) -> None:
        """fbgemm's: no call of ours (Bf16Gemm.kernel)."""
        return None


def q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 layout, unpacked: int8 q [N, K] and one float32 scale per 32
    weights d [N, K / 32], symmetric (W ~ d * q). A GGUF's own Q8_0 tensors come back as
    they were wherever the block's largest value is +-127 (llama.cpp picks d so); the
    other types are re-quantized, on 8 bits where they had 4 to 6."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // 32, 32)
    d = w.abs().amax(dim=-1) / 127
    q = torch.where(d[..., None] > 0, w / d.clamp(min=1e-30)[..., None], 0.0)
    return q.round_().to(torch.int8).view(n, k), d.contiguous()


class BlockLinear:
    """x @ weight.T with the weight in blocks of 32 (KIND: q8 or q5) as kernels/qmatmul.c
    lays them out, read by our kernel at every step size. One copy of each weight."""

    KIND = ""
    KEYS = ("q", "d")  # the names of its blocks and scales in a saved packed form

    def __init__(self, weight: torch.Tensor) -> None:
        self.kernels = self._kernels()
        self.q, self.d = self._quantize(weight.detach().float().contiguous())
        self.out_features, self.in_features = weight.shape
        self._bind()

    def _bind(self) -> None:
        self.matmul = getattr(self.kernels, f"{self.KIND}_bound")(self.q, self.d,
                                                                  self.in_features)

    def kernel(self, rows: int, dtype: torch.dtype) -> QMatmul | None:
        """As Bf16Gemm.kernel: float32 and bfloat16 rows alike."""
        return self.matmul

    @classmethod
    def _kernels(cls) -> CpuKernels:
        kernels = cpu_kernels()
        if kernels is None:
            raise RuntimeError(f"{cls.KIND} needs kvserve's C kernels, which did not build here")
        return kernels

    def _quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def from_packed(cls, q: torch.Tensor, d: torch.Tensor, in_features: int) -> BlockLinear:
        """The layer over blocks its _quantize made before (a saved copy: models/packed.py)."""
        self = cls.__new__(cls)
        self.kernels, self.q, self.d = cls._kernels(), q, d
        self.out_features, self.in_features = q.shape[0], in_features
        self._bind()
        return self

    def packed_state(self) -> dict[str, torch.Tensor]:
        """What from_packed takes back (with in_features)."""
        return dict(zip(self.KEYS, (self.q, self.d), strict=True))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # float32 and bfloat16 rows go to the kernel as they are, and come back so.
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.float32, torch.bfloat16) or rows.stride(-1) != 1:
            return self(x.float().contiguous()).to(x.dtype)
        return self.matmul(rows).view(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.q.numel() + self.d.numel() * self.d.element_size()


class Q8Linear(BlockLinear):
    """Q8_0 blocks (1.125 bytes a weight): decode, where reading the weight is the cost and
    Q8_0 reads half of fp16's bytes, and batches, where its int16 multiply-adds run about as
    fast as fbgemm's fp16 GEMM (benchmarks/cpu_linears.py). No fp16 packing at start."""

    KIND = "q8"

    def _quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.q8_quantize(weight)


def serves_q5() -> bool:
    """Whether the q8 modes serve a weight that is Q5_0 already in its own blocks here."""
    return cpu_kernels() is not None and "avx512bw" in cpu_flags()


class Q5Linear(BlockLinear):
    """Q5_0 blocks (0.6875 bytes a weight: 5-bit codes, one fp16 scale a block of 32), read
    the way Q8_0 is. A decode step reads each weight once, so a GGUF's own Q5_0 tensors
    (Gemma 3 270M Q4_K_M: q/k/v, gate and up) read 0.61x Q8_0's bytes, with no rounding:
    `exact` gives them back as the file had them, and None for a weight that is not Q5_0
    already."""

    KIND = "q5"
    KEYS = ("q5", "d5")
    inexact = 0  # weights the blocks do not hold exactly (a saved copy was exact)

    def _quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, d, self.inexact = self.kernels.q5_quantize(weight)
        return q, d

    @classmethod
    def exact(cls, weight: torch.Tensor) -> Q5Linear | None:
        """The weight as Q5_0 if its blocks hold every value exactly (a GGUF's Q5_0 tensors
        dequantized, alone or fused), else None. A first row tried alone turns most others
        (the 262k-row head) away without a pass over the whole weight. Only where the CPU
        has AVX-512BW: its masked subtract expands the codes in one instruction a step, and
        Q5_0 then runs 1.1-1.3x Q8_0 at 1-8 rows and within 2-7% of it at 32-512; AVX2
        spends ~7 instructions a step on the fifth bits and lost 15-35% to Q8_0 from 4 rows
        (1 thread, weights from DRAM; docs/benchmarks.md)."""
        if not serves_q5() or weight.shape[1] % 32 or cls(weight[:1]).inexact:
            return None
        linear = cls(weight)
        return None if linear.inexact else linear


def i8_fast() -> bool:
    """Whether I8Linear's kernel runs steps of many rows faster than Q8Linear's int16 one
    here: with int8 dot products (AVX-512 VNNI or AVX-VNNI) always; on plain AVX2 where
    measured so (calibrate.i8_wins: vpmaddubsw and vpmaddwd gave 1.0-1.25x the int16 kernel
    from 17 rows on a Zen 5 held to AVX2, the LM head 1.18x at 32; docs/benchmarks.md). Not
    on AVX-512 without VNNI (not measured: there the int16 kernel has vectors twice the width
    of i8matmul.c's AVX2 path)."""
    flags = cpu_flags()
    if {"avx512_vnni", "avx_vnni"} & flags:
        return True
    return {"avx2", "fma"} <= flags and "avx512bw" not in flags and i8_wins()


def amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles, which run q8+bf16's bf16 copies (Bf16Gemm;
    fast from a few rows: Q8Bf16Linear.SMALL, serves_i8_head)."""
    return "amx_bf16" in cpu_flags()


class I8Linear(BlockLinear):
    """Both sides in int8 blocks of 32 (llama.cpp's Q8_0 x Q8_0, kernels/i8matmul.c): the
    weights rounded as Q8_0 once, each activation block of 32 at every call, products summed
    by VNNI's vpdpbusd, 64 an AVX-512 instruction where bf16 and int16 do 32 (on AVX2 by
    vpmaddubsw and vpmaddwd, to the same integers). For steps that compute more than they
    read (more than SMALL rows). The output columns must be a multiple
    of 16 (Gemma 3's, Llama's and SmolLM2's all are)."""

    KIND = "i8"
    KEYS = ("i8q", "i8d")

    def _quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.i8_pack(weight)


class Int8Linear:
    """x @ weight.T with the weight as int8, one symmetric scale per output row.

    reduce_range keeps activations in 7 bits where the CPU has no VNNI: AVX2's u8 x s8
    multiply-add (vpmaddubsw) saturates 16-bit sums of two 8-bit products otherwise.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's op is not
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(q, None)
        self.out_features, self.in_features = w.shape
        self.reduce_range = not ({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # fbgemm quantizes the whole [tokens, in] input with one scale; dividing each row by
        # its max |x| first (and multiplying the output back: the map is linear) gives every
        # token its own scale, as if quantized per token, for two elementwise passes.
        xf = x.float()
        amax = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-30)
        y = torch.ops.quantized.linear_dynamic((xf / amax).contiguous(), self.packed,
                                               self.reduce_range)
        y.mul_(amax)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def nbytes(self) -> int:
        return self.out_features * (self.in_features + 8)

    def kernel(self, rows: int, dtype: torch.dtype) -> None:
        """fbgemm's: no call of ours (Bf16Gemm.kernel)."""
        return None


class SplitLinear:
    """Two copies of a weight: Q8_0 (or a file's own Q5_0 blocks) through our int16 kernel
    for steps of up to SMALL rows, which read the weights (Q8_0: 1.125 bytes a weight) and
    keep the activations to 16 bits, and a copy made to compute for larger steps."""

    SMALL = 16
    q8: BlockLinear
    out_features: int
    in_features: int
    _copy: Bf16Gemm | Fp16Linear | I8Linear | None = None  # the larger steps' (`large`)
    _making = threading.Lock()  # for every layer: copies are made once, seldom together

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.SMALL * self.in_features:
            return self.q8(x)
        return self._large_step(x)

    def _large_step(self, x: torch.Tensor) -> torch.Tensor:
        return self.large(x)

    def kernel(self, rows: int, dtype: torch.dtype) -> QMatmul | None:
        """As Bf16Gemm.kernel, choosing the copy as __call__ does."""
        return self.q8.kernel(rows, dtype) if rows <= self.SMALL else self.large.kernel(0, dtype)

    @property
    def large(self) -> Bf16Gemm | Fp16Linear | I8Linear:
        """The copy for steps of more than SMALL rows, made on first use if the layer
        defers it (a start waits for none, and a session of short prompts never needs
        it). Threads may race to it."""
        if self._copy is None:
            with self._making:
                if self._copy is None:
                    self._copy = self._make_large()
        return self._copy

    def _make_large(self) -> Bf16Gemm | Fp16Linear | I8Linear:
        raise NotImplementedError


class Q8Bf16Linear(SplitLinear):
    """Q8_0 for steps of up to SMALL rows, a native bf16 GEMM (Bf16Gemm) above, on CPUs
    that compute bf16 natively. At one row Q8_0 is 1.5-2x faster (the step reads the
    weights, and Q8_0 is 1.125 bytes a weight against bf16's 2; a Q5_0 weight's own blocks
    0.69); from 8-16 rows the bf16 dot products win, as our int16 kernel spends as many
    instructions scaling each block as multiplying it. Two copies: 3.125 bytes a weight."""

    # Where the bf16 GEMM passes Q8_0, Gemma 3 270M's shapes, 2 cores, weights from DRAM
    # (cpu_linears.py --cold 96). AMX tiles from 5-8 rows (a Xeon: at 8 rows qkv 0.068 vs
    # 0.118 ms, down 0.099 vs 0.163, head 13.2 vs 13.2; at 4 the kernel still wins or ties:
    # head 8.3 vs 13.0 ms, and the head's 4 rows read 335 MB as bf16 against 189 as Q8_0
    # whichever GEMM runs). vdpbf16ps from 9-16 rows (a Zen 5: at 8 rows level, qkv 0.058
    # vs Q8_0's 0.058 and Q5_0's 0.049, down 0.070 vs 0.076; at 16 qkv 0.061 vs 0.094,
    # gate_up 0.153 vs 0.281).
    SMALL = 4 if amx() else 8

    def __init__(self, weight: torch.Tensor, small: Q5Linear | None = None) -> None:
        self.q8 = small or Q8Linear(weight)  # a Q5_0 weight's own blocks
        self._init_bf16(weight.detach().bfloat16().contiguous())

    def _init_bf16(self, bf16: torch.Tensor) -> None:
        # The GEMM's packed copy is made on the first step of more than SMALL rows (the
        # 262k-row head alone takes ~0.5 s in oneDNN).
        self.bf16: torch.Tensor | None = bf16
        self.out_features, self.in_features = bf16.shape

    @classmethod
    def from_packed(cls, small: BlockLinear, bf16: torch.Tensor) -> Q8Bf16Linear:
        """The layer over a saved few-row copy and bf16 weight (models/packed.py)."""
        self = cls.__new__(cls)
        self.q8 = small
        self._init_bf16(bf16)
        return self

    def packed_state(self) -> dict[str, torch.Tensor]:
        """What from_packed takes back; the bf16 weight exists until its first large step."""
        if self.bf16 is None:
            raise RuntimeError("the bf16 weight is already packed; save before running")
        return {**self.q8.packed_state(), "bf16": self.bf16}

    def _make_large(self) -> Bf16Gemm:
        packed = Bf16Gemm(self.bf16)
        self.bf16 = None  # the packed copy replaces the plain one
        return packed

    def _large_step(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = self.large(rows)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def nbytes(self) -> int:
        return self.q8.nbytes() + self.out_features * self.in_features * 2


def dequantized(blocks: BlockLinear) -> torch.Tensor:
    """The float32 weight [N, K] a block copy holds, each value exact (q * d)."""
    values = getattr(blocks.kernels, f"{blocks.KIND}_values")
    return values(blocks.q, blocks.d, blocks.in_features)


class Q8Fp16Linear(SplitLinear):
    """Q8_0 (or a file's own Q5_0 blocks) for steps of up to SMALL rows, fbgemm's fp16 GEMM
    above, where this CPU runs it faster for the weight's shape (calibrate.fp16_small: on a
    Zen 5 in float32 one or two of Gemma 3 270M's layer shapes; held to AVX2 code, as on the
    AVX2-only EPYC, none: the two are about level there). The
    fp16 copy is made from the block copy's own values at the first larger step, so both
    compute with the same weights, a start waits for neither, and the packed form on disk
    is q8's. 3.125 bytes a weight once both exist."""

    def __init__(self, small: BlockLinear, rows: int) -> None:
        self.q8, self.SMALL = small, rows
        self.out_features, self.in_features = small.out_features, small.in_features

    def _make_large(self) -> Fp16Linear:
        return Fp16Linear(dequantized(self.q8))

    def pending_bytes(self) -> int:
        """What the fp16 copy will take once made (0 after)."""
        return 0 if self._copy is not None else self.out_features * self.in_features * 2

    def packed_state(self) -> dict[str, torch.Tensor]:
        return self.q8.packed_state()

    def nbytes(self) -> int:
        return self.q8.nbytes() + self.out_features * self.in_features * 2


def fp16_split(small: BlockLinear) -> QuantLinear:
    """q8+fp16's layer over a block copy: split where fp16 wins for its shape here, else
    the block copy alone."""
    rows = fp16_small(small.out_features, small.in_features)
    return small if rows is None else Q8Fp16Linear(small, rows)


class Q8I8Linear(SplitLinear):
    """Q8_0 for steps of up to SMALL rows, int8 blocks on both sides (I8Linear) above: with
    VNNI 1.3-1.6x oneDNN's bf16 GEMM for Gemma 3 270M's shapes at 32 rows, and
    2.25 bytes a weight for both copies (q8+bf16: 3.125). The large steps' activations are
    rounded to 8 bits (per block of 32, as llama.cpp does), which costs some quality:
    docs/benchmarks.md has top-1 agreement and perplexity."""

    def __init__(self, weight: torch.Tensor, small: Q5Linear | None = None) -> None:
        self.q8 = small or Q8Linear(weight)
        self._copy = I8Linear(weight)  # made at once: the packed form on disk keeps it
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_packed(cls, small: BlockLinear, i8q: torch.Tensor,
                    i8d: torch.Tensor) -> Q8I8Linear:
        """The layer over saved copies (models/packed.py)."""
        self = cls.__new__(cls)
        self.q8, self._copy = small, I8Linear.from_packed(i8q, i8d, small.in_features)
        self.out_features, self.in_features = small.out_features, small.in_features
        return self

    def packed_state(self) -> dict[str, torch.Tensor]:
        return {**self.q8.packed_state(), **self.large.packed_state()}

    def nbytes(self) -> int:
        return self.q8.nbytes() + self.large.nbytes()


QuantLinear = Fp16Linear | BlockLinear | SplitLinear | Int8Linear
_KINDS: dict[str, type[QuantLinear]] = {"fp16": Fp16Linear, "q8": Q8Linear,
                                        "q8+bf16": Q8Bf16Linear, "q8+int8": Q8I8Linear,
                                        "int8": Int8Linear}


def quantized(weight: torch.Tensor, mode: str) -> QuantLinear:
    """The packed copy of a [out, in] weight for a mode other than none. The q8 modes keep
    a weight that is Q5_0 already (a GGUF's Q5_0 tensors) in its own blocks on AVX-512BW
    CPUs: no rounding, 0.61x Q8_0's bytes at decode, and within 2-7% of Q8_0's speed at
    32-512 rows (benchmarks/cpu_linears.py --cold), so q8 serves it so at every step size
    (one copy) and the others below their second copy."""
    mode = layer_mode(mode, weight.shape[0])
    q5 = Q5Linear.exact(weight) if mode.startswith("q8") else None
    if mode == "q8+fp16":
        return fp16_split(q5 or Q8Linear(weight))
    if q5 is not None:
        return q5 if mode == "q8" else _KINDS[mode](weight, q5)
    return _KINDS[mode](weight)


def from_packed(mode: str, parts: dict[str, torch.Tensor], in_features: int) -> QuantLinear:
    """A layer of a q8 mode over the parts its packed_state gave."""
    kind = Q5Linear if "q5" in parts else Q8Linear
    small = kind.from_packed(*(parts[k] for k in kind.KEYS), in_features)
    if "i8q" in parts:  # q8+int8's, or an LM head's in any q8 mode (serves_i8_head)
        return Q8I8Linear.from_packed(small, parts["i8q"], parts["i8d"])
    if mode == "q8+bf16":
        return Q8Bf16Linear.from_packed(small, parts["bf16"])
    if mode == "q8+fp16":
        return fp16_split(small)
    if mode in ("q8", "q8+int8"):  # (q8+int8 without 16 columns at a time: q8 alone)
        return small
    raise ValueError(f"no saved form for quantization {mode!r}")


def serves_i8_head(mode: str, out_features: int) -> bool:
    """Whether a q8 mode serves the LM head as q8+int8 does (Q8_0 up to 16 rows, int8
    blocks on both sides above): where i8_fast, but not q8+bf16 where the CPU has AMX.
    Above 16 rows the head computes, and int8 blocks run it 1.5x oneDNN's bf16 at 32 rows
    (3-6x our int16 kernel) with top-1 agreement 98.80% against bf16's 98.62% (the head's
    Q8_0 weights stay exact; bf16 rounds them); up to 16 rows the int16 activations keep
    98.89% where int8 ones had 98.47% (docs/benchmarks.md). Two copies, 2.25 bytes a
    weight, against q8+bf16's Q8_0 copy and oneDNN's blocked bf16 one (3.125). With AMX,
    q8+bf16 keeps its own split instead (Q8_0 up to 4 rows, bf16 tiles above; these
    figures are oneDNN's tiles, kernels/bf16gemm.c is faster still):
    Gemma 3 270M's head on a 2-core Xeon, interleaved calls, 14.6 against 30.7 ms at 16
    rows (where the int8-block head still runs Q8_0), 18.7 against 28.2 at 64, level at 8
    and 32 (13.8 / 13.8, 16.9 / 17.7); agreement stays (98.68% against 98.83%, perplexity
    7.945 against 7.949), for 146 MB more (oneDNN's blocked copy against the int8 one).
    On AVX2 (a Zen 5 held to it, float32; calibrate.i8_wins asks each CPU): 33.9 against
    40.0 ms at 32 rows, and the batch-32 step 79 ms against 98; there the alternative is
    Q8_0 with int16 activations, so top-1 agreement goes from 98.80% to 98.11% on whole
    texts (perplexity 8.056 both)."""
    if mode == "q8+bf16" and amx():
        return False
    return mode.startswith("q8") and i8_fast() and out_features % CpuKernels.I8_LANES == 0


def layer_mode(mode: str, out_features: int, head: bool = False) -> str:
    """The mode one layer is served in: an LM head as q8+int8 where serves_i8_head, a
    q8+int8 layer whose output columns i8matmul.c cannot take (16 at a time) as q8, any
    other as the model's mode."""
    if head and serves_i8_head(mode, out_features):
        return "q8+int8"
    if mode == "q8+int8" and out_features % CpuKernels.I8_LANES:
        return "q8"
    return mode


def quantize_all(weights: list[torch.Tensor], mode: str,
                 heads: Container[int] = ()) -> list[QuantLinear]:
    """Packed copies of many weights (those at `heads` are LM heads), packed on every core
    at once: fbgemm packs one weight on one thread and releases the GIL (the 262k-row head
    alone takes seconds)."""
    # Largest first, so the head does not start last and finish alone.
    order = sorted(range(len(weights)), key=lambda i: -weights[i].numel())

    modes = [layer_mode(mode, w.shape[0], i in heads) for i, w in enumerate(weights)]
    for i in order:  # timed before the packing threads start, not beside them
        if modes[i] == "q8+fp16":
            fp16_small(*weights[i].shape)

    def pack(i: int) -> QuantLinear:
        return quantized(weights[i], modes[i])

    with ThreadPoolExecutor(max(torch.get_num_threads(), 1)) as pool:
        packed = dict(zip(order, pool.map(pack, order)))
    return [packed[i] for i in range(len(weights))]


def quantize_linears(modules: list[nn.Module], mode: str, extra: list[torch.Tensor] = (),
                     head: nn.Module | None = None) -> tuple[int, list[QuantLinear]]:
    """Give each module with a `weight` and a `quant` slot its packed copy and drop the float
    weight (kept as a meta tensor: shape, no memory); pack the `extra` weights alongside.
    The `extra` weights and `head` (a module of `modules`) are LM heads. Returns the bytes
    all copies hold and the extra copies."""
    heads = {i for i, m in enumerate(modules) if m is head}
    heads |= set(range(len(modules), len(modules) + len(extra)))
    packed = quantize_all([m.weight for m in modules] + list(extra), mode, heads)
    for m, q in zip(modules, packed):
        m.quant = q
        m.weight = nn.Parameter(torch.empty_like(m.weight, device="meta"), requires_grad=False)
    return sum(q.nbytes() for q in packed), packed[len(modules):]
