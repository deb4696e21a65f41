"""DistAttention's merge is exact: any split of the keys merges to plain attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.models.dist_attention import empty_partial, merge, partial_attention


def plain_attention(q, k, v, scale, visible):
    """softmax(q k^T * scale) v over the visible keys, in float64: the reference."""
    Q, Hq, D = q.shape
    G = Hq // k.shape[1]
    kk = k.double().repeat_interleave(G, dim=1)  # [L, Hq, D]
    vv = v.double().repeat_interleave(G, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q.double(), kk) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hql,lhd->qhd", probs, vv)


@st.composite
def problems(draw):
    hkv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from([8, 16]))
    q_len = draw(st.integers(1, 6))
    keys = draw(st.integers(1, 40))
    # Queries sit at the end of the keys (a prefill chunk or a decode token), causal and
    # optionally windowed, as in the engine.
    window = draw(st.sampled_from([0, 3, 7, 64]))
    cuts = sorted(draw(st.lists(st.integers(0, keys), max_size=4)))
    seed = draw(st.integers(0, 2**16))
    return hkv, group, d, q_len, keys, window, cuts, seed


def visibility(q_len: int, keys: int, window: int) -> torch.Tensor:
    q_pos = torch.arange(keys - q_len, keys) if q_len <= keys else torch.arange(q_len)
    k_pos = torch.arange(keys)
    vis = k_pos[None] <= q_pos[:, None]
    if window:
        vis &= k_pos[None] > q_pos[:, None] - window
    return vis


@settings(max_examples=60, deadline=None)
@given(problems())
def test_any_split_merges_to_plain_attention(p):
    hkv, group, d, q_len, keys, window, cuts, seed = p
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_len, hkv * group, d, generator=g)
    k = torch.randn(keys, hkv, d, generator=g) * 2
    v = torch.randn(keys, hkv, d, generator=g)
    vis = visibility(q_len, keys, window)
    scale = d ** -0.5
    bounds = [0, *cuts, keys]  # empty shards included where cuts repeat
    parts = [partial_attention(q, k[a:b], v[a:b], scale, vis[:, a:b])
             for a, b in zip(bounds, bounds[1:])]
    out, lse = merge(parts)
    want = plain_attention(q, k, v, scale, vis)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    # Merging is associative: the first two parts merged first give the same.
    if len(parts) > 2:
        again, _ = merge([merge(parts[:2]), *parts[2:]])
        torch.testing.assert_close(again, out, atol=2e-6, rtol=2e-6)
    # The merged log-sum-exp is the whole row's.
    G = hkv * group // hkv
    scores = torch.einsum("qhd,lhd->qhl", q.double(),
                          k.double().repeat_interleave(G, dim=1)) * scale
    want_lse = scores.masked_fill(~vis[:, None], float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=2e-5)


def test_empty_shards_contribute_nothing():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(5, 2, 8, generator=g), \
        torch.randn(5, 2, 8, generator=g)
    whole = partial_attention(q, k, v, 0.3)
    out, lse = merge([empty_partial(q), whole, partial_attention(q, k[:0], v[:0], 0.3)])
    torch.testing.assert_close(out, whole[0])
    torch.testing.assert_close(lse, whole[1])
    # A row that sees nothing anywhere stays finite: zeros, lse -inf.
    blind = torch.zeros(3, 5, dtype=torch.bool)
    out, lse = merge([partial_attention(q, k, v, 0.3, blind), empty_partial(q)])
    assert torch.equal(out, torch.zeros_like(q)) and bool(torch.isinf(lse).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_follow_the_query(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 16, generator=g).to(dtype)
    k, v = (torch.randn(9, 1, 16, generator=g).to(dtype) for _ in range(2))
    out, lse = merge([partial_attention(q, k[:4], v[:4], 0.25),
                      partial_attention(q, k[4:], v[4:], 0.25)])
    assert out.dtype == dtype and lse.dtype == torch.float32
    everything = torch.ones(2, 9, dtype=torch.bool)
    want = plain_attention(q.float(), k.float(), v.float(), 0.25, everything)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
