"""The AMX bf16 GEMM (amx.c) against float64 sums of the same bf16 values, and Bf16Gemm's
choice between it and oneDNN."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cpu_features import bf16_native, cpu_flags, masked
from kvserve.kernels.cpu import cpu_kernels
from kvserve.models.quant import Bf16Gemm, amx, pack_weight

AMX = "amx_bf16" in cpu_flags()
needs_amx = pytest.mark.skipif(not AMX or cpu_kernels() is None or not cpu_kernels().amx_ready(),
                               reason="needs AMX-BF16 (and the C kernels, and Linux's tiles)")


def check(kernels, seed: int, M: int, N: int, K: int, strided: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g)).bfloat16()
    x = torch.randn(M, K + 32 * strided, generator=g).bfloat16()[:, :K]  # a wider buffer's rows
    got = kernels.amx_bound(kernels.amx_pack(w))(x)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    # float32 sums of exact bf16 products, rounded once to bf16 (half an ulp: 2^-9 relative)
    want = x.double() @ w.double().T
    bound = 2.0**-8 * want.abs() + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((got.double() - want).abs() <= bound).all()
    return got


@needs_amx
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), M=st.integers(0, 70), stripes=st.integers(1, 7),
       blocks=st.integers(1, 24), strided=st.booleans())
def test_amx_matmul_matches_the_sums_of_its_bf16_values(seed, M, stripes, blocks, strided):
    """Any M (tiles of 16 rows and a zero-padded remainder, pairs of 16-row tiles), N in
    stripes of 16 (pairs, and an odd last one), K any multiple of 32."""
    check(cpu_kernels(), seed, M, 16 * stripes, 32 * blocks, strided)


@needs_amx
@pytest.mark.parametrize(("M", "N", "K"), [(32, 1536, 640), (17, 640, 2048), (300, 48, 64),
                                           (260, 16384, 64), (260, 16400, 64)])
def test_amx_matmul_at_gemma_shapes_past_a_row_block_and_streamed(M, N, K):
    """Gemma 3 270M's projections at a batch step; more rows than one pass (256); outputs
    over 8 MiB, which bypass the caches (streamed) when each row starts on a 64-byte line
    (N a multiple of 32) and are stored plainly when not."""
    check(cpu_kernels(), M, M, N, K, False)


@needs_amx
@pytest.mark.parametrize(("M", "N"), [(5, 1536), (32, 4096), (17, 640)])
def test_amx_matmul_gives_onednns_sums_at_gemmas_width(M, N):
    """The same products summed in the same order as oneDNN's bf16 GEMM at K = 640 (Gemma 3
    270M's hidden size): swapping the kernel in does not move a greedy token there."""
    g = torch.Generator().manual_seed(M)
    w, x = torch.randn(N, 640, generator=g).bfloat16(), torch.randn(M, 640, generator=g).bfloat16()
    onednn = torch.ops.mkldnn._linear_pointwise(x, pack_weight(w), None, "none", [], "")
    kernels = cpu_kernels()
    assert torch.equal(kernels.amx_bound(kernels.amx_pack(w))(x), onednn)


def test_builds_without_amx_refuse(kernels, request):
    """Builds without AMX (other CPUs, the portable paths) say so and take no call."""
    if request.node.callspec.params["kernels"] == "native" and AMX and not masked():
        assert kernels.amx_ready()
        return
    assert not kernels.amx_ready()
    with pytest.raises(ValueError, match="on AMX"):
        kernels.amx_pack(torch.zeros(16, 32, dtype=torch.bfloat16))


@pytest.mark.skipif(not bf16_native(), reason="Bf16Gemm serves CPUs that compute bf16 natively")
@pytest.mark.parametrize("N", [48, 40])
def test_bf16_gemm_takes_amx_where_it_fits_and_onednn_elsewhere(N):
    """AMX for N a multiple of 16 on AMX CPUs; oneDNN for other widths and other CPUs. Both
    add the bias and agree with F.linear."""
    torch.manual_seed(N)
    w, b = torch.randn(N, 64).bfloat16(), torch.randn(N).bfloat16()
    gemm = Bf16Gemm(w)
    assert gemm.on_amx == (amx() and N % 16 == 0 and cpu_kernels() is not None)
    assert not Bf16Gemm(w, use_amx=False).on_amx  # what benchmarks compare against
    for rows in (1, 5, 33):
        x = torch.randn(rows, 64).bfloat16()
        want = torch.nn.functional.linear(x.float(), w.float(), b.float())
        got = gemm(x, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
        assert ((got.float() - want).abs() <= 2e-2 * want.abs() + 5e-2).all()
