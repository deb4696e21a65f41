"""From how many rows fbgemm's fp16 GEMM computes a weight shape faster than our Q8_0 kernel,
and (on AVX2 without VNNI) whether int8 blocks on both sides run an LM head's batch steps
faster than it, measured on this CPU once and kept.

Which of the two wins a step of many rows depends on the core, not on its instruction set:
on the AVX2-only EPYC (Zen 2/3 class, docs/benchmarks.md) the int16 multiply-adds of
kernels/qmatmul.c run about as fast as fbgemm's fp16 FMAs (0.83-1.04x from 8 rows, 1.15x
for the LM head at 32), and so do they on a Zen 5 held to AVX2 code, while the same Zen 5
with AVX-512, in float32, runs fbgemm 10% or more faster on one or two of Gemma 3 270M's
layer shapes. A table per CPU kind would be wrong on the next kind, so q8+fp16 times
both on the shapes it serves, at the first start on a machine, and keeps the answer in the
cache dir (`calibration.json`), keyed by the CPU (name, family, model, stepping, features,
and the ISA the libraries were held to), the thread count, the torch version and the Q8_0
layout.

A step of a few rows reads its weights, and Q8_0 reads 0.56x fp16's bytes; and a step that
takes fbgemm leaves decoder.c's one call for the modules' path (~2.5 ms a step of Gemma 3
270M), which a step of a few rows saves no more than. Steps of up to MIN_SMALL rows stay on
Q8_0 whatever the timing of one weight hot in cache says.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvserve.cpu_features import LIBRARY_ISA, cpu_id, feature_set
from kvserve.kernels.cpu import CpuKernels
from kvserve.paths import default_cache_dir

ROWS = (16, 32, 256)  # step sizes timed: decode batches and a prefill chunk
MIN_SMALL = 16  # steps of up to this many rows stay on Q8_0
MARGIN = 0.9  # the second copy must take at most this share of Q8_0's time: it costs memory
TIMED_OUT = 16384  # a larger shape (an LM head) is timed on this many of its output rows
SAMPLES = 5  # timings a kernel a row count, alternating with the other's; the median counts
SAMPLE_S = 0.01  # each at least this long (calls repeated): single calls of 0.1 ms are noise


def _key(out_features: int, in_features: int, large: str = "fp16") -> str:
    held = ",".join(f"{v}={os.environ[v]}" for v, _ in LIBRARY_ISA
                    if os.environ.get(v))
    shape = f"{out_features}x{in_features}" + ("" if large == "fp16" else f"|{large}")
    return "|".join((cpu_id(), ",".join(feature_set()), held,
                     f"threads={torch.get_num_threads()}", f"torch={torch.__version__}",
                     f"q8_layout={CpuKernels.Q8_LAYOUT}", shape))


def _file() -> Path:
    return default_cache_dir() / "calibration.json"


def _read() -> dict[str, int | None]:
    """The kept answers; anything but None or a row count of at least MIN_SMALL (a file
    edited or damaged) is left out, to be measured again."""
    try:
        data = json.loads(_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if v is None
            or type(v) is int and v >= MIN_SMALL}


def _write(key: str, small: int | None) -> None:
    """Add one answer to the file (atomically; a cache that cannot be written only costs the
    next start the measurement)."""
    data = _read()
    data[key] = small
    path, tmp = _file(), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".calibration.", dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def measure(out_features: int, in_features: int, row_counts: tuple[int, ...],
            large: str = "fp16") -> dict[int, tuple[float, float]]:
    """Seconds a call of Q8_0 and of the large steps' copy (fp16, or i8: int8 blocks on both
    sides) at each row count for this shape (random values: neither kernel's time depends on
    them), both packed once."""
    from kvserve.models.quant import Fp16Linear, I8Linear, Q8Linear  # (quant imports us)

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(min(out_features, TIMED_OUT), in_features, generator=gen) * 0.05
    kernels = (Q8Linear(w), {"fp16": Fp16Linear, "i8": I8Linear}[large](w))
    return {rows: _timed(kernels, torch.randn(rows, in_features, generator=gen))
            for rows in row_counts}


def _timed(kernels: tuple, x: torch.Tensor) -> tuple[float, float]:
    """Seconds a call of each kernel on x: the median of SAMPLES timings of at least
    SAMPLE_S each, the two kernels alternating."""
    calls = []
    for kernel in kernels:  # a first call warms it up and sizes its samples
        start = time.perf_counter()
        kernel(x)
        calls.append(max(1, int(SAMPLE_S / max(time.perf_counter() - start, 1e-6))))
    times: list[list[float]] = [[], []]
    for _ in range(SAMPLES):
        for i, kernel in enumerate(kernels):
            start = time.perf_counter()
            for _ in range(calls[i]):
                kernel(x)
            times[i].append((time.perf_counter() - start) / calls[i])
    return statistics.median(times[0]), statistics.median(times[1])


def small_from(times: dict[int, tuple[float, float]]) -> int | None:
    """The most rows Q8_0 should take, from (Q8_0, second copy) seconds at each timed row
    count: the second copy (fp16 or i8) takes every step above the largest count where it
    does not win by MARGIN (at least above MIN_SMALL); None where it does not win at the
    largest count (no second copy)."""
    won = False  # the second copy won at every count above this one
    for rows in sorted(times, reverse=True):
        q8, other = times[rows]
        if other > MARGIN * q8:
            return max(rows, MIN_SMALL) if won else None
        won = True
    return MIN_SMALL


@functools.cache
def fp16_small(out_features: int, in_features: int) -> int | None:
    """The most rows Q8_0 serves for this shape in q8+fp16, fbgemm's fp16 above; None
    where fp16 is not faster here at any size timed. Measured once per CPU and kept."""
    return _small(out_features, in_features, "fp16", ROWS)


I8_SHAPE = (TIMED_OUT, 640)  # an LM head's rows (Gemma 3 270M's width): what the answer serves


@functools.cache
def i8_wins() -> bool:
    """Whether int8 blocks on both sides (I8Linear) run an LM head's 32-row step at least
    1/MARGIN times as fast as Q8_0 on this CPU: asked where neither has a clear edge by its
    instruction set (AVX2 without VNNI: vpmaddubsw and vpmaddwd against Q8_0's vpmaddwd;
    1.18x for the head at 32 rows on a Zen 5 held to AVX2, not measured on a Zen 2 or 3).
    Measured once per CPU and kept."""
    return _small(*I8_SHAPE, "i8", (32,)) is not None


def _small(out_features: int, in_features: int, large: str, rows: tuple[int, ...]) -> int | None:
    key = _key(out_features, in_features, large)
    known = _read()
    if key in known:
        return known[key]
    small = small_from(measure(out_features, in_features, rows, large))
    _write(key, small)
    return small
