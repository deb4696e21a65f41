"""Reference attention backend: per-sequence K/V in plain growing tensors.

Simple and obviously correct rather than fast; it is the yardstick the paged backends are
tested against, and what the model tests use to compare with Hugging Face transformers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.models.base import STATE_DTYPE, CausalLM, KVLayer, StateSeq


@dataclass(frozen=True)
class _Slot:
    """Where one sequence's new tokens sit in the flattened batch."""

    seq_id: Hashable
    start: int  # offset into the flattened batch
    num_new: int
    past_len: int  # tokens already cached before this step


class ContiguousAttention:
    """KV cache + attention for a varlen batch, one contiguous K/V tensor per (layer, sequence).

    Usage per step: ``positions = attn.begin_batch(seq_ids, num_new_tokens)``, then
    ``model(input_ids, positions, attn)``; every layer appends its k/v and attends. A sequence
    seen for the first time starts empty (prefill); later steps extend it (decode or chunked
    prefill). Masking follows HF: a query at position p sees keys at positions k with
    ``k <= p``, on sliding layers ``k > p - window``, on chunked layers
    ``k >= p // chunk * chunk``; scores are soft-capped before the mask where the layer
    says so. A state layer's states sit in one tensor per layer and state part, a row per
    sequence (`states`).
    """

    def __init__(self, layers: Sequence[KVLayer], device: torch.device | str = "cpu") -> None:
        self.layers = list(layers)
        self.device = torch.device(device)
        self._k: list[dict[Hashable, torch.Tensor]] = [{} for _ in self.layers]
        self._v: list[dict[Hashable, torch.Tensor]] = [{} for _ in self.layers]
        self._lens: dict[Hashable, int] = {}
        self._batch: list[_Slot] = []
        self._rows: dict[Hashable, int] = {}  # each sequence's row of the state tensors
        self._states: dict[int, tuple[torch.Tensor, ...]] = {}

    def seq_len(self, seq_id: Hashable) -> int:
        return self._lens.get(seq_id, 0)

    def begin_batch(
        self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]
    ) -> torch.Tensor:
        """Declare the layout of the next flattened batch; returns its positions [num_tokens]."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a sequence may appear only once per batch")
        slots, start, positions = [], 0, []
        for seq_id, n in zip(seq_ids, num_new_tokens, strict=True):
            past = self.seq_len(seq_id)
            slots.append(_Slot(seq_id, start, n, past))
            positions.append(torch.arange(past, past + n))
            self._lens[seq_id] = past + n
            start += n
        self._batch = slots
        return torch.cat(positions).to(self.device)

    def free(self, seq_id: Hashable) -> None:
        self._lens.pop(seq_id, None)
        self._rows.pop(seq_id, None)
        for per_layer in (*self._k, *self._v):
            per_layer.pop(seq_id, None)

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        expected = sum(slot.num_new for slot in self._batch)
        if q.shape[0] != expected:
            raise ValueError(f"got {q.shape[0]} tokens, begin_batch declared {expected}")
        out = torch.empty_like(q)
        for slot in self._batch:
            rows = slice(slot.start, slot.start + slot.num_new)
            keys, values = self._append(layer_idx, slot, k[rows], v[rows])
            out[rows] = self._attend(layer_idx, slot, q[rows], keys, values)
        return out

    def states(self, layer_idx: int) -> tuple[list[StateSeq], tuple[torch.Tensor, ...]]:
        """A state layer's sequences this step: each reads and writes its own row."""
        for slot in self._batch:
            if slot.seq_id not in self._rows:
                self._rows[slot.seq_id] = max(self._rows.values(), default=-1) + 1
        need = max(self._rows.values()) + 1
        shapes = self.layers[layer_idx].state
        have = self._states.get(layer_idx)
        if have is None or have[0].shape[0] < need:
            grown = tuple(torch.zeros(2 * need, *shape, dtype=STATE_DTYPE, device=self.device)
                          for shape in shapes)
            for new, old in zip(grown, have or ()):
                new[:old.shape[0]] = old
            self._states[layer_idx] = have = grown
        seqs = []
        for slot in self._batch:
            row = self._rows[slot.seq_id]
            seqs.append(StateSeq(slice(slot.start, slot.start + slot.num_new), slot.past_len,
                                 row if slot.past_len else None, ((slot.num_new, (row,)),)))
        return seqs, have

    def _append(
        self, layer_idx: int, slot: _Slot, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        old_k = self._k[layer_idx].get(slot.seq_id)
        cached = 0 if old_k is None else old_k.shape[0]
        if cached != slot.past_len:
            # Catches a forward run twice for one begin_batch, or a skipped layer.
            raise RuntimeError(
                f"layer {layer_idx}: cache has {cached} tokens, expected "
                f"{slot.past_len} for sequence {slot.seq_id!r}"
            )
        if old_k is not None:
            k = torch.cat((old_k, k))
            v = torch.cat((self._v[layer_idx][slot.seq_id], v))
        self._k[layer_idx][slot.seq_id], self._v[layer_idx][slot.seq_id] = k, v
        return k, v

    def _attend(
        self, layer_idx: int, slot: _Slot, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        q_pos = torch.arange(slot.past_len, slot.past_len + slot.num_new, device=q.device)
        k_pos = torch.arange(k.shape[0], device=q.device)
        layer = self.layers[layer_idx]
        mask = k_pos[None, :] <= q_pos[:, None]
        if layer.window:
            mask &= k_pos[None, :] > q_pos[:, None] - layer.window
        if layer.chunk:
            mask &= k_pos[None, :] >= q_pos[:, None] // layer.chunk * layer.chunk
        # SDPA wants [heads, tokens, head_dim]. Query head h reads kv head h // group; expand
        # the shared KV heads the way HF's repeat_kv does so the arithmetic matches it.
        group = q.shape[1] // k.shape[1]
        q, k, v = (q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, dim=0),
                   v.transpose(0, 1).repeat_interleave(group, dim=0))
        if layer.softcap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale)
        else:  # SDPA cannot cap scores: eager attention, as HF runs these models
            scores = torch.matmul(q, k.transpose(1, 2)) * layer.scale
            scores = torch.tanh(scores / layer.softcap) * layer.softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
        return out.transpose(0, 1)


