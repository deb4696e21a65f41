"""kvserve command line: generate | serve | bench | sim | cluster | demo.

Each sub-command lives in its own module, which provides
`add_arguments(parser)` and `main(args)`; heavy imports happen in `main`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "generate": ("kvserve.entrypoints.generate", "stream a completion for a prompt"),
    "serve": ("kvserve.server.app", "OpenAI-compatible HTTP server"),
    "bench": ("kvserve.bench.cli", "benchmarks against a running server"),
    "sim": ("kvserve.sim.cli", "trace-driven simulator at GPU scale"),
    "cluster": ("kvserve.cluster.cli", "instances on Ray behind one OpenAI server"),
    "demo": ("kvserve.entrypoints.demo", "memory-core demo: requests that fit per policy"),
}


# Commands that leave nothing to clean up: the console script ends their process without
# the interpreter's teardown, which took 0.4-0.7 s of `kvserve generate` with the engine
# loaded on the 2-core VMs (docs/benchmarks.md, Start-up).
QUICK_EXIT = {"generate"}


def _command(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    # Only the chosen command's module is imported: the others pull in the server, the
    # simulator or plotting, seconds of start-up that `kvserve generate` should not pay.
    chosen = _command(argv)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.main)
    args = ap.parse_args(argv)
    args.func(args)


def run() -> None:
    """The `kvserve` console script: main, then for QUICK_EXIT commands an exit as soon as
    their output is flushed."""
    main()
    if _command(sys.argv[1:]) in QUICK_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    run()
