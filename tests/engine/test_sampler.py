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


PATHS = ["kvs_sample", "torch", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def on_path(logits: torch.Tensor, path: str) -> torch.Tensor:
    """logits as the compiled pass takes them (`kvs_sample`), or where only torch's ops do:
    a strided view of a wider tensor (`torch`), or on the GPU (`cuda`)."""
    if path == "cuda":
        return logits.cuda()
    if path == "kvs_sample":
        return logits
    wide = torch.zeros(logits.shape[0], logits.shape[1] + 3, dtype=logits.dtype)
    wide[:, :logits.shape[1]] = logits
    return wide[:, :logits.shape[1]]


@settings(max_examples=60, deadline=None)
@given(temperature=st.one_of(st.just(5e-324), st.floats(0, 1e6)),
       top_p=st.one_of(st.just(5e-324), st.floats(1e-320, 1.0, exclude_min=False)),
       top_k=st.integers(0, 300), seed=st.one_of(st.none(), st.integers(0, 2**32)),
       spread=st.sampled_from([0.0, 1.0, 1e4]),
       path=st.sampled_from(["kvs_sample", "torch"] + ["cuda"] * torch.cuda.is_available()))
def test_any_valid_params_sample_a_token(temperature, top_p, top_k, seed, spread, path):
    # Found by fuzzing the API: a top_p below float32's range (5e-324) dropped every token
    # and the engine step failed for the whole batch; a denormal temperature made NaNs.
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    params.validate(vocab_size=257)
    logits = torch.randn(2, 257, generator=torch.Generator().manual_seed(1)) * spread
    tokens = Sampler().sample(on_path(logits, path), ["a", "b"], [params, params])
    assert all(0 <= t < 257 for t in tokens)
    if spread and params.greedy:  # no ties to break
        assert tokens == greedy(logits).tolist()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=1.0, top_p=0.9),
                                    SamplingParams(temperature=1.0, top_k=5)])
def test_nan_logits_still_give_tokens_in_the_vocabulary(params, path):
    """A row with a NaN, and a row of NaNs (a model gone wrong, not a request): each still
    gets a token id the vocabulary has, where torch's path answered one past its end."""
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(2))
    logits[0, 5], logits[1] = float("nan"), float("nan")
    tokens = Sampler().sample(on_path(logits, path), ["a", "b"], [params, params])
    assert all(0 <= t < 1000 for t in tokens)


def exact(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a row is drawn from, in float64: softmax(logits / T) over its top_k,
    then its top_p nucleus by a full sort (the first token and each with mass before it
    below top_p, and every token tied with the last of those), renormalised."""
    x = logits.double() / p.temperature
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, _ = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        keep[0] = True
        probs = probs.masked_fill(probs < sorted_p[keep][-1], 0.0)
    return probs / probs.sum()


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.3),
          SamplingParams(temperature=0.8, top_p=0.6), SamplingParams(temperature=1.0, top_k=5),
          SamplingParams(temperature=1.5, top_k=20, top_p=0.9)]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", PATHS)
def test_draws_follow_the_distribution(params, dtype, path):
    """15,000 draws from each of 2 rows (500 rows a call, torch's seeded default generator):
    every token drawn is in the support, and the frequencies are within 0.02 of the exact
    distribution in total variation."""
    torch.manual_seed(7)
    logits = (torch.randn(2, 40, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    batch, calls = on_path(logits.repeat(250, 1), path), 60  # rows 0, 1, 0, 1, ...
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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=4),
                                    SamplingParams(temperature=1.0, top_p=0.7),
                                    SamplingParams(temperature=1.0, top_k=4, top_p=0.7)])
def test_tokens_tied_with_the_last_kept_are_kept(params, path):
    """bfloat16 logits hold many equal values. Three tokens of 2.0, five of 1.0, the rest
    far below: top_k 4, and top_p 0.7 (the 2.0s hold 0.62 of the mass, and a sort would keep
    two of the 1.0s), keep all eight, whichever of the ties a sort would put first."""
    logits = torch.full((1, 300), -30.0)
    logits[0, [7, 100, 299]] = 2.0
    logits[0, [0, 50, 51, 200, 298]] = 1.0
    batch = on_path(logits.to(torch.bfloat16).repeat(400, 1), path)
    sampler, seen = Sampler(), torch.zeros(300)
    for c in range(10):
        for token in sampler.sample(batch, [f"{c}-{j}" for j in range(400)], [params] * 400):
            seen[token] += 1
    assert set(seen.nonzero().flatten().tolist()) == {0, 7, 50, 51, 100, 200, 298, 299}
    want = exact(logits[0], params)
    assert 0.5 * (seen / seen.sum() - want).abs().sum() < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limits", [{}, {"top_k": 50}, {"top_p": 0.9}, {"top_p": 0.999},
                                    {"top_k": 3000, "top_p": 0.95}, {"top_k": 100000}])
def test_the_compiled_draw_is_the_inverse_cdf(dtype, limits):
    """kvs_sample against float64's inverse CDF over what the exact nucleus keeps, on a
    262k-entry row, for 200 uniforms (those within 1e-6 of a boundary between two tokens
    left out: the float32 exps). top_k 3000 and 100000 are more than the row's 256 chunks:
    the floor is bounded by a counting pass instead of the chunks' maxima."""
    from kvserve.kernels.cpu import cpu_kernels
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the kernels did not build")
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 262144, generator=g) * 4).to(dtype)
    for row, t in ((2, 0.7), (0, 1.3)):
        p = SamplingParams(temperature=t, **limits)
        cdf = exact(logits[row].float(), p).cumsum(0)
        u = torch.rand(200, dtype=torch.float64, generator=g)
        got = kernels.sample(logits, [row] * 200, [t] * 200, u, [p.top_k] * 200,
                             [p.top_p] * 200)
        want = torch.searchsorted(cdf, u * cdf[-1], right=True)
        near = torch.tensor([(cdf - v * cdf[-1]).abs().min() < 1e-6 for v in u])
        assert [g_ for g_, n_ in zip(got, near) if not n_] == want[~near].tolist()