@torch.inference_mode()
def greedy_generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    attn: ContiguousAttention | None = None,
) -> list[list[int]]:
    """Greedy-decode all prompts together in one varlen batch; returns new tokens per prompt.

    Runs exactly ``max_new_tokens`` steps (no stop tokens): it is a reference loop for tests,
    not the engine's scheduler.
    """
    attn = attn if attn is not None else ContiguousAttention(model.kv_layers, model.device)
    seq_ids = list(range(len(prompts)))
    step_inputs = [list(p) for p in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        lens = [len(x) for x in step_inputs]
        positions = attn.begin_batch(seq_ids, lens)
        ids = torch.tensor([t for x in step_inputs for t in x], device=model.device)
        hidden = model(ids, positions, attn)
        last_rows = torch.tensor(lens, device=model.device).cumsum(0) - 1
        next_ids = model.compute_logits(hidden[last_rows]).argmax(-1).tolist()
        for out, tok in zip(generated, next_ids, strict=True):
            out.append(tok)
        step_inputs = [[t] for t in next_ids]
    return generated


@torch.inference_mode()
def sequence_logits(model: CausalLM, ids: Sequence[int],
                    step: int | None = None) -> torch.Tensor:
    """Float32 logits at every position of one sequence [len(ids), vocab], fed `step`
    tokens a forward (all at once if None): the yardstick for quantization quality."""
    attn = ContiguousAttention(model.kv_layers, model.device)
    out = []
    for start in range(0, len(ids), step or len(ids)):
        chunk = list(ids[start:start + (step or len(ids))])
        positions = attn.begin_batch([0], [len(chunk)])
        hidden = model(torch.tensor(chunk, device=attn.device), positions, attn)
        out.append(model.compute_logits(hidden).float())
    return torch.cat(out)
