"""Model runner: turns a scheduled batch into one forward pass over the KV cache.

The KV data lives in the paged byte pool ("paged") or in per-request virtual
tensors ("vtensor", `models/virtual_attention.py`); the memory core schedules,
admits and finds prefix hits for both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.scheduler import Lender, Scheduled
from kvserve.memory import KVCacheManager, KVSpec, LayerKind
from kvserve.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from kvserve.models.paged_attention import LayerBinding, PagedAttention, SeqStep
from kvserve.models.virtual_attention import VirtualAttention, VirtualSeq
from kvserve.physical.pool import AttentionShape, KVPool


def attention_specs(
    config: Gemma3Config, dtype: torch.dtype, full_history: bool = False
) -> tuple[list[KVSpec], list[LayerBinding], AttentionShape]:
    """The model's KV specs (one per layer type) and where each layer lives in them.

    With `full_history` (the vtensor backend, which keeps every layer's whole
    history) every layer is accounted as full attention; bindings keep their
    windows, which attention still applies.
    """
    shape = AttentionShape(config.num_key_value_heads, config.head_dim, dtype)
    bindings, counts = [], {"full": 0, "sliding": 0}
    for i in range(config.num_hidden_layers):
        name = "sliding" if config.is_sliding(i) and not full_history else "full"
        window = config.sliding_window if config.is_sliding(i) else 0
        bindings.append(LayerBinding(name, counts[name], window))
        counts[name] += 1
    bpt = shape.bytes_per_token()
    specs = []
    if counts["full"]:
        specs.append(KVSpec("full", LayerKind.FULL, counts["full"], bpt))
    if counts["sliding"]:
        # HF's window counts the query itself; as the memory core's W it keeps
        # one token more than needed, which is safe.
        specs.append(KVSpec("sliding", LayerKind.SLIDING, counts["sliding"], bpt,
                            window=config.sliding_window))
    return specs, bindings, shape


KV_BACKENDS = ("paged", "vtensor")


def check_kv_backend(name: str) -> str:
    if name not in KV_BACKENDS:
        raise ValueError(f"unknown kv_backend {name!r}; choose from {', '.join(KV_BACKENDS)}")
    return name


class ModelRunner:
    def __init__(
        self, model: Gemma3ForCausalLM, kv: KVCacheManager, bindings: Sequence[LayerBinding],
        shape: AttentionShape, kv_backend: str = "paged", kv_bytes: int | None = None,
    ) -> None:
        """`kv_bytes`: the vtensor pool's physical ceiling (default: the memory core's pool)."""
        self.model = model
        self.kv = kv
        self.lender: Lender | None = None  # DistAttention's debtor side, in a cluster
        self.kv_backend = check_kv_backend(kv_backend)
        self.attn: PagedAttention | VirtualAttention
        if kv_backend == "vtensor":
            if model.device.type != "cpu":
                raise ValueError("kv_backend 'vtensor' runs on CPU only for now")
            self.pool = None
            windows = [b.window for b in bindings]
            self.attn = VirtualAttention(
                windows, shape, model.config.attn_scale, kv_bytes or kv.pool_bytes, kv.T)
        else:
            shapes = {spec.name: shape for spec in kv.layout.specs}
            self.pool = KVPool(kv.layout, kv.num_large_pages, shapes, model.device)
            self.attn = PagedAttention(self.pool, bindings, model.config.attn_scale, kv.T)

    @torch.inference_mode()
    def execute(self, batch: Sequence[Scheduled]) -> torch.Tensor:
        """Run the batch; logits [n, vocab] for the entries that complete their tokens."""
        if isinstance(self.attn, VirtualAttention):
            seqs = [VirtualSeq(s.request.request_id, s.request.token_ids, s.start, s.num_tokens,
                               s.request.num_prompt + s.request.params.max_tokens)
                    for s in batch]
            positions = self.attn.prepare(seqs)  # may widen a step: ids follow it
            steps = [(s.start, s.num_new) for s in seqs]
        else:
            steps = [(s.start, s.num_tokens) for s in batch]
            positions = self.attn.prepare([self._seq_step(s) for s in batch])
        ids = [t for s, (start, n) in zip(batch, steps)
               for t in s.request.token_ids[start:start + n]]
        hidden = self.model(torch.tensor(ids, device=self.model.device),
                            positions.to(self.model.device), self.attn)
        if isinstance(self.attn, VirtualAttention):
            self.attn.commit()
        ends, rows = 0, []
        for s, (_, n) in zip(batch, steps):
            ends += n
            if s.completes_prompt:
                rows.append(ends - 1)
        return self.model.compute_logits(hidden[rows])

    def _seq_step(self, s: Scheduled) -> SeqStep:
        rid = s.request.request_id
        lent = self.kv.lent(rid)  # DistAttention: leading full-attention KV lent out
        remote = self.lender.remote(rid) if lent else None
        return SeqStep(s.start, s.num_tokens, self.kv.block_tables(rid), lent, remote)

    def retain(self, running: Sequence[object]) -> None:
        """The scheduler's running requests after a schedule: vTensors of the rest go."""
        if isinstance(self.attn, VirtualAttention):
            self.attn.retain(r.request_id for r in running)  # type: ignore[attr-defined]

    @property
    def releases_memory(self) -> bool:
        """Whether `trim` can give memory back: the paged pool is allocated once."""
        return isinstance(self.attn, VirtualAttention)

    def vtensor_stats(self) -> dict[str, int] | None:
        """The vTensor memory (`VirtualAttention.stats`), or None under the paged pool."""
        return self.attn.stats() if isinstance(self.attn, VirtualAttention) else None

    def trim(self, idle_s: float) -> int:
        """Give back KV memory unused for `idle_s` seconds; returns the bytes punched."""
        if isinstance(self.attn, VirtualAttention):
            return self.attn.trim(idle_s)
        return 0

    def release(self, request_id: str) -> None:
        """A request finished or was aborted: its vTensors go (the paged pool needs nothing)."""
        if isinstance(self.attn, VirtualAttention):
            self.attn.release(request_id)
