"""What this CPU can run natively: the x86 features kvserve's dispatch depends on.

kvserve runs on every x86-64 CPU torch supports. Three facts pick the code paths:
- native bfloat16 matmuls (oneDNN needs AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX): otherwise
  bf16 weights still work but their matmuls are emulated, several times slower than float32;
- the ISA the C kernels are compiled for (``-march=native``: AVX2+FMA or AVX-512, with the
  bf16 dot product only where ``avx512_bf16`` is present);
- int8 matmuls (fbgemm: AVX2 or AVX-512, VNNI where present).

``python -m kvserve.cpu_features`` prints the summary; CI and the pytest header show it so a
green run says which paths it covered.

KVSERVE_CPU_FLAGS (comma-separated, e.g. ``avx2,fma,f16c``) makes kvserve take the paths of a
CPU with only those of the relevant features: its dispatch, the kernels' build (the missing
ISAs turned off) and bf16_native follow it, so a run on an AVX-512 machine covers the
AVX2-only machines' paths too (CI runs part of the suite so). The libraries pick their own
kernels from the CPU; the whole of an AVX2-only machine's code, for benchmarks, also takes
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2`` (fbgemm
heeds only its own variable: without it, its fp16 and int8 GEMMs run AVX-512 code).
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

# The flags that change a code path or a benchmark's meaning, in /proc/cpuinfo's spelling.
RELEVANT = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
            "avx512_vnni", "avx512_bf16", "avx_vnni", "avx_ne_convert", "amx_tile",
            "amx_bf16", "amx_int8")


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields (all cores of one machine are alike here)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's flags, less the relevant ones KVSERVE_CPU_FLAGS leaves out where it is set."""
    info = _cpuinfo()
    flags = frozenset((info.get("flags") or info.get("Features") or "").split())
    kept = os.environ.get("KVSERVE_CPU_FLAGS")
    if kept is None:
        return flags
    return flags - (set(RELEVANT) - set(filter(None, kept.replace(",", " ").split())))


def masked() -> bool:
    """Whether KVSERVE_CPU_FLAGS hides features this CPU has."""
    return "KVSERVE_CPU_FLAGS" in os.environ


def cpu_name() -> str:
    info = _cpuinfo()
    return info.get("model name") or platform.processor() or platform.machine()


def cpu_id() -> str:
    """The CPU's name with its family, model and stepping: "AMD EPYC" alone names several
    generations (a Zen 2 and a Zen 5 read alike)."""
    info = _cpuinfo()
    parts = (info.get(k, "?") for k in ("cpu family", "model", "stepping"))
    return f"{cpu_name()} ({'/'.join(parts)})"


def feature_set() -> tuple[str, ...]:
    """The relevant flags this CPU has, in a fixed order (a build-cache key)."""
    flags = cpu_flags()
    return tuple(f for f in RELEVANT if f in flags)


# oneDNN computes bf16 natively with any one of these, or with all of the AVX-512 three.
_BF16_ANY = ("avx512_bf16", "amx_bf16", "avx_ne_convert")
_BF16_ALL = ("avx512bw", "avx512vl", "avx512dq")


@functools.cache
def bf16_native() -> bool:
    """Whether oneDNN computes bf16 matmuls natively here (else torch emulates them)."""
    flags = cpu_flags()
    if masked() and not (flags & set(_BF16_ANY) or flags >= set(_BF16_ALL)):
        return False  # (oneDNN itself still sees the whole CPU)
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_missing() -> str:
    """Why bf16 is emulated here, for messages: the features oneDNN looks for."""
    return (f"this CPU has none of {', '.join(_BF16_ANY)} or {'+'.join(_BF16_ALL)} "
            "that native bfloat16 matmuls need")


def summary() -> str:
    """One line: the CPU, its relevant features, torch's ISA level and the bf16 verdict."""
    bf16 = "native" if bf16_native() else "emulated"
    shown = " (KVSERVE_CPU_FLAGS: the others hidden)" if masked() else ""
    # oneDNN and fbgemm pick their kernels from the CPU themselves, past torch's capability:
    # a run that held them to less says so (benchmarks emulating another CPU kind).
    held = "".join(f"; {name} held to {os.environ[var]}" for var, name in LIBRARY_ISA[1:]
                   if os.environ.get(var))
    return (f"{cpu_name()}: {' '.join(feature_set()) or 'no SIMD flags found'}{shown}; "
            f"torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}"
            f"{held}; bf16 matmul {bf16}; {torch.get_num_threads()} threads")


# The variables that hold a library's kernels below what the CPU has (torch's shows as
# its capability in summary; the calibration cache keys on all three).
LIBRARY_ISA = (("ATEN_CPU_CAPABILITY", "torch"), ("ONEDNN_MAX_CPU_ISA", "oneDNN"),
               ("FBGEMM_ENABLE_INSTRUCTIONS", "fbgemm"))


if __name__ == "__main__":
    print(summary())
