"""The Q8_0 decode matmul (qmatmul.c) against torch on the dequantized weights."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kernels.q5 import q5_blocks, q5_dequantize
from kvserve.models.quant import q8_blocks


def _quantized_weight(kernels, fmt: str, g: torch.Generator, N: int, K: int):
    """A random weight in `fmt` blocks: its dequantized values and the kernel over it."""
    if fmt == "q5":
        codes, d = random_q5(g, N, K)
        packed = kernels.q5_pack(codes, d)
        return q5_dequantize(codes, d), lambda x: kernels.q5_matmul(x, *packed)
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g)
    q, d = q8_blocks(w)
    packed = kernels.q8_pack(q, d)
    wd = (q.float().view(N, K // 32, 32) * d[..., None]).view(N, K)
    return wd, lambda x: kernels.q8_matmul(x, *packed)


def check_matmul(kernels, seed: int, M: int, N: int, blocks: int, strided: bool,
                 fmt: str = "q8") -> None:
    g = torch.Generator().manual_seed(seed)
    K = 32 * blocks
    wd, matmul = _quantized_weight(kernels, fmt, g, N, K)
    x = torch.randn(M, K + 8 * strided, generator=g)[:, :K]  # rows of a wider buffer
    want = (x.double() @ wd.double().T).float()
    # The SIMD paths round x to int16 blocks: each value by at most half a step of
    # its block's largest |x| / 32767; the rest is float32 summation.
    step = x.abs().view(M, blocks, 32).amax(-1) / 32767
    bound = (0.5 * step.repeat_interleave(32, dim=1)) @ wd.abs().T
    got = matmul(x)
    assert got.shape == (M, N)
    assert ((got - want).abs() <= bound + 1e-5 * (x.abs() @ wd.abs().T) + 1e-6).all()


def random_q5(g: torch.Generator, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and fp16 scales, rows of different magnitudes."""
    codes = torch.randint(0, 32, (N, K), generator=g, dtype=torch.uint8)
    d = (torch.rand(N, K // 32, generator=g) * torch.rand(N, 1, generator=g)).half()
    return codes, d


# Any M (tiles of 4 rows and their remainders), N not a multiple of the 2-column tile or of
# the 64-column chunk, K a multiple of 32 but not of the 128 the weights are padded to.
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), M=st.integers(1, 13), N=st.integers(1, 150),
       blocks=st.integers(1, 24), strided=st.booleans())
def test_q8_matmul_matches_dequantized_torch(kernels, seed, M, N, blocks, strided):
    check_matmul(kernels, seed, M, N, blocks, strided)


@pytest.mark.parametrize("M", [0, 1, 5, 32, 67])
def test_q8_matmul_at_batch_and_prefill_sizes(kernels, M):
    check_matmul(kernels, M, M, 133, 20, strided=M % 2 == 1)


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


# Each format: its rounding, and the dtypes of its codes and scales.
FORMATS = {"q8": (q8_blocks, torch.int8, torch.float32), "q5": (q5_blocks, torch.uint8,
                                                                torch.float16)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_matmul_refuses_bad_shapes(kernels, fmt):
    blocks, codes, scales = FORMATS[fmt]
    pack, matmul = getattr(kernels, f"{fmt}_pack"), getattr(kernels, f"{fmt}_matmul")
    q, d = pack(*blocks(torch.randn(4, 64)))
    with pytest.raises(ValueError, match=f"{fmt}_matmul"):
        matmul(torch.randn(5, 160), q, d)  # packed for K = 64
    with pytest.raises(ValueError, match=f"{fmt}_matmul"):
        matmul(torch.randn(1, 64).half(), q, d)
    with pytest.raises(ValueError, match=f"{fmt}_matmul"):
        matmul(torch.randn(2, 128)[:, ::2], q, d)  # no unit stride within a row
    with pytest.raises(ValueError, match=f"{fmt}_pack"):
        pack(torch.zeros(4, 48, dtype=codes), torch.zeros(4, 1, dtype=scales))


@pytest.mark.parametrize("k", [32, 96, 640])
def test_q8_quantize_packs_what_q8_blocks_rounds(kernels, k: int) -> None:
    """The C rounding gives the torch reference's blocks bit for bit, zero blocks too."""
    torch.manual_seed(k)
    w = torch.randn(37, k) * 0.05
    w[3, :32] = 0.0  # a block whose scale is 0
    w[5, 7] = 3.0  # an outlier sets its block's scale
    got = kernels.q8_quantize(w)
    want = kernels.q8_pack(*q8_blocks(w))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="q8_quantize"):
        kernels.q8_quantize(torch.zeros(4, 48))


@pytest.mark.parametrize("fmt", ["q8", "q5"])
@pytest.mark.parametrize("M", [1, 6])
def test_bfloat16_rows_give_the_float32_result_rounded(kernels, fmt, M):
    """bf16 rows in, bf16 out (what a bf16 model's layers pass): the float32 path's result
    rounded to nearest even, bit for bit, strided rows too."""
    g = torch.Generator().manual_seed(M)
    _, matmul = _quantized_weight(kernels, fmt, g, 77, 96)
    x = torch.randn(M, 104, generator=g).bfloat16()[:, :96]
    got = matmul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (M, 77)
    assert torch.equal(got, matmul(x.float()).bfloat16())
