"""Start and stop a `kvserve serve` for a benchmark, and read its /metrics counters."""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(options: list[str], port: int, log: Path,
                 command: tuple[str, ...] = ("serve",)) -> subprocess.Popen:
    """`kvserve <command> --port port *options`, once /health answers (at most 300 s)."""
    cmd = [sys.executable, "-m", "kvserve.cli", *command, "--port", str(port),
           "--log-level", "warning", *options]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    raise RuntimeError(f"the server did not come up in 300 s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def served(options: list[str], log: Path,
           command: tuple[str, ...] = ("serve",)) -> Iterator[str]:
    """A `kvserve <command>` on a free port for the block's duration; yields its URL."""
    port = free_port()
    proc = start_server(options, port, log, command)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


def add_multi_turn_arguments(ap: argparse.ArgumentParser, *, sessions: int, rate: float,
                             think_time: float, max_tokens: int, max_prompt_tokens: int,
                             out: str) -> None:
    """The workload options `bench_multi_turn` reads, with a benchmark's defaults."""
    ap.add_argument("--sessions", type=int, default=sessions)
    ap.add_argument("--rate", type=float, default=rate, help="sessions per second (Poisson)")
    ap.add_argument("--think-time", type=float, default=think_time,
                    help="mean seconds (exponential)")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--max-prompt-tokens", type=int, default=max_prompt_tokens)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(out))


def bench_multi_turn(base: str, report: Path, args: argparse.Namespace) -> None:
    """`kvserve bench serve --multi-turn` against base with the script's options
    (sessions, rate, think_time, max_tokens, max_prompt_tokens, seed); JSON to report."""
    subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", base,
         "--dataset", "sharegpt", "--multi-turn", "--num-prompts", str(args.sessions),
         "--request-rate", str(args.rate), "--think-time", str(args.think_time),
         "--max-tokens", str(args.max_tokens), "--max-prompt-tokens",
         str(args.max_prompt_tokens), "--seed", str(args.seed), "--no-progress",
         "--output", str(report)],
        check=True, stdout=subprocess.DEVNULL)


def metrics(base: str) -> dict[str, float]:
    """Every sample of /metrics without labels, counters under their family name."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                out[family.name if sample.name.endswith("_total") else sample.name] = sample.value
    return out
