"""A quantized model saved as served: a warm start maps it instead of quantizing again.

Serving a q8 mode (q8, q8+fp16, q8+bf16 or q8+int8) from a converted GGUF (models/loader.py)
means building the float32 model (fusing q/k/v and gate/up: ~1 s of copying on 2 cores),
rounding every linear to Q8_0 blocks (for q8+int8 twice, in two layouts), and for q8+bf16
casting the model and every weight to bf16 (~3.5 s in all for Gemma 3 270M; q8+fp16 saves
q8's blocks and makes its fp16 copies from them at the first larger step). All of it is a
function of the converted weights, the mode, the dtype and the Q8_0 layout, so the first
start writes the result next to the converted weights,
`packed-<mode>-<dtype>-v<format>.safetensors`, and later starts map that file: the packed
blocks, the bf16 weights (the GEMM's own layout, AMX tiles or oneDNN's
blocking, is made from them on first use, see quant.Q8Bf16Linear) and every other
parameter already in the serving dtype.

The file is trusted only if everything it was made from still holds: this format, the
kernels' `CpuKernels.Q8_LAYOUT`, the mode, the dtype, the float weights' size and mtime,
the tensor names, shapes and dtypes the model expects, the file's size and a CRC-32 of
its tensor bytes (~0.3-0.4 s per GB: one zlib call over the mapped file, unmapped
after, which a start runs beside the tokenizer's parse). Anything else, a truncated or
corrupted file included, is removed and the model quantized again; a cache that cannot
be written (a full disk, a read-only directory) only costs the next start the same work.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import tempfile
import threading
import warnings
import zlib
from collections.abc import Callable, Container, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvserve.kernels.cpu import CpuKernels
from kvserve.models.base import CausalLM, ModelConfig, _no_init
from kvserve.models.layers import Linear
from kvserve.models.quant import from_packed, layer_mode, serves_i8_head, serves_q5

FORMAT = 2  # bump when what the file holds changes (2: the CRC in file order)
MODES = ("q8", "q8+fp16", "q8+bf16", "q8+int8")
HEAD = "tied_head"  # the key prefix of a tied embedding's packed head
# The header's CRC is written once the data is (the file's order of the tensors is
# safetensors'): a fixed-width placeholder, overwritten in place, so that nothing moves.
_CRC_KEY, _CRC_DIGITS = b'"crc32":"', 10
_CRC_CHUNK = 8 << 20  # bytes read at a time for the check
_PARTS = ("q", "d", "q5", "d5", "bf16", "i8q", "i8d")  # what a packed layer's packed_state holds

Spec = tuple[tuple[int, ...], torch.dtype]
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I8": torch.int8, "U8": torch.uint8,
              "F16": torch.float16, "I64": torch.int64, "I32": torch.int32}


def packed_file(entry: Path, mode: str, dtype: torch.dtype) -> Path:
    """Where a model's packed form for this mode and dtype lives in its cache entry."""
    # The layout is checked inside the file, not named by it: a file of an older layout is
    # replaced where it lies rather than left behind beside the new one.
    name = str(dtype).removeprefix("torch.")
    return entry / f"packed-{mode.replace('+', '-')}-{name}-v{FORMAT}.safetensors"


def packed_state(model: CausalLM) -> dict[str, torch.Tensor]:
    """Everything a quantized model serves from: its remaining parameters as they are,
    and each linear's packed parts under `<module>.<part>` (the tied head under HEAD)."""
    state = {k: v for k, v in model.state_dict().items() if not v.is_meta}
    for name, module in _linears(model):
        state.update({f"{name}.{k}": v for k, v in module.quant.packed_state().items()})
    if model.lm_head is None and model.quant_head is not None:
        state.update({f"{HEAD}.{k}": v for k, v in model.quant_head.packed_state().items()})
    if _head_is_embedding(model, model.quantization, model.dtype):
        head = state.pop(f"{HEAD}.bf16")
        if not torch.equal(head, state["model.embed_tokens.weight"]):
            raise RuntimeError("the tied head's bf16 copy differs from the embedding")
    return state


def _head_is_embedding(model: CausalLM, mode: str, dtype: torch.dtype) -> bool:
    """Whether q8+bf16's bf16 head is the embedding table itself (a tied head in a bf16
    model): saved once, 335 MB less for Gemma 3 270M, and mapped once when loaded."""
    vocab = model.model.embed_tokens.weight.shape[0]
    return (model.lm_head is None and dtype == torch.bfloat16
            and layer_mode(mode, vocab, head=True) == "q8+bf16")


