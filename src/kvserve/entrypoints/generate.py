"""`kvserve generate "prompt"`: stream one completion to stdout."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None,
                   help="GGUF file or HF directory (default: Gemma 3 270M)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--kv-memory", default=None, help="KV pool: bytes (e.g. 1G) or a fraction")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 where the device computes it natively, else float32")


def parse_memory(text: str | None) -> int | float | None:
    """'2G', '512M', '1073741824' -> bytes; '0.3' -> a fraction of free memory."""
    if text is None:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    value = float(t)
    return value if value <= 1 else int(value)


def main(args: argparse.Namespace) -> None:

    from kvserve.engine.engine import EngineConfig, LLMEngine
    from kvserve.engine.request import SamplingParams

    engine = LLMEngine.load(EngineConfig(model=args.model, kv_memory=parse_memory(args.kv_memory),
                                         dtype=args.dtype))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        prompt = {"prompt_token_ids": engine.tokenizer(prompt, add_special_tokens=False).input_ids}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
