"""What every model family gives the engine: its layers' KV needs and one forward.

The engine never names a family. It reads `CausalLM.kv_layers` (one `KVLayer` per
decoder layer: which memory-core rule its KV follows, its shape, how far back it
looks) to build the memory core's specs and the attention backends' bindings, and
calls `forward` / `compute_logits`. A family is one file under models/ with a config
class (parsed from the HF config or the GGUF metadata) and a `CausalLM` subclass,
plus a line in models/registry.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from kvserve.memory.spec import LayerKind
from kvserve.models.layers import Derived, Linear, RMSNorm, linear
from kvserve.models.quant import Bf16Gemm, QuantLinear, quantize_linears

C = TypeVar("C", bound="ModelConfig")

# The dtype of state layers' states in the pool, whatever the model's: a Mamba state is a
# running sum over the whole sequence, and HF keeps its SSM state in float32 too (its conv
# state in the model's dtype, whose values float32 holds exactly).
STATE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVLayer:
    """One decoder layer as the memory core and the attention backends see it.

    Attention layers (FULL, SLIDING, CHUNKED) keep K and V of `kv_heads` x `head_dim`
    per token; a MAMBA layer keeps one recurrent state per sequence, the `STATE_DTYPE`
    tensors of shapes `state`, reads and writes it through the
    backend's `states` and never calls the attention backend. Its checkpoints (copies of
    the state every `checkpoint_every` tokens, what prefix hits restore) are the memory
    core's; 0 leaves the interval to it.
    """

    kind: LayerKind
    kv_heads: int = 0
    head_dim: int = 0
    scale: float = 1.0  # the softmax scale of q.k
    window: int = 0  # SLIDING: a query at p sees keys > p - window (HF counts p itself)
    chunk: int = 0  # CHUNKED: a query at p sees keys from p // chunk * chunk
    softcap: float | None = None  # scores -> tanh(scores / cap) * cap before the mask
    state: tuple[tuple[int, ...], ...] = ()  # MAMBA: shapes of one sequence's state
    checkpoint_every: int = 0  # MAMBA: tokens between cached checkpoints (0: default)

    @property
    def attends(self) -> bool:
        return self.kind is not LayerKind.MAMBA


@dataclass
class ModelConfig:
    """Fields every family has; a family's config subclasses it with its own."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32_768
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int = 0
    # The family's registry name (models/registry.py): what reloads a converted cache.
    family: str = ""
    # The storage types of the checkpoint's matrices (GGUF: "Q4_K", "Q8_0", ...; empty
    # for float checkpoints): what --quantization auto goes by.
    source_weight_types: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_attention_heads % max(1, self.num_key_value_heads):
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    def kv_layers(self) -> list[KVLayer]:
        """One `KVLayer` per decoder layer: what the engine builds the KV cache from."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any]) -> C:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class StateSeq:
    """One sequence's part of a step in a state (MAMBA) layer.

    Its tokens are rows `rows` of the flattened batch, at positions `start`, `start + 1`, ..
    The state before them is in page `source` (None: the zero state of a fresh sequence).
    `writes` lists (k, pages) in ascending k: the state after the first k of its tokens
    goes into each of those pages. The last entry is k = all its tokens, with the
    sequence's live page; earlier ones (and extra pages at the last k) are checkpoints,
    which must hold the state at exactly that position.
    """

    rows: slice
    start: int
    source: int | None
    writes: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def num_tokens(self) -> int:
        return self.rows.stop - self.rows.start


class AttentionBackend(Protocol):
    """Attention over the flattened batch; owns the KV cache and the layers' states.

    Called once per attention layer with this step's q [num_tokens, n_heads, head_dim]
    and k/v [num_tokens, n_kv_heads, head_dim] (already normed and rotated). It must
    store k/v, attend each query to its own sequence's keys as the model's
    `kv_layers[layer_idx]` says (causal, window, chunk, scale, softcap) and return
    [num_tokens, n_heads, head_dim].

    A state layer (kind MAMBA) instead calls `states(layer_idx)` once per step.
    """

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...

    def states(self, layer_idx: int) -> tuple[Sequence[StateSeq], tuple[torch.Tensor, ...]]:
        """This step's sequences (`StateSeq`, in batch order) and the layer's state
        tensors, one per shape of `KVLayer.state`, each [num_pages, *shape]
        (`STATE_DTYPE`) and indexed by the pages the sequences name. The layer reads
        each sequence's `source` and writes every page of its `writes`."""
        ...


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm under HF's names (`embed_tokens`,
    `layers`, `norm`): the `model` of every family. `norm_offset` 1.0 is Gemma's norm."""

    def __init__(self, config: ModelConfig, layer: Callable[[Any, int], nn.Module],
                 norm_offset: float = 0.0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=norm_offset)

    def pre_norm(self, x: torch.Tensor, step: Any, attn: AttentionBackend) -> torch.Tensor:
        """Run pre-norm layers `layer(x, h, step, attn, next_norm) -> (x, h)`, each handing
        the next its normed input (fused into its residual add): x -> final hidden."""
        layers = self.layers
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            x, h = layer(x, h, step, attn, nxt)
        return h