def save(model: CausalLM, path: Path, source: Path) -> bool:
    """Write the model's packed form to path (atomically); False, with a warning, where it
    cannot be written."""
    state = {k: v.contiguous() for k, v in packed_state(model).items()}
    meta = _metadata(model.quantization, model.dtype, source)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        save_file(state, tmp, metadata={**meta, "crc32": "?" * _CRC_DIGITS})
        _stamp_crc(Path(tmp), state)
        # safetensors does not report a failed write (a full disk leaves a short file):
        # check the file as a start will before putting it in place.
        problem = _problem(Path(tmp), partial(_expected, model, model.quantization, model.dtype),
                           meta)
        if problem is not None:
            raise OSError(errno.EIO, f"the written file is {problem}")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is an ordinary user dir
        os.replace(tmp, path)
        return True
    except OSError as err:
        warnings.warn(f"kvserve: could not save the packed model ({err}); the next start "
                      "quantizes again", stacklevel=2)
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def load(model_cls: type[CausalLM], config: ModelConfig, path: Path, mode: str,
         dtype: torch.dtype, source: Path, crc: Future[int] | None = None) -> CausalLM | None:
    """The model from its packed form at path, or None (the file removed if it was there
    but not valid) when it must be quantized again. crc: data_crc_soon(path), where the
    caller started it."""
    if mode not in MODES or not path.is_file():
        return None
    with torch.device("meta"), _no_init():
        model = model_cls(config)
    try:
        problem = _problem(path, partial(_expected, model, mode, dtype),
                           _metadata(mode, dtype, source), crc)
        tensors = load_file(path) if problem is None else None
    except (OSError, ValueError, KeyError, TypeError, struct.error, SafetensorError) as err:
        problem, tensors = f"unreadable ({err!r})", None
    if tensors is None:
        warnings.warn(f"kvserve: {path.name}: {problem}; quantizing again", stacklevel=2)
        with suppress(OSError):  # a read-only cache keeps it; the save will fail too
            path.unlink()
        return None
    return _adopt(model, tensors, mode)


# ------------------------------------------------------------------------------ model


def _linears(model: CausalLM) -> list[tuple[str, Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]


def _part_specs(mode: str, out_features: int, in_features: int, q5: bool,
                head: bool = False) -> dict[str, Spec]:
    mode = layer_mode(mode, out_features, head)
    groups = -(-in_features // CpuKernels.Q8_GROUP)
    kp = groups * CpuKernels.Q8_GROUP
    if q5:  # a weight the file shipped as Q5_0, kept in its own blocks (quant.Q5Linear)
        specs = {"q5": ((out_features, groups * CpuKernels.Q5_GROUP_BYTES), torch.uint8),
                 "d5": ((out_features, groups * 4), torch.float16)}
    else:
        specs = {"q": ((out_features, kp), torch.int8),
                 "d": ((out_features, kp // 32), torch.float32)}
    if mode == "q8+bf16":
        specs["bf16"] = ((out_features, in_features), torch.bfloat16)
    if mode == "q8+int8":
        specs["i8q"] = ((out_features, in_features), torch.uint8)
        specs["i8d"] = ((out_features, in_features // 32), torch.float32)
    return specs


def _q5_owners(names: Iterable[str]) -> set[str]:
    """The layers whose few-row copy is Q5_0, from the tensor names of a packed form."""
    return {n.removesuffix(".q5") for n in names if n.endswith(".q5")}


def _expected(model: CausalLM, mode: str, dtype: torch.dtype,
              q5: Container[str]) -> dict[str, Spec]:
    """Name -> (shape, dtype) of every tensor the packed form of this (meta) model holds,
    the layers in q5 keeping Q5_0 blocks (which ones is read from the file; whether this
    CPU serves Q5_0 at all is in its metadata)."""
    linears = _linears(model)
    dropped = {f"{name}.weight" for name, _ in linears}
    out = {k: (tuple(v.shape), dtype if v.is_floating_point() else v.dtype)
           for k, v in model.state_dict().items() if k not in dropped}
    for name, m in linears:
        out.update({f"{name}.{k}": s for k, s in _part_specs(
            mode, m.out_features, m.in_features, name in q5, m is model.lm_head).items()})
    if model.lm_head is None:
        vocab, hidden = model.model.embed_tokens.weight.shape
        head = _part_specs(mode, vocab, hidden, HEAD in q5, head=True)
        if _head_is_embedding(model, mode, dtype):
            del head["bf16"]
        out.update({f"{HEAD}.{k}": s for k, s in head.items()})
    return out


def _adopt(model: CausalLM, tensors: dict[str, torch.Tensor], mode: str) -> CausalLM:
    """Give the meta-built model the loaded tensors: its parameters, and each linear its
    packed layer (the float weight stays a meta tensor, as quantize leaves it)."""
    linears = _linears(model)
    owners = [name for name, _ in linears] + [HEAD]
    packed = {f"{o}.{p}" for o in owners for p in _PARTS}

    def parts(owner: str) -> dict[str, torch.Tensor]:
        return {p: tensors[f"{owner}.{p}"] for p in _PARTS if f"{owner}.{p}" in tensors}

    model.load_state_dict({k: v for k, v in tensors.items() if k not in packed},
                          strict=False, assign=True)
    for name, m in linears:
        m.quant = from_packed(mode, parts(name), m.in_features)
    if model.lm_head is None:
        head = parts(HEAD)
        if _head_is_embedding(model, mode, model.model.embed_tokens.weight.dtype):
            head["bf16"] = model.model.embed_tokens.weight.detach()
        model.quant_head = from_packed(mode, head, model.config.hidden_size)
    model.quantization = mode
    return model.eval()


# ------------------------------------------------------------------------------ file


def _metadata(mode: str, dtype: torch.dtype, source: Path) -> dict[str, str]:
    st = source.stat()
    return {"kvserve_packed": str(FORMAT), "q8_layout": str(CpuKernels.Q8_LAYOUT),
            "mode": mode, "dtype": str(dtype), "source": f"{st.st_size}:{st.st_mtime_ns}",
            "q5": str(int(serves_q5())),
            # the rule for this CPU and mode, asked of a width the int8 kernel always takes
            "i8_head": str(int(serves_i8_head(mode, CpuKernels.I8_LANES)))}


def _problem(path: Path, expected: Callable[[set[str]], Mapping[str, Spec]],
             meta: Mapping[str, str], crc: Future[int] | None = None) -> str | None:
    """Why the file at path is not the packed form expected (`expected` of the layers the
    file keeps in Q5_0), or None if it is. crc: the file's data_crc_soon, if started."""
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        if size > 1 << 28:
            return "header size out of range"
        header = json.loads(fh.read(size))
        data_start = 8 + size
        got = header.pop("__metadata__", {}) or {}
        stale = [k for k, v in meta.items() if got.get(k) != v]
        if stale:
            return f"made for another {', '.join(stale)}"
        expect = expected(_q5_owners(header))
        if set(header) != set(expect):
            return "holds other tensors than the model has"
        for name, (shape, dtype) in expect.items():
            entry = header[name]
            if tuple(entry["shape"]) != shape or _ST_DTYPES.get(entry["dtype"]) != dtype:
                return f"{name} has another shape or dtype"
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if os.fstat(fh.fileno()).st_size != data_start + end:
            return "truncated or padded"
    if (crc.result() if crc else _data_crc(path)) != int(got.get("crc32", "-1")):
        return "corrupted (CRC-32 mismatch)"
    return None


def data_crc_soon(path: Path) -> Future[int]:
    """The CRC-32 of the file's tensor data, computed on another thread; returns once
    that thread is about to enter its one zlib call, which releases the GIL for its whole
    length. Why: a start runs it on one core while the tokenizer's parse, which holds the
    GIL for ~1 s, runs on the other; started after that parse, it would wait for it."""
    started = threading.Event()
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-crc")
    crc = pool.submit(_data_crc, path, started)
    pool.shutdown(wait=False)
    started.wait()
    return crc


def _data_crc(path: Path, started: threading.Event | None = None) -> int:
    """The CRC-32 of the bytes after a safetensors file's header, in file order. Read in
    chunks into one buffer, not mapped: a mapping's pages count in the process's resident
    set while it lives (a warm `kvserve generate` peaked at 1.38 GB with the 813 MB file
    mapped, against what it holds after loading, 0.39 GB). The reads and zlib both release
    the GIL."""
    try:
        with open(path, "rb", buffering=0) as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            fh.seek(8 + size)
            if started is not None:
                started.set()
            crc, buf = 0, bytearray(_CRC_CHUNK)
            with memoryview(buf) as view:
                while n := fh.readinto(buf):
                    crc = zlib.crc32(view[:n], crc)
            return crc
    finally:
        if started is not None:
            started.set()  # also where the file could not be opened


def _stamp_crc(path: Path, state: Mapping[str, torch.Tensor]) -> None:
    """Write over the header's placeholder the CRC of the tensors as they are in memory,
    in the file's order: the check that follows reads the file back against it, so a
    write that went wrong is caught before the file is put in place."""
    with open(path, "r+b") as fh:
        try:
            (size,) = struct.unpack("<Q", fh.read(8))
            raw = fh.read(size)
            header = {k: v for k, v in json.loads(raw).items() if k != "__metadata__"}
        except (struct.error, ValueError) as err:
            raise OSError(errno.EIO, f"the written header is unreadable ({err})") from err
        crc = 0
        for name in sorted(header, key=lambda n: header[n]["data_offsets"][0]):
            crc = zlib.crc32(state[name].reshape(-1).view(torch.uint8).numpy(), crc)
        at = raw.find(_CRC_KEY + b"?" * _CRC_DIGITS)
        if at < 0:
            raise OSError(errno.EIO, "the written header has no CRC placeholder")
        fh.seek(8 + at + len(_CRC_KEY))
        fh.write(f"{crc:0{_CRC_DIGITS}d}".encode())
