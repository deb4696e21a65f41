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
        out = greedy(logits).tolist()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return out
        u = {i: torch.rand(1, dtype=torch.float64, generator=self._generator(ids[i], params[i]))
             for i in rows}
        k = kernels_for(logits) if logits.is_contiguous() else None
        V = logits.shape[-1]
        # Temperature alone (no top-k or top-p, as OpenAI's defaults): one compiled pass
        # set over each row (kvs_sample), no [rows, vocab] temporaries.
        plain = [i for i in rows if k is not None and not 0 < params[i].top_k < V
                 and params[i].top_p >= 1.0]
        rest = [i for i in rows if i not in plain]
        if plain:
            picks = k.sample(logits, plain, [params[i].temperature for i in plain],
                             torch.cat([u[i] for i in plain]))
            _put(out, plain, picks)
        if rest:
            picks = self._sample_rows(logits[rest], [params[i] for i in rest],
                                      [u[i] for i in rest])
            _put(out, rest, picks)
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
                     u: Sequence[torch.Tensor]) -> list[int]:
        """Temperature, top-k and softmax over all rows at once; then per row its top-p
        nucleus and its uniform u against the cumulative distribution (inverse CDF).
        The row at a time with a full sort for top-p and torch.multinomial took 4.4 ms a row
        at temperature alone and 19 ms with top_p 0.9 (262k-entry vocabulary, 2-core Zen 5):
        a batch of 32 spent 0.14-0.64 s a step sampling, 5-23x the model's step."""
        x = logits.float() / torch.tensor([[p.temperature] for p in params])
        V = x.shape[1]
        ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
        if any(ks):
            kth = torch.topk(x, max(ks), dim=-1).values
            for r, k in enumerate(ks):
                if k:
                    x[r].masked_fill_(x[r] < kth[r, k - 1], float("-inf"))
        probs = torch.softmax(x, dim=-1)
        return [_draw(*_nucleus(row, p.top_p), uj) for row, p, uj in zip(probs, params, u)]


def _put(out: list[int], rows: Sequence[int], tokens: Sequence[int]) -> None:
    for i, token in zip(rows, tokens):
        out[i] = token


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The smallest prefix of probs by decreasing value whose mass reaches top_p (the first
    token always), as (its probabilities, their token ids); all of probs (ids None) where
    top_p is 1. The prefix lies in the top K once their mass reaches top_p (every later
    token's mass before it is larger), so K grows from 1024 only until it does: no sort of
    the whole vocabulary for the usual nucleus."""
    if top_p >= 1.0:
        return probs, None
    k = min(1024, probs.numel())
    while True:
        vals, ids = torch.topk(probs, k)
        mass = vals.cumsum(0)  # the same sums as over the whole sorted vocabulary's prefix
        if k == probs.numel() or mass[-1] >= top_p:
            break
        k = min(probs.numel(), k * 8)
    # Mass before each token; a top_p below float32's range rounds to 0, and 0 >= 0.
    keep = mass - vals < top_p
    keep[0] = True
    return vals[keep], ids[keep]


def _draw(probs: torch.Tensor, ids: torch.Tensor | None, u: torch.Tensor) -> int:
    """A token with probability probs[j] / sum(probs): for u uniform in [0, 1), the first j
    whose cumulative mass passes u * total (float64 sums; a zero-probability token is never
    picked)."""
    cdf = probs.double().cumsum(0)
    total = cdf[-1:]
    j = min(int(torch.searchsorted(cdf, u.reshape(1) * total, right=True)),
            int(torch.searchsorted(cdf, total)))  # the last token with mass
    return j if ids is None else int(ids[j])
