"""vTensor memory over a bursty run, and a decode step with each KV backend.

    python benchmarks/vtensor_memory.py bursty [--idle 1.0] [--gap 2.5]
    python benchmarks/vtensor_memory.py steps

bursty: Gemma 3 270M with `--kv-backend vtensor`, a 256 MiB ceiling and an
idle release of `--idle` seconds; two bursts of 8 requests (prompts of
64-400 tokens of distinct text, 32 new tokens each) `--gap` seconds apart.
Prints physical / mapped / reserved KV bytes at the end of each burst and
gap, and the peak. steps: the median decode step at batch 8 (~260-token
contexts) for the paged and vtensor backends, interleaved twice.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.cpu_features import summary
from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import SamplingParams
from kvserve.models import Gemma3ForCausalLM, default_gguf_path, load_model_files

MiB = 1 << 20


def text_ids(tokenizer) -> list[int]:
    """A long, varied text, so prompts cut from different offsets share no prefix."""
    text = " ".join(f"Entry {i}: {i * 7919 % 1009} units shipped to depot {i % 37}."
                    for i in range(400))
    return tokenizer(text).input_ids


def memory(engine: LLMEngine) -> tuple[float, float, float]:
    s = engine.runner.attn.stats()
    return s["physical_bytes"] / MiB, s["mapped_bytes"] / MiB, s["reserved_bytes"] / MiB


def bursty(model, tokenizer, idle_s: float, gap_s: float) -> None:
    engine = LLMEngine(model, tokenizer, EngineConfig(
        kv_memory=256 * MiB, kv_backend="vtensor", kv_idle_release_s=idle_s))
    ids, g = text_ids(tokenizer), torch.Generator().manual_seed(0)
    peak = 0.0
    for burst in range(2):
        for i in range(8):
            n, off = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in
                      ((64, 400), (0, 2000)))
            engine.add_request(f"b{burst}-{i}", {"prompt_token_ids": [2] + ids[off:off + n]},
                               SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            engine.maybe_release_idle()
            peak = max(peak, memory(engine)[0])
        print(f"burst {burst} done: physical {memory(engine)[0]:.1f} MiB")
        end = time.monotonic() + gap_s
        while time.monotonic() < end:
            time.sleep(0.05)
            engine.maybe_release_idle()
        phys, mapped, reserved = memory(engine)
        print(f"gap {burst} done: physical {phys:.1f} MiB, mapped {mapped:.1f}, "
              f"reserved {reserved:.1f}")
    print(f"peak physical {peak:.1f} MiB (the paged backend holds 256 MiB from the start)")


def decode_step_ms(model, tokenizer, backend: str, batch: int = 8, steps: int = 12) -> float:
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_memory=256 * MiB, kv_backend=backend))
    ids = text_ids(tokenizer)
    for i in range(batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [2] + ids[i * 30:i * 30 + 256]},
                           SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True))
    while any(r.num_computed < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["bursty", "steps"])
    ap.add_argument("--idle", type=float, default=1.0, help="kv_idle_release_s")
    ap.add_argument("--gap", type=float, default=2.5, help="seconds between bursts")
    args = ap.parse_args()
    print(f"CPU: {summary()}")
    config, state_dict, tokenizer = load_model_files(default_gguf_path())
    model = Gemma3ForCausalLM.from_state_dict(config, state_dict)
    if args.what == "bursty":
        bursty(model, tokenizer, args.idle, args.gap)
        return
    for _ in range(2):
        for backend in ("paged", "vtensor"):
            ms = decode_step_ms(model, tokenizer, backend)
            print(f"{backend:8s} decode step, batch 8, ~260-token contexts: {ms:.1f} ms")


if __name__ == "__main__":
    main()