class CausalLM(nn.Module):
    """A decoder over a flattened varlen batch: `model.embed_tokens`, `model.layers`,
    `model.norm` and an optional untied `lm_head`, with HF's parameter names.

    `forward` returns final hidden states; `compute_logits` runs on the rows a caller
    needs (the last token of each sequence), so prefill never makes [tokens, vocab].
    """

    config: ModelConfig
    kv_layers: list[KVLayer]
    final_logit_softcapping: float | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.kv_layers = config.kv_layers()
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size))
        self._packed_head = Derived(Bf16Gemm)  # the tied head has no Linear of its own
        self.quant_head: QuantLinear | None = None
        self.quantization = "none"

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] (optional final softcapping)."""
        if self.quant_head is not None:
            logits = self.quant_head(hidden)
        elif self.lm_head is None:
            logits = linear(hidden, self.model.embed_tokens.weight, self._packed_head)
        else:
            logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def quantize(self, mode: str) -> int:
        """Serve every linear (and the head) from fp16 / int8 / Q8_0 copies (models/quant.py);
        the float weights of the linears are dropped, the tied embedding stays for token
        lookups. Returns the bytes the copies hold."""
        if mode == "none":
            return 0
        tied = [self.model.embed_tokens.weight] if self.lm_head is None else []
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        held, head = quantize_linears(linears, mode, tied, head=self.lm_head)
        self.quant_head = head[0] if head else None
        self.quantization = mode
        return held

    def pending_bytes(self) -> int:
        """Memory the packed linears will still take at their first large step (q8+fp16's
        fp16 copies), with room for the largest one's float32 dequantized weight while it is
        packed: what a KV pool sized from the memory free now must leave."""
        quants = [m.quant for m in self.modules() if getattr(m, "quant", None) is not None]
        pending = [q.pending_bytes() for q in [*quants, self.quant_head]
                   if hasattr(q, "pending_bytes")]
        return sum(pending) + 2 * max(pending, default=0)

    def adapt_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF-named weights -> this model's (a family fuses projections here)."""
        return dict(state_dict)

    @classmethod
    def from_state_dict(
        cls,
        config: ModelConfig,
        state_dict: Mapping[str, torch.Tensor],
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> CausalLM:
        """Build on the meta device and adopt the given tensors (no random init, no copy
        twice)."""
        with torch.device("meta"), _no_init():
            model = cls(config)
        model.load_state_dict(model.adapt_state_dict(state_dict), strict=True, assign=True)
        return model.to(device=device, dtype=dtype).eval()


_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
          "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_")


@contextmanager
def _no_init() -> Iterator[None]:
    """Skip the modules' random initialisation while they are built on the meta device.

    Every parameter is then replaced from the state dict (strict), so the values never
    matter, but on meta tensors torch routes random init through torch._refs, whose first
    call imports torch._dynamo: 2 s of a 10 s warm start. (transformers' no_init_weights
    does the same.)"""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, _keep)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor
