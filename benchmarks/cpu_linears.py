"""Every CPU matmul candidate for Gemma 3 270M's linear shapes, as ratios to float32 F.linear.

    python benchmarks/cpu_linears.py [--repeat 20]

Candidates: float32 F.linear; bf16 F.linear (oneDNN, native only with AVX-512 BF16/AMX);
fbgemm fp16 and dynamic int8 (what --quantization fp16/int8 run); torch's weight-only
`_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` (group 32). Prints ms per call at
1 and 32 tokens and the CPU it ran on.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from kvserve.cpu_features import summary
from kvserve.models.quant import quantized

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


def candidates(w: torch.Tensor) -> dict:
    scale = w.abs().amax(1) / 127
    w8 = (w / scale[:, None]).round().to(torch.int8)
    wb = w.bfloat16()
    return {
        "f32": lambda x: torch.nn.functional.linear(x, w),
        "bf16": lambda x: torch.nn.functional.linear(x.bfloat16(), wb),
        "fbgemm fp16": quantized(w, "fp16"),
        "fbgemm int8": quantized(w, "int8"),
        "int8pack_mm": lambda x: torch.ops.aten._weight_int8pack_mm(x, w8, scale),
        "int4pack_mm": int4_linear(w),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    print(f"cpu: {summary()}")
    print("| shape | tokens | " + " | ".join(candidates(torch.zeros(64, 64)).keys()) + " |")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        fns = candidates(w)
        for m in (1, 32):
            x = torch.randn(m, k)
            rep = max(2, args.repeat // (20 if name == "head" else 1))
            times = {c: ms(lambda f=f, x=x: f(x), rep) for c, f in fns.items()}
            cells = [f"{t:.3f} ({times['f32'] / t:.1f}x)" for t in times.values()]
            print(f"| {name} {n}x{k} | {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