@settings(max_examples=120, deadline=None)
@given(V=st.integers(1, 5000), levels=st.sampled_from([0, 4, 40]),
       temperature=st.floats(0.05, 20.0), top_k=st.integers(0, 6000),
       top_p=st.floats(0.01, 1.0), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_compiled_draws_stay_in_the_nucleus(V, levels, temperature, top_k, top_p, bf16, seed):
    """Any row length (one chunk, many, a partial last one), ties (logits on a few levels),
    top_k above the row's chunks or its length: 64 uniforms across [0, 1) draw only tokens
    that the exact nucleus keeps, with top_p widened by 1e-4 for float32's sums."""
    from kvserve.kernels.cpu import cpu_kernels
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C compiler: the kernels did not build")
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * 3
    if levels:
        logits = (logits * levels / 3).round() * 3 / levels
    logits = logits.to(torch.bfloat16 if bf16 else torch.float32)
    u = (torch.arange(64, dtype=torch.float64) + 0.5) / 64
    got = kernels.sample(logits, [0] * 64, [temperature] * 64, u, [top_k] * 64, [top_p] * 64)
    wide = SamplingParams(temperature=temperature, top_k=top_k,
                          top_p=min(1.0, top_p * (1 + 1e-4)))
    allowed = exact(logits[0].float(), wide) > 0
    assert all(allowed[t] for t in got)


def test_the_nucleus_is_the_full_sorts():
    """torch's _top_p_floor (a top-K grown until every row's holds its mass), rows of
    different top_p in one call, keeps the tokens a full sort keeps, and every token where
    top_p is 1 (where a sort's float32 sums can reach 1 before the end)."""
    from kvserve.engine.sampler import _top_p_floor
    g = torch.Generator().manual_seed(11)
    top_ps = [1e-9, 0.5, 0.9, 0.999, 1 - 1e-7, 1.0]
    for spread in (0.5, 3.0):
        probs = torch.softmax(torch.randn(len(top_ps), 262144, generator=g) * spread, dim=-1)
        floor = _top_p_floor(probs, torch.tensor(top_ps, dtype=torch.float64))
        assert floor[-1] == 0
        for row, top_p in enumerate(top_ps[:-1]):
            kept = (probs[row] >= floor[row]).nonzero().flatten()
            sorted_p, order = probs[row].sort(descending=True)
            keep = (sorted_p.cumsum(0) - sorted_p).double() < top_p  # top_p as given
            keep[0] = True
            assert set(kept.tolist()) == set(order[keep].tolist())
