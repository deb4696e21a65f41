"""GPU parameters for the roofline cost model, as plain data.

Numbers are NVIDIA's datasheet figures (dense, i.e. without 2:4 sparsity)
and the memory size `nvidia-smi` reports, which is what vLLM's
`gpu_memory_utilization` multiplies:

- H100 80GB SXM5 (the paper's H100 box has Xeon 8480C CPUs, i.e. a DGX/HGX
  H100, hence SXM): 81559 MiB HBM3, 3.35 TB/s, 989 TFLOPS bf16 dense,
  1979 TFLOPS fp8 dense.
  https://www.nvidia.com/en-us/data-center/h100/ (datasheet, SXM column)
- L4 24GB: 23034 MiB GDDR6, 300 GB/s, 121 TFLOPS bf16 dense (242 with
  sparsity), 242.5 TFLOPS fp8 dense (485 with sparsity).
  https://www.nvidia.com/en-us/data-center/l4/ (datasheet)

Host links, one direction (the datasheets give both directions together):
H100 SXM5 PCIe Gen5 x16, 128 GB/s -> 64 GB/s; L4 PCIe Gen4 x16, 64 GB/s -> 32
GB/s. Copies between the KV pool and a host tier move at most that fast.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
TB = 1e12


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # as nvidia-smi reports it
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense tensor-core FLOP/s
    fp8_flops: float  # dense tensor-core FLOP/s
    pcie_bandwidth: float  # bytes/s host <-> device, one direction

    def matmul_flops(self, fp8: bool) -> float:
        return self.fp8_flops if fp8 else self.bf16_flops


GPUS: dict[str, GPU] = {
    "h100": GPU("H100-SXM5-80GB", 81559 * MiB, 3.35 * TB, 989.4 * TB, 1978.9 * TB, 64e9),
    "l4": GPU("L4-24GB", 23034 * MiB, 0.300 * TB, 121.0 * TB, 242.5 * TB, 32e9),
}


def get_gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; choose from {sorted(GPUS)}") from None
