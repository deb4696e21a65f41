"""The model and memory options `kvserve serve` and `kvserve generate` share."""

from __future__ import annotations

import argparse
from typing import Any


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file, HF directory, or a packaged model by name: gemma3-270m "
                        "(the default), smollm2")
    p.add_argument("--kv-memory", default=None,
                   help="KV pool: bytes ('2G', '512M') or a fraction of free memory ('0.3'); "
                        "under --kv-backend vtensor a ceiling, taken as used and given back")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 where the device computes it natively, else float32")
    p.add_argument("--quantization", default="auto",
                   # = quant.QUANTIZATIONS, written out: parsing arguments imports no torch
                   choices=["auto", "none", "q8", "q8+fp16", "q8+bf16", "q8+int8", "fp16",
                            "int8"],
                   help="weights: auto keeps roughly what the file ships for a quantized "
                        "GGUF on a CPU (q8+bf16 where bf16 runs natively: Q8_0 for "
                        "decode, bf16 for batches; else q8+fp16: Q8_0, and fp16 for "
                        "the batches this CPU runs faster so); q8 keeps Q8_0 alone; "
                        "q8+int8 (on request) int8 blocks for batches: faster, "
                        "a little less exact; none serves them in --dtype")
    p.add_argument("--kv-backend", default="paged", choices=["paged", "vtensor"],
                   help="where KV data lives: paged (one pool of pages, paged attention) or "
                        "vtensor (per-request contiguous virtual tensors, plain SDPA; CPU)")
    p.add_argument("--host-kv-memory", default=None, metavar="BYTES",
                   help="host tier: bytes of host memory ('8G') keeping cached prefixes the KV "
                        "pool evicts; a later hit loads them back instead of recomputing")
    p.add_argument("--host-kv-file", default=None, metavar="PATH",
                   help="back the host tier with a new file at PATH, so it may exceed RAM")
    p.add_argument("--cost-profile", default=None, metavar="JSON",
                   help="host tier: a saved exec(x, y) profile (benchmarks/cost_model.py "
                        "--save); loads only what beats recomputing (MemServe Eq. 2)")
    p.add_argument("--kv-idle-release-s", type=idle_seconds, default=None, metavar="SECONDS",
                   help="KV memory (cached prefixes, free pages) unused this long goes back "
                        "to the OS (CPU); 'inf' never, 0 as soon as no request holds it "
                        "(default 60: above a chat user's think time, so a next turn still "
                        "hits its prefix)")


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


def idle_seconds(text: str) -> float:
    """--kv-idle-release-s: seconds >= 0, or 'inf'; anything else is an argparse error."""
    from kvserve.engine.engine import check_idle_release

    try:
        return check_idle_release(float(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def model_config(args: argparse.Namespace, **engine_args: Any) -> Any:
    """EngineConfig from the shared options plus a command's own settings."""
    from kvserve.engine.engine import EngineConfig

    idle = getattr(args, "kv_idle_release_s", None)
    if idle is not None:
        engine_args.setdefault("kv_idle_release_s", idle)
    host = parse_memory(getattr(args, "host_kv_memory", None))
    if isinstance(host, float):
        raise ValueError("--host-kv-memory takes bytes ('8G'), not a fraction")
    engine_args.setdefault("host_kv_memory", host or 0)
    engine_args.setdefault("host_kv_file", getattr(args, "host_kv_file", None))
    engine_args.setdefault("cost_profile", getattr(args, "cost_profile", None))
    return EngineConfig(model=args.model, kv_memory=parse_memory(args.kv_memory),
                        dtype=args.dtype, quantization=args.quantization,
                        kv_backend=getattr(args, "kv_backend", "paged"), **engine_args)
