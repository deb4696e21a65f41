"""How much of a decode step is in kvserve's C kernels and how much in the Python around
them, with the layers module by module and in one call (kernels/decoder.c).

    python benchmarks/kernel_calls.py [--rows 1 32] [--model smollm2] [--dtype auto]

Every function of the kernels' library (and each projection's bound kernel) is wrapped
by a timer; the step is timed around engine.step(). ms a step over 64 decode steps of
--rows sequences after a 128-token prompt each.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from offline_throughput import load, warm

from kvserve.cpu_features import summary
from kvserve.engine.request import SamplingParams
from kvserve.kernels.cpu import CpuKernels, QMatmul
from kvserve.models.fused_layers import FusedLayers


class _Timed:
    """A ctypes library whose functions add their time and calls to `totals`."""

    def __init__(self, lib: object, totals: dict[str, float]) -> None:
        self._lib, self._totals = lib, totals

    def __getattr__(self, name: str) -> object:
        return _timer(getattr(self._lib, name), self._totals)


def _timer(fn, totals):  # noqa: ANN001, ANN202 - any ctypes function
    def call(*args):  # noqa: ANN002, ANN202
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            totals["kernels"] += time.perf_counter() - t0
            totals["calls"] += 1
    return call


def measure(engine, rows: int, fused: bool) -> dict[str, float]:  # noqa: ANN001
    gen = torch.Generator().manual_seed(0)
    for i in range(rows):
        top = min(200_000, engine.config.vocab_size)
        prompt = torch.randint(10, top, (128,), generator=gen).tolist()
        engine.add_request(f"r{rows}{fused}{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    for _ in range(10):
        engine.step()
    totals = {"kernels": 0.0, "calls": 0}
    saved = FusedLayers.__call__
    if not fused:
        FusedLayers.__call__ = lambda *args: None
    wrapped = [(o, "lib", o.lib) for o in gc.get_objects() if isinstance(o, CpuKernels)]
    wrapped += [(o, "fn", o.fn) for o in gc.get_objects() if isinstance(o, QMatmul)]
    for obj, name, fn in wrapped:
        setattr(obj, name, _Timed(fn, totals) if name == "lib" else _timer(fn, totals))
    try:
        steps, t0 = 64, time.perf_counter()
        for _ in range(steps):
            engine.step()
        step = (time.perf_counter() - t0) / steps * 1e3
    finally:
        for obj, name, fn in wrapped:
            setattr(obj, name, fn)
        FusedLayers.__call__ = saved
    while engine.has_unfinished():
        engine.step()
    inside = totals["kernels"] / steps * 1e3
    return {"step_ms": round(step, 2), "kernels_ms": round(inside, 2),
            "calls": round(totals["calls"] / steps), "outside_ms": round(step - inside, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--model", default=None, help="as kvserve serve's --model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    engine = load(args, 1 << 30)
    warm(engine)
    out = {"cpu": summary(), "dtype": str(engine.model.dtype),
           "quantization": engine.model.quantization}
    for rows in args.rows:
        for fused in (False, True):
            out[f"{rows} rows, {'one call' if fused else 'module by module'}"] = \
                measure(engine, rows, fused)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
