"""Small configurations for fast simulator tests."""

from __future__ import annotations

import dataclasses

from kvserve.sim.gpus import GPU, get_gpu
from kvserve.sim.models import Model, get_model
from kvserve.sim.simulator import SimConfig
from kvserve.sim.traces import OUTPUT_TOKEN, UNIQUE_BASE, TraceRequest


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


def chat(sessions: int = 6, turns: int = 4, msg: int = 300, answer: int = 40,
         gap: float = 2.0) -> list[TraceRequest]:
    """Multi-turn sessions as sharegpt_chat builds them: each prompt is the whole
    conversation so far, the answers as the simulator samples them."""
    out = []
    for s in range(sessions):
        out += chat_session(f"s{s}", 0.5 * s, [(msg, answer, gap)] * turns,
                            UNIQUE_BASE + s * turns)
    return sorted(out, key=lambda r: r.arrival)


def chat_session(name: str, start: float, turns: list[tuple[int, int, float]],
                 unique: int) -> list[TraceRequest]:
    """One session's turns, (message tokens, answer tokens, gap after it) each, from
    `start`; each message's first token (unique + 1, + 2, ..) makes it the session's own."""
    out: list[TraceRequest] = []
    ids: list[int] = []
    t = start
    for k, (msg, answer, gap) in enumerate(turns):
        ids = ids + [unique + k + 1] + list(range(len(ids) + 1, len(ids) + msg))
        out.append(TraceRequest(f"{name}t{k}", t, answer, prompt_ids=ids, session=name))
        ids = ids + [OUTPUT_TOKEN] * answer
        t += gap
    return out
