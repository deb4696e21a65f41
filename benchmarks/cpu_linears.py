"""Every CPU matmul candidate for Gemma 3 270M's linear shapes, as ratios to float32 F.linear.

    python benchmarks/cpu_linears.py [--repeat 20] [--tokens 1,8,32,128,512] [--only q8,...]
        [--cold 96]

Candidates: float32 F.linear; float32 as kvserve runs it (layers.linear: a few rows as
weight @ rows.T); bf16 F.linear (oneDNN, native only with AVX-512 BF16/AMX);
bf16 packed (oneDNN's prepacked weight: what q8+bf16 ran above its Q8_0 rows before our
kernel); bf16 kernel (ours, kernels/bf16gemm.c: AMX's tiles, or vdpbf16ps where the CPU has
AVX-512 BF16 but no tiles; q8+bf16 above its Q8_0 rows); int8 blocks
(both sides in int8 blocks of 32 through VNNI: q8+int8 above 16 rows); fbgemm fp16 and
dynamic int8 (what --quantization fp16/int8 run); our Q8_0 and Q5_0 kernels (q8, q5: what
q8 serves a GGUF's Q5_0 tensors with);
torch's weight-only `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` (group 32);
oneDNN's int8 GEMM (`onednn int8`, AMX where the CPU has it; activations a scale per row), and
the same with 128 input channels taken out to a bf16 GEMM (`onednn int8 + 128 bf16`).
Prints ms per call (best of --rounds, candidates interleaved so that a busy machine slows
them alike) with the ratio to float32 and to fbgemm fp16, and the CPU it ran on.
"""

from __future__ import annotations

import argparse
import itertools
import time
import warnings
from functools import partial

import torch

from kvserve.cpu_features import summary
from kvserve.engine.heap import keep_large_blocks
from kvserve.models.layers import Derived, linear
from kvserve.models.quant import Bf16Gemm, I8Linear, Q5Linear, pack_weight, quantized

SHAPES = {"qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048),
          "head": (262144, 640)}


def ms(fn, repeat: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat * 1e3


def int4_linear(w: torch.Tensor, group: int = 32):
    n, k = w.shape
    wg = w.view(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(n, k), 1)
    sz = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().bfloat16()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, group, sz)


def int8pack_linear(w: torch.Tensor):
    scale = w.abs().amax(1) / 127
    w8 = (w / scale[:, None]).round().to(torch.int8)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, w8, scale)


def onednn_int8_linear(w: torch.Tensor, per_row: bool = True,
                       outliers: torch.Tensor | None = None):
    """oneDNN's int8 GEMM (AMX tiles where the CPU has them): the weight int8 per output
    row; the activations with one scale for all (what qlinear takes) or, per_row, one per
    row, passed as 1 and applied to the output. `outliers`: input channels taken out of
    the int8 GEMM and multiplied in bf16 (oneDNN's packed weight), the result added
    (LLM.int8()'s decomposition). Tried for the AMX kind's head, not kept
    (docs/benchmarks.md: quality, speed)."""
    keep = torch.ones(w.shape[1], dtype=torch.bool)
    if outliers is not None:
        keep[outliers] = False
        wo = pack_weight(w[:, outliers].bfloat16().contiguous())
    wi = w[:, keep]
    scale = wi.abs().amax(1).clamp(min=1e-12) / 127
    packed = torch.ops.onednn.qlinear_prepack((wi / scale[:, None]).round().to(torch.int8),
                                              [32, wi.shape[1]])
    zeros = torch.zeros(w.shape[0], dtype=torch.long)

    def linear(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        xi = x[:, keep] if outliers is not None else x
        s = (xi.abs().amax(-1, keepdim=True) if per_row else xi.abs().amax()).clamp(min=1e-12) / 127
        y = torch.ops.onednn.qlinear_pointwise(
            torch.round(xi / s).to(torch.int8), 1.0 if per_row else float(s), 0, packed, scale,
            zeros, None, 1.0, 0, torch.bfloat16, "none", [], "")
        if per_row:
            y.mul_(s.to(y.dtype))
        if outliers is not None:
            y += torch.ops.mkldnn._linear_pointwise(x[:, outliers].bfloat16(), wo, None, "none",
                                                    [], "")
        return y
    return linear


def bf16_linear(w: torch.Tensor):
    wb = w.bfloat16()
    return lambda x: torch.nn.functional.linear(x.bfloat16(), wb)


def bf16_packed_linear(w: torch.Tensor):
    """oneDNN's prepacked bf16 weight, bf16 rows (Bf16Gemm where our kernel does not run)."""
    wp = pack_weight(w.bfloat16())
    return lambda x: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), wp, None, "none", [], "")


