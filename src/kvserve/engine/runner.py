"""Model runner: turns a scheduled batch into one forward pass over the KV cache.

The KV data lives in the paged byte pool ("paged") or in per-request virtual
tensors ("vtensor", `models/virtual_attention.py`); the memory core schedules,
admits and finds prefix hits for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from kvserve.engine.scheduler import Lender, Scheduled
from kvserve.memory import KVCacheManager, KVSpec, LayerKind
from kvserve.models.base import STATE_DTYPE, CausalLM, KVLayer
from kvserve.models.dist_attention import RemoteKVLost
from kvserve.models.paged_attention import LayerBinding, PagedAttention, SeqStep
from kvserve.models.virtual_attention import VirtualAttention, VirtualSeq
from kvserve.physical.pool import AttentionShape, KVPool, StateShape

Shapes = dict[str, AttentionShape | StateShape]


def kv_specs(
    layers: Sequence[KVLayer], dtype: torch.dtype, full_history: bool = False
) -> tuple[list[KVSpec], list[LayerBinding], Shapes]:
    """The memory core's specs for a model's layers, where each layer lives in them, and
    each spec's per-layer shape (KV of attention specs, the state of state specs).

    Layers that share a rule and a shape share a spec (Jenga: one page holds a token of
    every layer of its spec, or one sequence's state of every layer of a state spec),
    named after the rule; a second spec of one kind (another window or head size) gets a
    numbered name. With `full_history` (the vtensor backend, whose prefix trees keep every
    layer's whole history) attention layers are accounted as full attention; their bindings keep
    their windows, which attention still applies.
    """
    specs: dict[tuple, KVSpec] = {}
    bindings, counts, shapes = [], {}, {}
    for layer in layers:
        kind = LayerKind.FULL if full_history and layer.attends else layer.kind
        key = (kind, layer.window if kind is LayerKind.SLIDING else 0,
               layer.chunk if kind is LayerKind.CHUNKED else 0,
               layer.kv_heads, layer.head_dim, layer.state, layer.checkpoint_every)
        if key not in specs:
            n = sum(1 for k in specs if k[0] is kind)
            every = {"checkpoint_every": layer.checkpoint_every} if layer.checkpoint_every else {}
            specs[key] = KVSpec(kind.value if n == 0 else f"{kind.value}-{n + 1}", kind, 1, 1,
                                window=key[1], chunk=key[2], **every)
        name = specs[key].name
        counts[name] = counts.get(name, 0) + 1
        bindings.append(LayerBinding(name, counts[name] - 1, layer.window, layer.chunk,
                                     layer.scale, layer.softcap))
        if layer.attends:
            shapes[name] = AttentionShape(layer.kv_heads, layer.head_dim, dtype)
        else:
            shapes[name] = StateShape(layer.state, STATE_DTYPE)
    out = []
    for spec in specs.values():
        shape = shapes[spec.name]
        per_token = (shape.bytes_per_token() if isinstance(shape, AttentionShape)
                     else shape.bytes())
        out.append(replace(spec, num_layers=counts[spec.name], bytes_per_token=per_token))
    return out, bindings, shapes


KV_BACKENDS = ("paged", "vtensor")


def check_kv_backend(name: str) -> str:
    if name not in KV_BACKENDS:
        raise ValueError(f"unknown kv_backend {name!r}; choose from {', '.join(KV_BACKENDS)}")
    return name


def vtensor_shape(shapes: Shapes, bindings: Sequence[LayerBinding]) -> AttentionShape:
    """The one KV shape the vtensor backend serves; it refuses what it cannot (yet) run."""
    if any(isinstance(s, StateShape) for s in shapes.values()):
        raise ValueError("kv_backend 'vtensor' keeps attention KV only, not the recurrent "
                         "state of Mamba layers; use kv_backend 'paged'")
    if len(set(shapes.values())) != 1 or len(shapes) != len({b.spec for b in bindings}):
        raise ValueError("kv_backend 'vtensor' serves attention-only models with one KV shape; "
                         "use kv_backend 'paged'")
    if any(b.softcap or b.scale != bindings[0].scale for b in bindings):
        raise ValueError("kv_backend 'vtensor' has no softcapping or per-layer scales; "
                         "use kv_backend 'paged'")
    return next(iter(shapes.values()))


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv: KVCacheManager, bindings: Sequence[LayerBinding],
        shapes: Shapes, kv_backend: str = "paged",
        kv_bytes: int | None = None,
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
            self.attn = VirtualAttention(
                [b.window for b in bindings], vtensor_shape(shapes, bindings),
                bindings[0].scale, kv_bytes or kv.pool_bytes, kv.T,
                attention_chunks=[b.chunk for b in bindings])
        else:
            self.pool = KVPool(kv.layout, kv.num_large_pages, shapes, model.device)
            self.attn = PagedAttention(self.pool, bindings, kv.T)
        # State specs (Mamba): each step hands their layers the memory core's pending
        # snapshots and restores (`KVCacheManager.pending_copies`) with the page tables.
        self._state_specs = [name for name, s in shapes.items() if isinstance(s, StateShape)]

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
        # A spread request's creditor may be lost midway: the step then runs again, and
        # states updated in place must be as before it.
        undo = (self.attn.save_states() if isinstance(self.attn, PagedAttention)
                and self.attn.spread and self._state_specs else None)
        try:
            hidden = self.model(torch.tensor(ids, device=self.model.device),
                                positions.to(self.model.device), self.attn)
        except RemoteKVLost:
            if undo is not None:
                undo()
            raise
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
        pending = {name: self.kv.pending_copies(rid, name) for name in self._state_specs}
        return SeqStep(s.start, s.num_tokens, self.kv.block_tables(rid), lent, remote, pending)

    def retain(self, running: Sequence[object]) -> None:
        """The scheduler's running requests after a schedule: vTensors of the rest go."""
        if isinstance(self.attn, VirtualAttention):
            self.attn.retain(r.request_id for r in running)  # type: ignore[attr-defined]

    @property
    def releases_memory(self) -> bool:
        """Whether KV memory can go back to the OS: vTensors, or a paged pool over a memfd
        (a CPU; on a GPU the paged pool is one allocation)."""
        return self.pool is None or self.pool.memory.elastic

    def vtensor_stats(self) -> dict[str, int] | None:
        """The vTensor memory (`VirtualAttention.stats`), or None under the paged pool."""
        return self.attn.stats() if isinstance(self.attn, VirtualAttention) else None

    def trim(self, idle_s: float) -> int:
        """vtensor: give back KV memory unused for `idle_s` seconds; returns the bytes
        punched (the paged pool's goes through MemPool.give_back)."""
        if isinstance(self.attn, VirtualAttention):
            return self.attn.trim(idle_s)
        return 0

    def release(self, request_id: str) -> None:
        """A request finished or was aborted: its vTensors go (the paged pool needs nothing)."""
        if isinstance(self.attn, VirtualAttention):
            self.attn.release(request_id)
