"""The Q5_0 matmul (qmatmul.c) against torch on the dequantized weights, its packing and
rounding against kernels/q5.py, and q5_blocks against the GGUF's own Q5_0 tensors."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hf_reference import gguf_reader
from hypothesis import given, settings
from hypothesis import strategies as st
from test_qmatmul import check_matmul, random_q5

from kvserve.kernels.q5 import q5_blocks, q5_dequantize


# Any M (tiles of 4 rows and their remainders), N not a multiple of the 2-column tile or of
# the 64-column chunk, K a multiple of 32 but not of the 128 the weights are padded to.
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), M=st.integers(1, 13), N=st.integers(1, 150),
       blocks=st.integers(1, 24), strided=st.booleans())
def test_q5_matmul_matches_dequantized_torch(kernels, seed, M, N, blocks, strided):
    check_matmul(kernels, seed, M, N, blocks, strided, "q5")


@pytest.mark.parametrize("M", [0, 1, 5, 32, 67])
def test_q5_matmul_at_batch_and_prefill_sizes(kernels, M):
    check_matmul(kernels, M, M, 133, 20, M % 2 == 1, "q5")


def test_q5_matmul_at_gemma_shapes(kernels):
    """Gemma 3 270M's K (640, five groups; 2048, sixteen) at decode and batch sizes."""
    for M, N, K in [(1, 1024, 640), (3, 640, 2048), (32, 256, 640)]:
        check_matmul(kernels, K, M, N, K // 32, False, "q5")


@pytest.mark.parametrize("M", [1, 7, 8, 33])
def test_q5_matmul_equals_q8_on_the_same_values(kernels, M):
    """Q5_0 weights give bitwise what Q8_0 blocks of the same values give (the codes
    decode to Q8_0's int16 values, the fp16 scales to the same floats), for one row
    (one column at a time), a tile's remainder and whole tiles: any other way to read
    Q5_0 (docs/benchmarks.md tried expanding chunks first) has to keep this."""
    g = torch.Generator().manual_seed(M)
    codes, d = random_q5(g, 150, 640)
    x = torch.randn(M, 640, generator=g)
    q5 = kernels.q5_matmul(x, *kernels.q5_pack(codes, d))
    q8 = kernels.q8_matmul(x, *kernels.q8_pack((codes.int() - 16).to(torch.int8), d.float()))
    assert torch.equal(q5, q8)


def test_q5_blocks_follows_llama_cpp_rule():
    """The block's largest |w| sets d (its sign too) and gets code 0; halves round up."""
    w = torch.zeros(2, 32)
    w[0, :4] = torch.tensor([0.5, -2.0, 1.0, 0.0625])
    w[0, 4] = 2.0  # same magnitude as -2.0, later: the first one sets the sign
    w[0, 5] = -0.0625
    codes, d = q5_blocks(w)
    assert d[0].item() == 0.125 and codes[0, 1] == 0 and codes[0, 4] == 31  # 16 + 16 capped
    assert codes[0, 0] == 20 and codes[0, 2] == 24 and codes[0, 6] == 16
    assert codes[0, 3] == 17 and codes[0, 5] == 16  # +-0.5 + 16.5: 17 and 16
    assert d[1].item() == 0 and (codes[1] == 16).all()  # a zero block


@pytest.mark.parametrize("k", [32, 96, 640])
def test_q5_quantize_packs_what_q5_blocks_rounds(kernels, k: int) -> None:
    """The C rounding gives the torch reference's blocks bit for bit, zero blocks too."""
    torch.manual_seed(k)
    w = torch.randn(37, k) * 0.05
    w[3, :32] = 0.0  # a block whose scale is 0
    w[5, 7] = 3.0  # an outlier sets its block's scale
    w[6, :32] = torch.arange(-16, 16) * 0.25  # exact grid values: .5 ties in w / d + 16.5
    q, d, inexact = kernels.q5_quantize(w)
    want = kernels.q5_pack(*q5_blocks(w))
    assert torch.equal(q, want[0]) and torch.equal(d, want[1])
    assert inexact > 0  # random weights are not on a Q5_0 grid
    assert kernels.q5_quantize(q5_dequantize(*q5_blocks(w)))[2] == 0  # but their blocks are
    with pytest.raises(ValueError, match="q5_quantize"):
        kernels.q5_quantize(torch.zeros(4, 48))


@pytest.fixture(scope="session")
def gguf_q5(gguf_path: Path) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, raw blocks [rows, blocks, 22], dequantized float32 [rows, K]) of each Q5_0
    tensor in the file: once for the session, since pytest runs this module once per build
    of the session-scoped `kernels` and would set a module-scoped fixture up again each
    time; the file is parsed once for the session too (gguf_reader, shared with HF's load)."""
    tensors = []
    for t in gguf_reader(gguf_path).tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q5_0:
            rows = int(np.prod(t.shape[1:]))
            raw = np.asarray(t.data).reshape(rows, -1, 22)
            tensors.append((t.name, raw, gguf.dequantize(t.data, t.tensor_type).reshape(rows, -1)))
    return tensors


def raw_q5(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF block_q5_0 (fp16 d, 32 fifth bits, 16 bytes of nibbles: values j and j + 16
    share byte j) as codes [rows, K] and scales [rows, blocks]."""
    d = torch.from_numpy(raw[..., :2].copy().view(np.float16)[..., 0])
    high = np.unpackbits(raw[..., 2:6], axis=-1, bitorder="little")
    low = np.concatenate([raw[..., 6:] & 15, raw[..., 6:] >> 4], axis=-1)
    codes = (low | high << 4).reshape(raw.shape[0], -1)
    return torch.from_numpy(codes), d


def test_gguf_q5_0_tensors_round_trip_exactly(gguf_q5) -> None:
    """Gemma 3 270M's Q5_0 tensors (every one), dequantized as the loader does, give the
    file's own codes and scales back: served as Q5_0 they are not rounded again."""
    assert gguf_q5
    for name, raw, w in gguf_q5:
        codes, d = raw_q5(raw)
        got_codes, got_d = q5_blocks(torch.from_numpy(w))
        assert torch.equal(got_codes, codes), name
        assert torch.equal(got_d.view(torch.int16), d.view(torch.int16)), name


def test_q5_quantize_round_trips_gguf_tensors(gguf_q5, kernels) -> None:
    """The C rounding too gives the file's blocks back, on the first few Q5_0 tensors."""
    for name, raw, w in gguf_q5[:5]:
        q, d, inexact = kernels.q5_quantize(torch.from_numpy(w))
        want = kernels.q5_pack(*raw_q5(raw))
        assert torch.equal(q, want[0]) and torch.equal(d, want[1]) and inexact == 0, name
