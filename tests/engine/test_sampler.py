"""Greedy picks (the first maximal index, as argmax, in every float dtype), and sampling
that returns a token for any parameters validation lets through."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.request import SamplingParams
from kvserve.engine.sampler import Sampler, greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [262144, 1000])
def test_greedy_is_argmax_with_first_index_on_ties(dtype, vocab):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    top = logits.max() + 1
    logits[1, [vocab // 3, vocab // 2, vocab - 1]] = top  # a tie far apart
    logits[2, [5, 6]] = top  # a tie side by side
    logits[3, vocab - 1] = top  # the last entry
    assert torch.equal(greedy(logits), logits.float().argmax(dim=-1))


@settings(max_examples=60, deadline=None)
@given(temperature=st.one_of(st.just(5e-324), st.floats(0, 1e6)),
       top_p=st.one_of(st.just(5e-324), st.floats(1e-320, 1.0, exclude_min=False)),
       top_k=st.integers(0, 300), seed=st.one_of(st.none(), st.integers(0, 2**32)),
       spread=st.sampled_from([0.0, 1.0, 1e4]))
def test_any_valid_params_sample_a_token(temperature, top_p, top_k, seed, spread):
    # Found by fuzzing the API: a top_p below float32's range (5e-324) dropped every token
    # and the engine step failed for the whole batch; a denormal temperature made NaNs.
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    params.validate(vocab_size=257)
    logits = torch.randn(2, 257, generator=torch.Generator().manual_seed(1)) * spread
    tokens = Sampler().sample(logits, ["a", "b"], [params, params])
    assert all(0 <= t < 257 for t in tokens)
    if spread and params.greedy:  # no ties to break
        assert tokens == greedy(logits).tolist()


def exact(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row is drawn from, in float64: softmax(logits / T) over its top_k,
    then its top_p nucleus (by a full sort), renormalised."""
    x = logits.double() / p.temperature
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p >= p.top_p
        drop[0] = False
        probs = probs.scatter(0, order[drop], 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.3),
    SamplingParams(temperature=0.8, top_p=0.6), SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.5, top_k=20, top_p=0.9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_follow_the_distribution(params, dtype):
    """15,000 draws from each of 2 rows (the compiled pass where temperature is alone,
    torch's ops with top-k or top-p; 500 rows a call, torch's seeded default generator):
    every token drawn is in the support, and the frequencies are within 0.02 of the exact
    distribution in total variation."""
    torch.manual_seed(7)
    logits = (torch.randn(2, 40, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    batch, calls = logits.repeat(250, 1), 60  # rows 0, 1, 0, 1, ...
    sampler, counts = Sampler(), torch.zeros(2, 40)
    for c in range(calls):
        tokens = sampler.sample(batch, [f"{c}-{j}" for j in range(500)], [params] * 500)
        for j, token in enumerate(tokens):
            counts[j % 2, token] += 1
    n = calls * 250
    for row in range(2):
        want = exact(logits[row].float(), params)
        assert (counts[row][want == 0] == 0).all()
        assert 0.5 * (counts[row] / n - want).abs().sum() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_draw_is_the_inverse_cdf(dtype):
    """kvs_sample against float64's inverse CDF on a 262k-entry row, for 200 uniforms (those
    within 1e-6 of a boundary between two tokens are left out: the float32 exps)."""
    from kvserve.kernels.cpu import cpu_kernels
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the kernels did not build")
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 262144, generator=g) * 4).to(dtype)
    for row, t in ((2, 0.7), (0, 1.3)):
        cdf = torch.softmax(logits[row].double() / t, dim=-1).cumsum(0)
        u = torch.rand(200, dtype=torch.float64, generator=g)
        got = kernels.sample(logits, [row] * 200, [t] * 200, u)
        want = torch.searchsorted(cdf, u * cdf[-1], right=True)
        near = torch.tensor([(cdf - v * cdf[-1]).abs().min() < 1e-6 for v in u])
        assert [g_ for g_, n_ in zip(got, near) if not n_] == want[~near].tolist()


@pytest.mark.parametrize("top_p", [1e-9, 0.5, 0.9, 0.999, 1 - 1e-7])
def test_the_nucleus_is_the_full_sorts(top_p):
    """_nucleus's top-K (grown until it holds the mass) keeps the tokens a full sort keeps."""
    from kvserve.engine.sampler import _nucleus
    g = torch.Generator().manual_seed(11)
    for spread in (0.5, 3.0):
        probs = torch.softmax(torch.randn(262144, generator=g) * spread, dim=-1)
        _, ids = _nucleus(probs, top_p)
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p
        keep[0] = True
        assert set(ids.tolist()) == set(order[keep].tolist())
