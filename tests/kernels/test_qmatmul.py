"""The Q8_0 decode matmul (qmatmul.c) against torch on the dequantized weights."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.models.quant import q8_blocks


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), M=st.integers(1, 4), N=st.integers(1, 70),
       blocks=st.integers(1, 24), strided=st.booleans())
def test_q8_matmul_matches_dequantized_torch(kernels, seed, M, N, blocks, strided):
    g = torch.Generator().manual_seed(seed)
    K = 32 * blocks
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g)
    q, d = q8_blocks(w)
    x = torch.randn(M, K + 8 * strided, generator=g)[:, :K]  # rows of a wider buffer
    wd = (q.float().view(N, blocks, 32) * d[..., None]).view(N, K)
    want = (x.double() @ wd.double().T).float()
    # The AVX2 path rounds x to int16 blocks: each value by at most half a step of
    # its block's largest |x| / 32767; the rest is float32 summation.
    step = x.abs().view(M, blocks, 32).amax(-1) / 32767
    bound = (0.5 * step.repeat_interleave(32, dim=1)) @ wd.abs().T
    err = (kernels.q8_matmul(x, q, d) - want).abs()
    assert (err <= bound + 1e-5 * (x.abs() @ wd.abs().T) + 1e-6).all()


def test_q8_blocks_round_trip_a_q8_0_tensor_exactly():
    # Values as llama.cpp's Q8_0 stores them: d * q with each block's largest |q| = 127.
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (8, 64), generator=g, dtype=torch.int8)
    q[:, 0], q[:, 32] = 127, -127
    d = torch.rand(8, 2, generator=g)
    w = (q.float().view(8, 2, 32) * d[..., None]).view(8, 64)
    q2, d2 = q8_blocks(w)
    assert torch.equal(q2, q)
    torch.testing.assert_close(d2, d, rtol=1e-6, atol=0)


def test_q8_matmul_refuses_bad_shapes(kernels):
    q, d = q8_blocks(torch.randn(4, 64))
    with pytest.raises(ValueError, match="q8_matmul"):
        kernels.q8_matmul(torch.randn(5, 64), q, d)  # more rows than it keeps in registers
    with pytest.raises(ValueError, match="q8_matmul"):
        kernels.q8_matmul(torch.randn(1, 64).bfloat16(), q, d)
