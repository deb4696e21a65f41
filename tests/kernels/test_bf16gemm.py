"""Our bf16 GEMM (bf16gemm.c: AMX's tiles where granted, vdpbf16ps elsewhere) against float64
sums of the same bf16 values, in every build that has it (on AMX machines the build without
AMX runs the vectors), and Bf16Gemm's choice between it and oneDNN."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cpu_features import bf16_native, cpu_flags
from kvserve.kernels.cpu import cpu_kernels
from kvserve.models.quant import Bf16Gemm, pack_weight


def check(kernels, seed: int, M: int, N: int, K: int, strided: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g)).bfloat16()
    x = torch.randn(M, K + 32 * strided, generator=g).bfloat16()[:, :K]  # a wider buffer's rows
    got = kernels.bf16_bound(kernels.bf16_pack(w))(x)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    # float32 sums of exact bf16 products, rounded once to bf16 (half an ulp: 2^-9 relative)
    want = x.double() @ w.double().T
    bound = 2.0**-8 * want.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((got.double() - want).abs() <= bound).all()
    return got


def with_bf16(kernels):
    if not kernels.bf16_ready():
        pytest.skip("this build has no native bf16 (AVX-512 BF16)")
    return kernels


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), M=st.integers(0, 150), stripes=st.integers(1, 7),
       blocks=st.integers(1, 24), strided=st.booleans())
def test_bf16_matmul_matches_the_sums_of_its_bf16_values(kernels, seed, M, stripes, blocks,
                                                         strided):
    """Any M (tiles: 16 rows and a zero-padded remainder; vectors: 8 rows and a partial
    tile, K in blocks up to 64 rows and whole above), N in stripes of 16 (tiles: pairs and
    an odd last one; vectors: threes and a partial group), K any multiple of 32, rows with
    a stride wider than K (odd ones too: an activation pair need not be 4-byte aligned)."""
    check(with_bf16(kernels), seed, M, 16 * stripes, 32 * blocks, strided)


@pytest.mark.parametrize(("M", "N", "K"), [(32, 1536, 640), (17, 640, 2048), (300, 48, 64),
                                           (100, 4096, 640), (260, 16384, 64),
                                           (260, 16400, 64)])
def test_bf16_matmul_at_gemma_shapes_past_a_row_block_and_streamed(kernels, M, N, K):
    """Gemma 3 270M's projections at a batch step; more rows than one pass (tiles: 256,
    vectors: 128); outputs over 8 MiB, which the tiles store bypassing the caches when each
    row starts on a 64-byte line (N a multiple of 32) and plainly when not."""
    check(with_bf16(kernels), M, M, N, K, False)


def test_bf16_matmul_takes_odd_row_strides(kernels):
    """Rows one bf16 apart from 4-byte alignment (ldx odd) give the contiguous rows' result."""
    kernels = with_bf16(kernels)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g).bfloat16()
    buf = torch.randn(9 * 65, generator=g).bfloat16()
    x = buf.as_strided((9, 64), (65, 1))
    bound = kernels.bf16_bound(kernels.bf16_pack(w))
    assert torch.equal(bound(x), bound(x.contiguous()))


@pytest.mark.parametrize(("M", "N"), [(5, 1536), (32, 4096), (17, 640)])
def test_bf16_matmul_gives_onednns_sums_at_gemmas_width(kernels, M, N):
    """The same products summed in oneDNN's float32 order at K = 640 (Gemma 3 270M's hidden
    size): on the tiles bitwise up to 32 rows; with vectors at most one output in a
    thousand a rounding apart (oneDNN's vector kernel splits K differently at some sizes).
    Swapping the kernel in does not move a greedy token there."""
    kernels = with_bf16(kernels)
    g = torch.Generator().manual_seed(M)  # check's weights and rows for this seed
    w = (torch.randn(N, 640, generator=g) * torch.rand(N, 1, generator=g)).bfloat16()
    x = torch.randn(M, 640, generator=g).bfloat16()
    if not bf16_native():
        pytest.skip("oneDNN emulates bf16 here (masked CPU features): no order to compare")
    onednn = torch.ops.mkldnn._linear_pointwise(x, pack_weight(w), None, "none", [], "")
    got = check(kernels, M, M, N, 640, False)
    if kernels.amx_ready():
        assert torch.equal(got, onednn)
        return
    assert (got != onednn).float().mean() <= 1e-3  # (and each within check's bound)


def test_builds_say_what_they_run(kernels, request):
    """The machine's build and the one without AMX run the GEMM where the CPU has AVX-512
    BF16, the tiles only in the machine's build on AMX CPUs; builds without AVX-512 (the
    portable paths) say so and take no call."""
    build = request.node.callspec.params["kernels"]
    flags = cpu_flags()
    has_avx512 = build in ("native", "no-amx") and "avx512f" in flags  # conftest.BUILDS
    assert kernels.bf16_ready() == (has_avx512 and "avx512_bf16" in flags)
    if build != "native" or "amx_bf16" not in flags:
        assert not kernels.amx_ready()
    if not kernels.bf16_ready():
        with pytest.raises(ValueError, match="native bf16"):
            kernels.bf16_pack(torch.zeros(16, 32, dtype=torch.bfloat16))


@pytest.mark.skipif(not bf16_native(), reason="Bf16Gemm serves CPUs that compute bf16 natively")
@pytest.mark.parametrize("N", [48, 40])
def test_bf16_gemm_takes_our_kernel_where_it_fits_and_onednn_elsewhere(N):
    """Our kernel for N a multiple of 16 where the machine's build has native bf16; oneDNN
    for other widths and other builds. Both add the bias and agree with F.linear."""
    torch.manual_seed(N)
    w, b = torch.randn(N, 64).bfloat16(), torch.randn(N).bfloat16()
    gemm = Bf16Gemm(w)
    kernels = cpu_kernels()
    assert gemm.on_kernel == (kernels is not None and kernels.bf16_ready() and N % 16 == 0)
    assert not Bf16Gemm(w, use_kernel=False).on_kernel  # what benchmarks compare against
    for rows in (1, 5, 33, 70):
        x = torch.randn(rows, 64).bfloat16()
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        got = gemm(x, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
        assert ((got.float() - want).abs() <= 2e-2 * want.abs() + 5e-2).all()
