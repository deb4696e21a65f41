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
