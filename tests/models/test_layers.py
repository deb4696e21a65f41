"""layers.linear's float32 path for a few rows: weight @ rows.T."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.models import layers
from kvserve.models.layers import TALL_ROWS, Derived, linear
from kvserve.models.quant import Bf16Gemm


@pytest.fixture(scope="module")
def head() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(TALL_ROWS, 64) * 0.05


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (1, 64), (2, 64), (1, 5, 64),
                                   (3, 4, 64), (16, 64), (17, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_few_rows_times_a_tall_weight_equal_f_linear(head, shape, with_bias) -> None:
    x = torch.randn(shape)
    bias = torch.randn(head.shape[0]) if with_bias else None
    with torch.inference_mode():
        got = linear(x, head, Derived(Bf16Gemm), bias)
    want = F.linear(x, head, bias)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_only_a_few_float32_rows_take_the_transposed_product(
        head, monkeypatch) -> None:
    taken = []
    real = layers._few_rows_transposed
    monkeypatch.setattr(layers, "_few_rows_transposed",
                        lambda *a: taken.append(a[0].shape[0]) or real(*a))
    short = head[: TALL_ROWS // 2]
    tiny = head[:256]
    with torch.inference_mode():
        for rows, weight in [(1, head), (16, head), (17, head), (4, short), (5, short),
                             (1, tiny)]:
            linear(torch.randn(rows, 64), weight, Derived(Bf16Gemm))
        linear(torch.randn(2, 64).double(), head.double(), Derived(Bf16Gemm))
    linear(torch.randn(2, 64), head, Derived(Bf16Gemm))  # autograd on: F.linear
    assert taken == [1, 16, 4]
