"""Warm start-up: seconds from the command to the first token, to the exit, to /health.

    python benchmarks/startup.py [--runs 6] [--other-src /path/to/other/checkout/src]
        [--serve] [--parts]

Each run starts `python -m kvserve.cli generate --max-tokens 4 "Hello there"` and times
the first byte on its stdout and its exit; with --other-src, each run is a pair, that
checkout's code (put first on PYTHONPATH) then this one's, so that a noisy machine slows
both alike. --serve also times `kvserve serve` until GET /health answers and one
completion is done. --parts times the pieces of a warm start one by one, each in a fresh
process, --runs times: `import torch` and the process's end after it; the cached
tokenizer's parse with its merges as strings and as pairs; the packed file's CRC alone and
beside the parse (started first, as the loader does); the Gemma package's `assemble()`
(it hashes the GGUF). Prints the CPU it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

from kvserve.cpu_features import summary

GENERATE = [sys.executable, "-m", "kvserve.cli", "generate", "--max-tokens", "4", "Hello there"]


def generate(src: str | None) -> tuple[float, float]:
    """(first token, exit) in seconds for one `kvserve generate`."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.Popen(GENERATE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=env)
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait():
        raise RuntimeError(f"kvserve generate exited with {proc.returncode}")
    return first, time.perf_counter() - start


def serve(port: int = 8123) -> tuple[float, float]:
    """(GET /health answers, first completion done) in seconds for one `kvserve serve`."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError("kvserve serve exited before answering") from None
                time.sleep(0.05)
        health = time.perf_counter() - start
        body = json.dumps({"prompt": "Hello there", "max_tokens": 4}).encode()
        urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body,
            headers={"Content-Type": "application/json"})).read()
        return health, time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait()


# Each piece in a fresh process (what a start pays), printing seconds as JSON.
PARTS = {
    "import torch": "import time; t = time.perf_counter(); import torch; "
                    "print(time.perf_counter() - t)",
    "tokenizer (merges as strings)": "from benchmarks_startup_parts import parse; parse(False)",
    "tokenizer (merges as pairs)": "from benchmarks_startup_parts import parse; parse(True)",
    "packed CRC alone": "from benchmarks_startup_parts import crc; crc(False)",
    "packed CRC beside the parse": "from benchmarks_startup_parts import crc; crc(True)",
    "assemble() (hashes the GGUF)": "from benchmarks_startup_parts import assemble; assemble()",
}


def parts(runs: int) -> None:
    """Each of PARTS `runs` times, interleaved; then a whole `import torch` process against
    one that ends with os._exit (the interpreter's teardown)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")]))}
    got: dict[str, list[float]] = {name: [] for name in PARTS}
    for _ in range(runs):
        for name, code in PARTS.items():
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, check=True).stdout
            got[name].append(float(out.split()[-1]))
    for name, times in got.items():
        print(f"{name}: {min(times):.2f}-{max(times):.2f} s")
    for end in ("", "import os, sys; sys.stdout.flush(); os._exit(0)"):
        walls = []
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", f"import torch; {end}"], check=True)
            walls.append(time.perf_counter() - start)
        print(f"python -c 'import torch{'; os._exit(0)' if end else ''}': "
              f"{min(walls):.2f}-{max(walls):.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--other-src", help="another checkout's src/, run first in each pair")
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--parts", action="store_true", help="the pieces instead (see above)")
    args = ap.parse_args()
    print(f"cpu: {summary()}")
    if args.parts:
        generate(None)  # the cache entry and packed file exist
        parts(args.runs)
        return
    generate(None)  # a first start may convert or pack: not a warm one
    names = (["other"] if args.other_src else []) + ["this"]
    runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for _ in range(args.runs):
        for name in names:
            runs[name].append(generate(args.other_src if name == "other" else None))
    for name, got in runs.items():
        firsts = [f for f, _ in got]
        print(f"{name}: first token {', '.join(f'{f:.2f}' for f in firsts)} s "
              f"(median {statistics.median(firsts):.2f}); exit "
              f"{min(e for _, e in got):.2f}-{max(e for _, e in got):.2f} s")
    if args.serve:
        for _ in range(min(args.runs, 3)):
            health, done = serve()
            print(f"serve: /health after {health:.2f} s, first completion done {done:.2f} s")


if __name__ == "__main__":
    main()
