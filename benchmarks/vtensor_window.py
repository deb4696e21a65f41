"""Sliding-window layers under --kv-backend vtensor: mapped bytes and decode time, with and
without unmapping what left the window.

    python benchmarks/vtensor_window.py [--tokens 1024 4096 8192] [--decode 32] [--rounds 2]

Gemma 3 270M (window 512 in 15 of its 18 layers), one request per run: a prompt
of `--tokens` tokens, prefilled in 2048-token steps, then `--decode` decode steps
timed one by one (the request is still running when they end). Each context is
run without the unmap (`VirtualAttention.window_unmap = False`: every layer maps
the whole history, as before) and with it; `--rounds` repeats that, the order
flipped each round (other load on the machine drifts). Per run it reports:

* mapped MiB in the sliding and in the full layers, and reserved MiB, read from
  /metrics as the server renders it (`ServerMetrics.render` of the engine's
  snapshot: kvserve_vtensor_sliding_mapped_bytes, _mapped_bytes, _reserved_bytes);
* physical MiB (the memfd's blocks): unchanged by the unmap while the prefix trees
  still hold the unmapped chunks, and after `trim()` drops the trees (what an idle
  release or memory pressure does), with the request still running;
* the median and mean decode step time, and the time `unmap_window` took per
  decode step (inside `commit`; it unmaps one chunk per sliding layer every
  32 tokens).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from prometheus_client.parser import text_string_to_metric_families

from kvserve.cpu_features import summary
from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import SamplingParams
from kvserve.models import Gemma3ForCausalLM, default_gguf_path, load_model_files
from kvserve.server.engine_loop import EngineLoop
from kvserve.server.metrics import ServerMetrics

MiB = 1 << 20
GAUGES = ("sliding_mapped_bytes", "mapped_bytes", "reserved_bytes", "physical_bytes")


def text_ids(tokenizer, tokens: int) -> list[int]:
    """Varied text of at least `tokens` tokens (numbers keep it from compressing)."""
    text = " ".join(f"Entry {i}: {i * 7919 % 1009} units shipped to depot {i % 37}."
                    for i in range(tokens // 8))
    ids = tokenizer(text).input_ids
    assert len(ids) >= tokens, len(ids)
    return ids[:tokens]


def scrape(engine: LLMEngine) -> dict[str, float]:
    """The kvserve_vtensor_* gauges as /metrics renders them for this engine now (the
    server's own snapshot of it, rendered by the server's metrics)."""
    metrics = ServerMetrics()
    text = metrics.render(EngineLoop(engine, metrics)._snapshot()).decode()
    return {f.name.removeprefix("kvserve_vtensor_"): f.samples[0].value
            for f in text_string_to_metric_families(text)
            if f.name.removeprefix("kvserve_vtensor_") in GAUGES}


def run(model, tokenizer, prompt: list[int], decode: int, unmap: bool) -> dict[str, float]:
    engine = LLMEngine(model, tokenizer, EngineConfig(
        kv_memory=1024 * MiB, kv_backend="vtensor", max_num_seqs=4))
    attn = engine.runner.attn
    attn.window_unmap = unmap
    spent = [0.0]
    real_unmap = attn.unmap_window

    def timed_unmap(*a) -> int:
        t = time.perf_counter()
        try:
            return real_unmap(*a)
        finally:
            spent[0] += time.perf_counter() - t

    attn.unmap_window = timed_unmap
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=decode + 4, ignore_eos=True))
    while engine.requests["r"].num_computed < len(prompt):
        engine.step()
    engine.step()  # the first decode step: after prefill's last maps
    times, spent[0] = [], 0.0
    for _ in range(decode):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    assert "r" in engine.requests, "the request must still be running"
    out = scrape(engine)
    attn.trim()  # drop the prefix trees (and caches): the request's own mappings stay
    out["physical_trimmed"] = attn.stats()["physical_bytes"]
    out["median_ms"] = statistics.median(times) * 1e3
    out["mean_ms"] = statistics.mean(times) * 1e3
    out["unmap_us"] = spent[0] / decode * 1e6
    attn.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--decode", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--rounds", type=int, default=1, help="repeats, the order flipped each time")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {summary()}; load average {os.getloadavg()[0]:.2f}")
    config, state_dict, tokenizer = load_model_files(default_gguf_path())
    model = Gemma3ForCausalLM.from_state_dict(config, state_dict)
    ids = text_ids(tokenizer, max(args.tokens))
    print("| round | context | unmap | sliding mapped MiB | full mapped MiB | total mapped MiB "
          "| reserved MiB | physical MiB | physical after trim MiB | decode median ms "
          "| decode mean ms | unmap us/step |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rnd, n in ((rnd, n) for rnd in range(args.rounds) for n in args.tokens):
        for unmap in (False, True) if rnd % 2 == 0 else (True, False):
            r = run(model, tokenizer, ids[:n], args.decode, unmap)
            sliding, total = r["sliding_mapped_bytes"] / MiB, r["mapped_bytes"] / MiB
            print(f"| {rnd} | {n} | {'yes' if unmap else 'no'} | {sliding:.1f} "
                  f"| {total - sliding:.1f} | {total:.1f} | {r['reserved_bytes'] / MiB:.0f} "
                  f"| {r['physical_bytes'] / MiB:.1f} | {r['physical_trimmed'] / MiB:.1f} "
                  f"| {r['median_ms']:.1f} | {r['mean_ms']:.1f} | {r['unmap_us']:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
