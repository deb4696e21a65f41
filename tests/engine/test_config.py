"""Engine settings that need no model."""

import warnings

import pytest
import torch

from kvserve.cpu_features import bf16_native
from kvserve.engine import engine as engine_module
from kvserve.engine.engine import resolve_dtype, resolve_kv_bytes

CPU = torch.device("cpu")


def test_auto_dtype_is_bf16_where_the_cpu_runs_it_natively():
    assert resolve_dtype("auto", CPU) == (torch.bfloat16 if bf16_native() else torch.float32)


def test_named_and_given_dtypes_pass_through():
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype(torch.float32, CPU) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("bogus", CPU)


def test_float16_is_refused_on_cpu_up_front():
    with pytest.raises(ValueError, match="not supported on CPU"):
        resolve_dtype(torch.float16, CPU)


def test_bf16_runs_and_says_why_it_is_slow_only_where_it_is_emulated():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    emulated = [w for w in caught if "emulated" in str(w.message)]
    assert len(emulated) == (0 if bf16_native() else 1)
    if emulated:
        assert "avx512_bf16" in str(emulated[0].message)


def test_page_size_is_the_models():
    from kvserve.engine.engine import pick_tokens_per_page
    from kvserve.sim.models import get_model

    llama = get_model("llama-3.1-8b").kv_specs()
    assert pick_tokens_per_page(llama, "jenga", None) == 16
    assert pick_tokens_per_page(llama, "jenga", 4) == 4  # as asked
    # Bamba 9B: 29 Mamba layers of 2,147,840 B of state: no 16-token page tiles with it
    # in 256 pages; 32-token pages do, the state page padded 0.4%.
    bamba = get_model("bamba-9b").kv_specs()
    assert pick_tokens_per_page(bamba, "jenga", None) == 32


def test_a_kv_fraction_leaves_what_the_model_will_still_take(monkeypatch):
    """q8+fp16 makes its fp16 copies at the first large step, after the pool is sized: a
    fraction of the free memory is taken of what they will leave, and bytes given outright
    stay as given."""
    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(engine_module.os, "sysconf", pages.__getitem__)
    cpu = torch.device("cpu")
    assert resolve_kv_bytes(0.5, cpu) == 2048000
    assert resolve_kv_bytes(0.5, cpu, reserved=96000) == 2000000
    assert resolve_kv_bytes(0.5, cpu, reserved=10**9) == 0
    assert resolve_kv_bytes(12345, cpu, reserved=10**9) == 12345
