"""Sampling alone: ms a call of Sampler().sample on 1 and 32 rows of Gemma 3's 262k-entry
vocabulary, for the usual OpenAI-style parameters; best of 5 loops of 10 calls.

Two kinds of logits: `randn` (torch.randn * 3 in bfloat16, seeded: a flat row whose top-p
nucleus holds thousands of tokens) and `gemma` (the model's own logits at decode steps of
32 ShareGPT prompts, greedy; its nucleus at top_p 0.9 is a few to ~100 tokens).

    python benchmarks/sampling.py [--logits randn gemma] [--strided] [--device cuda]

--strided passes the logits as a view of a wider tensor, which the compiled pass does not
take: torch's path, the one every GPU step runs; --device cuda runs that path on a GPU
(`randn` logits only: the Gemma logits come from the engine on this CPU's GGUF).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvserve.cpu_features import summary
from kvserve.engine.request import SamplingParams
from kvserve.engine.sampler import Sampler

SETTINGS = {
    "temperature 0.7": {"temperature": 0.7},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.7, top_k 50": {"temperature": 0.7, "top_k": 50},
    "temperature 1.0, top_p 0.95": {"temperature": 1.0, "top_p": 0.95},
    "temperature 1.0, top_p 0.95, top_k 40": {"temperature": 1.0, "top_p": 0.95, "top_k": 40},
}


def gemma_logits(rows: int = 32) -> torch.Tensor:
    """[rows, vocab] logits of one decode step, a row per ShareGPT prompt (the 5th step)."""
    from offline_throughput import sharegpt_workload

    from kvserve.engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine.load(EngineConfig(kv_memory=1 << 30))
    steps: list[torch.Tensor] = []
    sample = engine.sampler.sample

    def keep(logits, ids, params):
        if logits.shape[0] == rows:
            steps.append(logits.clone())
        return sample(logits, ids, params)

    engine.sampler.sample = keep
    prompts, _ = sharegpt_workload(engine.tokenizer, rows, 512, 8)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return steps[4]


def ms_a_call(logits: torch.Tensor, params: SamplingParams) -> float:
    sampler, ids = Sampler(), [str(i) for i in range(logits.shape[0])]
    sampler.sample(logits, ids, [params] * len(ids))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            sampler.sample(logits, ids, [params] * len(ids))
        best = min(best, (time.perf_counter() - t) / 10)
    return round(best * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logits", nargs="*", default=["randn", "gemma"])
    ap.add_argument("--strided", action="store_true", help="torch's path (see above)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    out = {"cpu": summary(), "threads": torch.get_num_threads(), "device": args.device}
    if args.device != "cpu":
        out["gpu"] = torch.cuda.get_device_name(args.device)
    for kind in args.logits:
        logits = (gemma_logits() if kind == "gemma" else
                  (torch.randn(32, 262144, generator=torch.Generator().manual_seed(0)) * 3)
                  .to(torch.bfloat16))
        if args.strided:
            wide = torch.zeros(logits.shape[0], logits.shape[1] + 3, dtype=logits.dtype)
            wide[:, :logits.shape[1]] = logits
            logits = wide[:, :logits.shape[1]]
        logits = logits.to(args.device)
        out[kind] = {name: {"batch1": ms_a_call(logits[:1], SamplingParams(**kw)),
                            "batch32": ms_a_call(logits, SamplingParams(**kw))}
                     for name, kw in SETTINGS.items()}
        out[kind]["dtype"] = str(logits.dtype)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
