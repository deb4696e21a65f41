"""Greedy picks: the first maximal index of each row, as argmax, in every float dtype."""

import pytest
import torch

from kvserve.engine.sampler import greedy


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
