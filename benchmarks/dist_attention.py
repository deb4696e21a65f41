"""DistAttention on this machine: the longest context 3 instances serve against one, and
decode speed of a spread request against the same request held locally.

    python benchmarks/dist_attention.py [--kv-memory 48M] [--chunk 256] [--decode 32]

Gemma 3 270M instances as Ray actors (one torch thread each) behind the cluster
front end, as `kvserve cluster serve` runs them:
  one       1 instance with a pool of X, DistAttention off: its longest prompt;
  spread    3 instances of X each, DistAttention on: the longest prompt the front end
            admits, served (a prompt of ShareGPT text that long), its TTFT, decode
            tokens/s, and the KV bytes lent (full-attention layers only) against what
            lending every layer's KV would move;
  local     1 instance of 3X: the same prompt, held whole: decode tokens/s, and its
            greedy tokens, which the spread run must equal.
Prints a JSON summary (and writes it with --json).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time

import ray

from kvserve.cluster.frontend import Cluster, InstanceSpec
from kvserve.cluster.global_scheduler import GlobalScheduler
from kvserve.cpu_features import summary
from kvserve.datasets.sharegpt import load_conversations
from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import SamplingParams
from kvserve.entrypoints.model_args import parse_memory
from kvserve.server.engine_loop import Submission

MiB = 1 << 20


def build(kv_memory: int, chunk: int) -> LLMEngine:
    return LLMEngine.load(EngineConfig(kv_memory=kv_memory, max_num_batched_tokens=chunk,
                                       max_num_seqs=8))


def cluster(n: int, kv_memory: int, chunk: int, spread: bool) -> Cluster:
    c = Cluster(GlobalScheduler("least-load"), "colocated", dist_attention=spread,
                heartbeat_timeout_s=120)
    make = functools.partial(build, kv_memory, chunk)
    c.launch([InstanceSpec(f"c{i}", "colocated", make, 1) for i in range(n)])
    return c


def long_prompt(tokenizer, n: int) -> list[int]:
    """n tokens of ShareGPT conversations, one after another."""
    ids: list[int] = []
    for conv in load_conversations(400):
        for _, text in conv.turns:
            ids += tokenizer.encode(text)
            if len(ids) >= n:
                return ids[:n]
    raise SystemExit(f"ShareGPT's first 400 conversations hold fewer than {n} tokens")


async def timed(c: Cluster, prompt: list[int], n: int) -> dict:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    group = await c.add([Submission("long", prompt, None, params)], time.monotonic())
    first = last = None
    async for _, out in group.outputs():
        now = time.perf_counter()
        first = first or now
        last = now
        final = out
    await c.drain()
    ids = final.outputs[0].token_ids
    return {"ttft_s": first - start, "decode_tok_s": (len(ids) - 1) / (last - first),
            "tokens": ids}


def beats(c: Cluster) -> list:
    return asyncio.run(c._poll_all(lambda m: m.handle.poll.remote()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-memory", default="48M", help="X: each instance's pool")
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--decode", type=int, default=32, help="tokens generated")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()
    x = parse_memory(args.kv_memory)
    ray.init(include_dashboard=False, log_to_driver=False)
    out: dict = {"cpu": summary(), "kv_memory_mib": x / MiB, "chunk": args.chunk}

    one = cluster(1, x, args.chunk, spread=False)
    out["one_max_prompt"] = one.max_prompt
    tokenizer = one.engine.tokenizer
    one.shutdown()

    spread = cluster(3, x, args.chunk, spread=True)
    out["spread_max_prompt"] = spread.max_prompt
    prompt = long_prompt(tokenizer, spread.max_prompt - args.decode)
    out["prompt_tokens"] = len(prompt)
    s = asyncio.run(timed(spread, prompt, args.decode))
    hbs = beats(spread)
    lent = sum(hb.lent_out_bytes for hb in hbs)
    out["spread"] = {k: v for k, v in s.items() if k != "tokens"}
    out["lent_mib"] = lent / MiB
    spread.shutdown()

    local = cluster(1, 3 * x, args.chunk, spread=False)
    ref = asyncio.run(timed(local, prompt, args.decode))
    out["local"] = {k: v for k, v in ref.items() if k != "tokens"}
    out["same_tokens"] = ref["tokens"] == s["tokens"]
    local.shutdown()
    # What Infinite-LLM would move: every layer's KV of the lent tokens. Gemma 3's pages
    # hold 3 full-attention layers of 18 (1 in 6), all of the same size per token.
    e = LLMEngine.load(EngineConfig(kv_memory=x, max_num_batched_tokens=args.chunk))
    every = sum(e.kv.layout.page_bytes)
    out["all_layers_mib"] = lent * every / e.kv.full_block_bytes() / MiB
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    ray.shutdown()


if __name__ == "__main__":
    main()
