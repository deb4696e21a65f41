"""Paged attention over the shared KV pool (the engine's attention backend).

Each step the runner describes the batch once (`prepare`); every layer then
writes its new K/V into the pages of its own spec and attends. Decode
sequences (one new token each) are batched into one padded SDPA call per
layer; prefill chunks run one sequence at a time. Masks follow HF: a query at
position p sees keys k <= p, and on sliding layers k > p - window.

This is the portable (CPU/CUDA) backend; a fused kernel can replace it
behind the same two calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.physical.pool import KVPool


@dataclass(frozen=True)
class LayerBinding:
    """Where a model layer's KV lives and how far back it looks."""

    spec: str
    index: int  # layer index inside the spec's pages
    window: int  # 0 for full attention


@dataclass
class SeqStep:
    """One sequence's part of a step: tokens [start, start + num_new) and its page tables."""

    start: int
    num_new: int
    tables: dict[str, list[int]]


@dataclass
class _Gather:
    """Padded key positions of a group of sequences for one spec."""

    pages: torch.Tensor  # [B, L]
    offsets: torch.Tensor  # [B, L]
    mask: torch.Tensor  # [B, 1, Q, L] bool


class PagedAttention:
    def __init__(
        self, pool: KVPool, bindings: Sequence[LayerBinding], scale: float, block_size: int
    ) -> None:
        self.pool = pool
        self.bindings = list(bindings)
        self.scale = scale
        self.T = block_size
        self.device = pool.device
        self._windows = sorted({(b.spec, b.window) for b in self.bindings})

    # ----------------------------------------------------------------- prepare

    def prepare(self, seqs: Sequence[SeqStep]) -> torch.Tensor:
        """Describe the next batch; returns the positions of its flattened tokens."""
        self.seqs = list(seqs)
        pos = torch.cat([torch.arange(s.start, s.start + s.num_new) for s in seqs])
        self.num_tokens = int(pos.numel())
        self.decode_rows = [i for i, s in enumerate(seqs) if s.num_new == 1]
        self.prefill_rows = [i for i, s in enumerate(seqs) if s.num_new > 1]
        offsets = [0]
        for s in seqs:
            offsets.append(offsets[-1] + s.num_new)
        self.row_start = offsets
        self.writes = {spec: self._write_slots(spec, pos) for spec, _ in self._windows}
        self.decode = {
            key: self._gather([seqs[i] for i in self.decode_rows], *key)
            for key in self._windows if self.decode_rows
        }
        self.prefill = {
            key: [self._gather([seqs[i]], *key) for i in self.prefill_rows]
            for key in self._windows
        }
        return pos.to(self.device)

    def _write_slots(self, spec: str, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pages = []
        for s in self.seqs:
            table = s.tables[spec]
            pages += [table[p // self.T] for p in range(s.start, s.start + s.num_new)]
        if min(pages) < 0:
            raise RuntimeError(f"spec {spec!r}: a new token has no page")
        return (torch.tensor(pages, device=self.device), (pos % self.T).to(self.device))

    def _gather(self, group: Sequence[SeqStep], spec: str, window: int) -> _Gather:
        T = self.T
        q_len = max(s.num_new for s in group)
        los = [max(0, s.start - window + 1) if window else 0 for s in group]
        ends = [s.start + s.num_new for s in group]
        L = max(e - lo for e, lo in zip(ends, los))
        lo = torch.tensor(los)[:, None]
        key_pos = lo + torch.arange(L)[None, :]
        valid = key_pos < torch.tensor(ends)[:, None]
        key_pos = torch.where(valid, key_pos, lo)
        nblocks = max(-(-e // T) for e in ends)
        tables = torch.tensor([(s.tables[spec] + [0] * nblocks)[:nblocks] for s in group])
        pages = tables.gather(1, key_pos // T)
        if bool((pages[valid] < 0).any()):
            raise RuntimeError(f"spec {spec!r}: a key inside the window has no page")
        q_pos = torch.stack([
            torch.arange(s.start, s.start + q_len) for s in group
        ])  # padded query rows of decode groups have q_len 1 anyway
        mask = valid[:, None, :] & (key_pos[:, None, :] <= q_pos[:, :, None])
        if window:
            mask &= key_pos[:, None, :] > q_pos[:, :, None] - window
        return _Gather(pages.clamp_min(0).to(self.device), (key_pos % T).to(self.device),
                       mask[:, None].to(self.device))

    # ------------------------------------------------------------------- call

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        b = self.bindings[layer_idx]
        cache = self.pool.layer(b.spec, b.index)
        pages, offs = self.writes[b.spec]
        cache[pages, offs] = torch.stack((k, v), dim=1).to(cache.dtype)
        out = torch.empty_like(q)
        key = (b.spec, b.window)
        if self.decode_rows:
            rows = torch.tensor([self.row_start[i] for i in self.decode_rows], device=q.device)
            out[rows] = self._attend(cache, self.decode[key], q[rows][:, None])[:, 0]
        for i, g in zip(self.prefill_rows, self.prefill[key]):
            rows = slice(self.row_start[i], self.row_start[i + 1])
            out[rows] = self._attend(cache, g, q[rows][None])[0]
        return out

    def _attend(self, cache: torch.Tensor, g: _Gather, q: torch.Tensor) -> torch.Tensor:
        """q [B, Q, Hq, D] -> [B, Q, Hq, D] over the gathered keys."""
        kv = cache[g.pages, g.offsets].to(q.dtype)  # [B, L, 2, Hkv, D]
        keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        group = q.shape[2] // keys.shape[1]
        if group > 1:  # as HF's repeat_kv, so the arithmetic matches the reference
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=g.mask, scale=self.scale
        )
        return out.transpose(1, 2)
