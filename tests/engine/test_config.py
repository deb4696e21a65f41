"""Engine settings that need no model."""

import pytest
import torch

from kvserve.engine.engine import resolve_dtype

CPU = torch.device("cpu")


def test_auto_dtype_is_bf16_where_the_cpu_runs_it_natively():
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert resolve_dtype("auto", CPU) == (torch.bfloat16 if native else torch.float32)


def test_named_and_given_dtypes_pass_through():
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype(torch.float16, CPU) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("bogus", CPU)
