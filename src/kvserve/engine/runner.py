"""Model runner: turns a scheduled batch into one forward pass over the KV pool."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.scheduler import Scheduled
from kvserve.memory import KVCacheManager, KVSpec, LayerKind
from kvserve.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from kvserve.models.paged_attention import LayerBinding, PagedAttention, SeqStep
from kvserve.physical.pool import AttentionShape, KVPool


def attention_specs(
    config: Gemma3Config, dtype: torch.dtype
) -> tuple[list[KVSpec], list[LayerBinding], AttentionShape]:
    """The model's KV specs (one per layer type) and where each layer lives in them."""
    shape = AttentionShape(config.num_key_value_heads, config.head_dim, dtype)
    bindings, counts = [], {"full": 0, "sliding": 0}
    for i in range(config.num_hidden_layers):
        name = "sliding" if config.is_sliding(i) else "full"
        window = config.sliding_window if name == "sliding" else 0
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


class ModelRunner:
    def __init__(
        self, model: Gemma3ForCausalLM, kv: KVCacheManager, bindings: Sequence[LayerBinding],
        shape: AttentionShape,
    ) -> None:
        self.model = model
        self.kv = kv
        shapes = {spec.name: shape for spec in kv.layout.specs}
        self.pool = KVPool(kv.layout, kv.num_large_pages, shapes, model.device)
        self.attn = PagedAttention(self.pool, bindings, model.config.attn_scale, kv.T)

    @torch.inference_mode()
    def execute(self, batch: Sequence[Scheduled]) -> torch.Tensor:
        """Run the batch; logits [n, vocab] for the entries that complete their tokens."""
        seqs = [
            SeqStep(s.start, s.num_tokens, self.kv.block_tables(s.request.request_id))
            for s in batch
        ]
        ids = [t for s in batch for t in s.request.token_ids[s.start:s.start + s.num_tokens]]
        device = self.model.device
        positions = self.attn.prepare(seqs)
        hidden = self.model(torch.tensor(ids, device=device), positions, self.attn)
        ends, rows = 0, []
        for s in batch:
            ends += s.num_tokens
            if s.completes_prompt:
                rows.append(ends - 1)
        return self.model.compute_logits(hidden[rows])
