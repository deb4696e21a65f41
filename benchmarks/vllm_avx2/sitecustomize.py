"""Holds vLLM's CPU build to its AVX2 kernels (vllm_cpu_peer.sh puts this folder first on
PYTHONPATH when KVSERVE_CPU_FLAGS hides AVX-512, so every process of the run imports it).

vLLM picks its compiled library (`_C_AVX2`, `_C_AVX512` or the AVX-512 BF16 `_C`) and its
attention kernels from torch.cpu's feature checks, which read the CPU itself and heed none
of ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA or FBGEMM_ENABLE_INSTRUCTIONS: without this, a
run meant to stand for an AVX2-only machine runs vLLM's AVX-512 code.
"""

import torch

for check in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
              "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, check):
        setattr(torch.cpu, check, lambda: False)
