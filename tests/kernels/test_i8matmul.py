"""The int8 x int8 block matmul (i8matmul.c) against float64 sums of the same blocks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kernels.cpu import cpu_kernels
from kvserve.models.quant import q8_blocks


def _dequantized(t: torch.Tensor) -> torch.Tensor:
    """t rounded to Q8_0 blocks of 32 (what i8_pack does to weights and i8_matmul to rows),
    back as float64."""
    q, d = q8_blocks(t)
    return (q.double().view(*d.shape, 32) * d.double()[..., None]).view(t.shape)


def check(kernels, seed: int, M: int, N: int, blocks: int, strided: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    K = 32 * blocks
    w = torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g)
    w[0, :32] = 0.0  # a zero block: scale 0
    x = torch.randn(M, K + 8 * strided, generator=g)[:, :K]  # rows of a wider buffer
    if M:
        x[0, 1] *= 40  # an outlier sets its block's scale, not the row's
    packed = kernels.i8_pack(w)
    got = kernels.i8_matmul(x, *packed)
    assert got.shape == (M, N) and got.dtype == torch.float32
    # Both sides' blocks are summed exactly in int32; only float32 scaling and summing of
    # the blocks remain.
    xd, wd = _dequantized(x), _dequantized(w)
    want = xd @ wd.T
    assert ((got.double() - want).abs() <= 1e-5 * (xd.abs() @ wd.abs().T) + 1e-6).all()
    # bf16 rows in, bf16 out: the float32 result of the same rows, rounded to nearest even.
    xb = x.bfloat16()
    assert torch.equal(kernels.i8_matmul(xb, *packed), kernels.i8_matmul(xb.float(), *packed)
                       .bfloat16())


# Any M (tiles of 4 rows and their remainders), N of 1-10 vectors of 16 (tiles of 3 and
# their remainders), K any multiple of 32.
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), M=st.integers(0, 13), vectors=st.integers(1, 10),
       blocks=st.integers(1, 24), strided=st.booleans())
def test_i8_matmul_matches_the_blocks_it_rounds_to(kernels, seed, M, vectors, blocks, strided):
    check(kernels, seed, M, 16 * vectors, blocks, strided)


@pytest.mark.parametrize(("M", "N", "K"), [(32, 1536, 640), (17, 640, 2048), (300, 48, 64)])
def test_i8_matmul_at_gemma_shapes_and_past_a_row_block(kernels, M, N, K):
    """Gemma 3 270M's projections at a batch step, and more rows than one pass (256)."""
    check(kernels, K, M, N, K // 32, False)


def test_the_vector_paths_agree_bit_for_bit():
    """AVX2's sums (vpmaddubsw on |x| and the weights carrying x's sign) are the VNNI paths'
    integers, scaled and summed in the same order, so the AVX-512 VNNI, AVX-VNNI and AVX2
    builds give the same bits; also for an output past 8 MB, which is streamed past the
    caches (17 rows of a 262k-row head, float32 and bf16)."""
    builds = [cpu_kernels(flags) for flags in
              [(), ("-mno-avx512f",), ("-mno-avx512f", "-mno-avxvnni")]]
    if None in builds:
        pytest.skip("a build did not compile here")
    g = torch.Generator().manual_seed(7)
    for M, N, K in [(5, 48, 640), (17, 262144, 32)]:
        w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
        packed = builds[0].i8_pack(w)
        got = [k.i8_matmul(x, *packed) for k in builds]
        assert all(torch.equal(got[0], y) for y in got[1:])
    for k in builds:  # the streamed outputs are the right ones
        check(k, 3, 17, 262144, 1, False)


def unpack(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The weights i8_pack's layout holds. Columns go in tiles of 3 vectors of 16 (fewer in
    the last tile); a tile's vectors are interleaved word by word: column n's value k is at
    word k // 4 of its vector, lane n % 16, byte k % 4, stored plus 128. Scales: vector n // 16,
    block k // 32, lane n % 16."""
    N, K = q.shape
    n, k = torch.meshgrid(torch.arange(N), torch.arange(K), indexing="ij")
    tile, vectors = n // 48, N // 16
    in_tile = torch.clamp(vectors - 3 * tile, max=3)
    at = tile * 48 * K + ((k // 4) * in_tile + n % 48 // 16) * 64 + (n % 16) * 4 + k % 4
    values = q.flatten()[at].int() - 128
    scales = d.flatten()[(n // 16) * (K // 32) * 16 + (k // 32) * 16 + n % 16]
    return values * scales


def test_i8_pack_keeps_q8_0_weights_exactly(kernels):
    """A weight on a Q8_0 grid (the GGUF's own Q8_0 tensors, such as Gemma 3's embedding)
    is packed without rounding, and any weight as q8_blocks rounds it."""
    torch.manual_seed(0)
    q, d = q8_blocks(torch.randn(80, 96))  # a tile of 3 vectors, then one of 2
    w = (q.float().view(80, 3, 32) * d[..., None]).view(80, 96)
    assert torch.equal(unpack(*kernels.i8_pack(w)), w)
    other = torch.randn(32, 64)
    other[1, :32] = 0.0
    assert torch.equal(unpack(*kernels.i8_pack(other)), _dequantized(other).float())


def test_i8_shapes_it_cannot_take_are_refused(kernels):
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.i8_pack(torch.randn(40, 64))
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.i8_pack(torch.randn(48, 40))
    packed = kernels.i8_pack(torch.randn(48, 64))
    with pytest.raises(ValueError, match="i8_matmul"):
        kernels.i8_matmul(torch.randn(3, 96), *packed)
    with pytest.raises(ValueError, match="i8_matmul"):
        kernels.i8_matmul(torch.randn(3, 64).half(), *packed)
