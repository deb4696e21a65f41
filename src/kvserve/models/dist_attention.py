"""DistAttention (Infinite-LLM §4): attention split along the sequence, merged exactly.

Attention over a shard of a sequence's keys yields (out, lse): the shard's
softmax-normalised output and the log-sum-exp of its scaled scores, per query
row and head. Shards merge into attention over their union with weights
exp(lse_j - lse), lse = logsumexp_j lse_j (the paper's Eq. 3 with m and e folded
into one number). An empty shard, or a query row that sees none of its keys,
has lse = -inf and weight 0, so any split of the keys, empty parts included,
merges to the same result. Merges compose: merging merged parts is merging all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

Partial = tuple[torch.Tensor, torch.Tensor]  # out [Q, Hq, D], lse [Q, Hq] float32


class RemoteKVLost(Exception):
    """A creditor holding part of a request's KV is gone: the request must start again
    (its lost keys are recomputed, lent to the survivors)."""

    def __init__(self, req_id: str, why: str = "") -> None:
        super().__init__(f"KV of request {req_id!r} lent to another instance is lost"
                         + (f": {why}" if why else ""))
        self.req_id = req_id


class RemoteKV(Protocol):
    """A request's leading full-attention KV, held by other instances (Infinite-LLM's
    creditors). Every remote key precedes every query the request still computes, so a
    creditor needs no positions and no mask: only the query rows."""

    def attend(self, index: int, q: torch.Tensor) -> Callable[[], list[Partial]]:
        """Start attention of q [Q, Hq, D] over the remote blocks of full-attention layer
        `index` (its place in the full spec); the returned call waits for the partials,
        one per creditor. Starting every request's calls before the local attention lets
        the creditors compute while this instance does."""
        ...


def empty_partial(q: torch.Tensor) -> Partial:
    """What a shard with no keys contributes: nothing."""
    Q, Hq, _ = q.shape
    return (torch.zeros_like(q),
            torch.full((Q, Hq), float("-inf"), dtype=torch.float32, device=q.device))


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      visible: torch.Tensor | None = None) -> Partial:
    """Attention of q [Q, Hq, D] over one shard k, v [L, Hkv, D] (Hkv divides Hq).

    `visible` [Q, L] bool says which keys each query row sees (None: all). Returns
    (out [Q, Hq, D] in q's dtype, lse [Q, Hq] float32). On CPU it is torch's flash
    kernel, which returns its log-sum-exp; elsewhere scores, softmax and values in
    float32.
    """
    Q, Hq, D = q.shape
    L, Hkv, _ = k.shape
    if L == 0 or Q == 0:
        return empty_partial(q)
    G = Hq // Hkv
    # The query heads sharing a KV head become extra rows of that head (no K/V copy).
    qg = q.view(Q, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hkv, G * Q, D)
    kh, vh = k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]
    bias = None
    if visible is not None:
        bias = torch.zeros((G * Q, L), dtype=torch.float32, device=q.device)
        bias.masked_fill_(~visible.repeat(G, 1), float("-inf"))
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, kh.to(q.dtype), vh.to(q.dtype), 0.0, False,
            attn_mask=None if bias is None else bias.to(q.dtype)[None, None], scale=scale)
    else:
        scores = torch.matmul(qg.float(), kh.float().transpose(-1, -2)) * scale
        if bias is not None:
            scores = scores + bias
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse[..., None]).nan_to_num(0.0), vh.float())
    out = out.view(Hkv, G, Q, D).permute(2, 0, 1, 3).reshape(Q, Hq, D)
    lse = lse.float().view(Hkv, G, Q).permute(2, 0, 1).reshape(Q, Hq)
    if visible is not None:  # rows that see nothing: weight 0, not NaN
        blind = ~visible.any(dim=1)
        if bool(blind.any()):
            out = out.masked_fill(blind[:, None, None], 0.0)
            lse = lse.masked_fill(blind[:, None], float("-inf"))
    return out.to(q.dtype), lse


def merge(parts: Sequence[Partial]) -> Partial:
    """The exact attention over the union of the parts' keys, as one more part."""
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse for _, lse in parts])  # [S, Q, Hq]
    total = torch.logsumexp(lses, dim=0)
    # A row no part sees: every weight is exp(-inf - -inf) = NaN; make it 0.
    weights = torch.exp(lses - total).nan_to_num(0.0)
    out = sum(w[..., None] * o.float() for w, (o, _) in zip(weights, parts))
    return out.to(parts[0][0].dtype), total
