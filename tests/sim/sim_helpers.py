"""Small configurations for fast simulator tests."""

from __future__ import annotations

import dataclasses

from kvserve.sim.gpus import GPU, get_gpu
from kvserve.sim.models import Model, get_model
from kvserve.sim.simulator import SimConfig


def gpu_with_kv(model: Model, kv_bytes: int, max_model_len: int, base: str = "h100") -> GPU:
    """A GPU whose memory leaves exactly ~kv_bytes of KV pool for `model`."""
    probe = SimConfig(model, get_gpu(base), max_model_len=max_model_len).budget()
    usable = probe.weights + probe.reserve + kv_bytes
    return dataclasses.replace(get_gpu(base), name=f"{base}-small",
                               memory_bytes=int(usable / 0.9) + 1)


def small_config(model_name: str, policy: str, kv_mib: int, max_model_len: int = 16384,
                 **kw) -> SimConfig:
    model = get_model(model_name)
    gpu = gpu_with_kv(model, kv_mib << 20, max_model_len)
    return SimConfig(model, gpu, policy=policy, max_model_len=max_model_len, **kw)
