"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.engine.request import SamplingParams
from kvserve.kernels.cpu import kernels_for


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The first maximal index of each row of logits [B, vocab], exact in any float dtype.

    On CPU a compiled pass (kvserve.kernels); elsewhere max(dim), which returns the same first
    maximal index as argmax but runs ~4x faster than argmax on CPU (argmax's CPU reduction is
    not vectorised).
    """
    k = kernels_for(logits)
    if k is not None and logits.is_contiguous():
        return k.argmax(logits)
    return logits.max(dim=-1).indices


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, ids: Sequence[str], params: Sequence[SamplingParams]
    ) -> list[int]:
        """One token per row of logits [B, vocab]."""
        rows = [i for i, p in enumerate(params) if not p.greedy]
        out = greedy(logits).tolist() if len(rows) < len(params) else [0] * len(params)
        if not rows:
            return out
        u = torch.cat([torch.rand(1, dtype=torch.float64,
                                  generator=self._generator(ids[i], params[i])) for i in rows])
        picked = [params[i] for i in rows]
        k = kernels_for(logits) if logits.is_contiguous() else None
        if k is not None:  # one compiled pass set a row (kvs_sample), no [rows, vocab] temporaries
            V = logits.shape[-1]
            picks = k.sample(logits, rows, [p.temperature for p in picked], u,
                             [p.top_k if 0 < p.top_k < V else 0 for p in picked],
                             [p.top_p for p in picked])
        else:
            picks = self._sample_rows(logits[rows], picked, u)
        for i, token in zip(rows, picks):
            out[i] = token
        return out

    def _generator(self, rid: str, p: SamplingParams) -> torch.Generator | None:
        if p.seed is None:
            return None
        gen = self._generators.get(rid)
        if gen is None:
            gen = self._generators[rid] = torch.Generator().manual_seed(p.seed)
        return gen

    @staticmethod
    def _sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                     u: torch.Tensor) -> list[int]:
        """torch's ops, where the compiled pass cannot run (another device, strided logits):
        temperature, top-k and softmax over all rows at once; then per row its top-p floor
        and its uniform u against the cumulative distribution (inverse CDF). Keeps what
        kvs_sample keeps."""
        temps = torch.tensor([[p.temperature] for p in params], device=logits.device)
        x = logits.float() / temps
        V = x.shape[1]
        ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
        if any(ks):
            kth = torch.topk(x, max(ks), dim=-1).values
            for r, k in enumerate(ks):
                if k:
                    x[r].masked_fill_(x[r] < kth[r, k - 1], float("-inf"))
        probs = torch.softmax(x, dim=-1)
        return [_draw(_nucleus(row, p.top_p), uj) for row, p, uj in zip(probs, params, u)]


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs with every token outside the top_p nucleus zeroed: the smallest prefix by
    decreasing value whose mass reaches top_p (the first token always), and the tokens tied
    with its last. The prefix lies in the top K once their mass reaches top_p (every later
    token's mass before it is larger), so K grows from 1024 only until it does: no sort of
    the whole vocabulary for the usual nucleus."""
    if top_p >= 1.0:
        return probs
    k = min(1024, probs.numel())
    while True:
        vals = torch.topk(probs, k).values
        mass = vals.cumsum(0)  # the same sums as over the whole sorted vocabulary's prefix
        if k == probs.numel() or mass[-1] >= top_p:
            break
        k = min(probs.numel(), k * 8)
    # Mass before each token; a top_p below float32's range rounds to 0, and 0 >= 0.
    keep = mass - vals < top_p
    keep[0] = True
    return probs.masked_fill(probs < vals[keep][-1], 0.0)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> int:
    """A token with probability probs[j] / sum(probs): for u uniform in [0, 1), the first j
    whose cumulative mass passes u * total (float64 sums; a zero-probability token is never
    picked)."""
    cdf = probs.double().cumsum(0)
    total = cdf[-1:]
    j = min(int(torch.searchsorted(cdf, u.to(cdf.device).reshape(1) * total, right=True)),
            int(torch.searchsorted(cdf, total)))  # the last token with mass
    # No finite mass (a model that made NaN logits): a valid token rather than one past the
    # vocabulary, as kvs_sample does.
    return j if j < cdf.numel() else int(probs.argmax())
