"""`kvserve generate "prompt"`: stream one completion to stdout."""

from __future__ import annotations

import argparse
import sys

from kvserve.entrypoints.model_args import add_model_arguments, model_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    add_model_arguments(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")


def main(args: argparse.Namespace) -> None:
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.request import SamplingParams

    engine = LLMEngine.load(model_config(args))
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