def kernel_linear(w: torch.Tensor):
    """What q8+bf16 runs above its Q8_0 rows (Bf16Gemm: our kernel), bf16 rows."""
    gemm = Bf16Gemm(w.bfloat16())
    if not gemm.on_kernel:
        raise RuntimeError("this CPU (or this build) has no native bf16")
    return lambda x: gemm(x.bfloat16().contiguous())


def i8_linear(w: torch.Tensor):
    """What q8+int8 runs above 16 rows (bf16 rows in and out, as in a bf16 model)."""
    linear = I8Linear(w)
    return lambda x: linear(x.bfloat16())


# name: a function of the float weight giving the candidate's x -> x @ w.T
MAKERS = {
    "f32": lambda w: lambda x: torch.nn.functional.linear(x, w),
    # what kvserve runs for float32 (layers.linear: a few rows as w @ x.T)
    "f32 kvserve": lambda w: torch.inference_mode()(
        partial(linear, weight=w, packed=Derived(Bf16Gemm))),
    "bf16": bf16_linear,
    "bf16 packed": bf16_packed_linear,
    "bf16 kernel": kernel_linear,
    "int8 blocks": i8_linear,
    "int8 blocks f32": I8Linear,  # the same, float32 rows (the LM head on AVX2-only CPUs)
    "onednn int8": onednn_int8_linear,
    # the same with the first 128 input channels in bf16 (in the model: the 128 largest of
    # the final norm's gains; which ones does not change the speed)
    "onednn int8 + 128 bf16": lambda w: onednn_int8_linear(w, outliers=torch.arange(128)),
    "fbgemm fp16": lambda w: quantized(w, "fp16"),
    "fbgemm int8": lambda w: quantized(w, "int8"),
    "q8": lambda w: quantized(w, "q8"),
    "q5": Q5Linear,  # re-quantized: the random weights are not Q5_0 already
    "int8pack_mm": int8pack_linear,
    "int4pack_mm": int4_linear,
}


def candidates(w: torch.Tensor, names: list[str], copies: int = 1) -> dict:
    """Each named candidate (None where this CPU cannot run it: the reason printed); with
    copies > 1, each call takes the next of that many copies of the weight, so that the
    weights come from DRAM as in a decode step of the whole model (every layer's weights
    together are far more than the L3)."""
    fns = {}
    for name in names:
        try:
            made = [MAKERS[name](w.clone() if copies > 1 else w) for _ in range(copies)]
        except RuntimeError as err:  # e.g. oneDNN's bf16 packing on a CPU without AVX-512
            print(f"{name}: not on this CPU ({str(err).splitlines()[0]})")
            fns[name] = None
            continue
        turn = itertools.cycle(made)
        fns[name] = made[0] if copies == 1 else lambda x, turn=turn: next(turn)(x)
    return fns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--only", default="", help="comma-separated candidates (default: all)")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (0: as is)")
    ap.add_argument("--cold", type=int, default=0, metavar="MWEIGHTS",
                    help="cycle through copies of each weight, this many million weights in "
                         "all (e.g. 96: past a 32 MiB L3 even at Q5_0), so they come from DRAM")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_large_blocks()  # as the engine does: outputs past 32 MiB are not page-faulted in
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    only = set(filter(None, args.only.split(","))) | {"f32", "fbgemm fp16"}
    print(f"cpu: {summary()}")
    names = [c for c in MAKERS if not args.only or c in only]
    print("| shape | tokens | " + " | ".join(names) + " |")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k) * 0.05
        fns = candidates(w, names, max(1, -(-args.cold * 2**20 // (n * k))))
        for m in map(int, args.tokens.split(",")):
            x = torch.randn(m, k)
            rep = max(2, args.repeat // (20 if name == "head" else 1) // max(1, m // 32))
            best = {c: float("inf") for c in fns}
            for _ in range(args.rounds):  # interleaved rounds, best of each
                for c, f in fns.items():
                    if f is not None:
                        best[c] = min(best[c], ms(lambda f=f, x=x: f(x), rep))
            cells = [f"{t:.3f} ({best['f32'] / t:.1f}x, {best['fbgemm fp16'] / t:.2f}x fp16)"
                     if t < float("inf") else "n/a" for t in best.values()]
            print(f"| {name} {n}x{k} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
