"""What this CPU can run natively: the x86 features kvserve's dispatch depends on.

kvserve runs on every x86-64 CPU torch supports. Three facts pick the code paths:
- native bfloat16 matmuls (oneDNN needs AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX): otherwise
  bf16 weights still work but their matmuls are emulated, several times slower than float32;
- the ISA the C kernels are compiled for (``-march=native``: AVX2+FMA or AVX-512, with the
  bf16 dot product only where ``avx512_bf16`` is present);
- int8 matmuls (fbgemm: AVX2 or AVX-512, VNNI where present).

``python -m kvserve.cpu_features`` prints the summary; CI and the pytest header show it so a
green run says which paths it covered.
"""

from __future__ import annotations

import functools
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


def cpu_flags() -> frozenset[str]:
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def cpu_name() -> str:
    info = _cpuinfo()
    return info.get("model name") or platform.processor() or platform.machine()


def feature_set() -> tuple[str, ...]:
    """The relevant flags this CPU has, in a fixed order (a build-cache key)."""
    flags = cpu_flags()
    return tuple(f for f in RELEVANT if f in flags)


@functools.cache
def bf16_native() -> bool:
    """Whether oneDNN computes bf16 matmuls natively here (else torch emulates them)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bf16_missing() -> str:
    """Why bf16 is emulated here, for messages: the features oneDNN looks for."""
    return ("this CPU has none of avx512_bf16, amx_bf16, avx_ne_convert or "
            "avx512bw+avx512vl+avx512dq that native bfloat16 matmuls need")


def summary() -> str:
    """One line: the CPU, its relevant features, torch's ISA level and the bf16 verdict."""
    bf16 = "native" if bf16_native() else "emulated"
    return (f"{cpu_name()}: {' '.join(feature_set()) or 'no SIMD flags found'}; "
            f"torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}; "
            f"bf16 matmul {bf16}; {torch.get_num_threads()} threads")


if __name__ == "__main__":
    print(summary())
