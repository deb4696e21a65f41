"""kvserve command line: generate | serve | bench | sim | cluster | demo.

Each sub-command lives in its own module, which provides
`add_arguments(parser)` and `main(args)`; heavy imports happen in `main`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "generate": ("kvserve.entrypoints.generate", "stream a completion for a prompt"),
    "serve": ("kvserve.server.app", "OpenAI-compatible HTTP server"),
    "bench": ("kvserve.bench.cli", "benchmarks against a running server"),
    "sim": ("kvserve.sim.cli", "trace-driven simulator at GPU scale"),
    "cluster": ("kvserve.cluster.cli", "instances on Ray behind one OpenAI server"),
    "demo": ("kvserve.entrypoints.demo", "memory-core demo: requests that fit per policy"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    # Only the chosen command's module is imported: the others pull in the server, the
    # simulator or plotting, seconds of start-up that `kvserve generate` should not pay.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.main)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
