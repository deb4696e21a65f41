"""Packed fp16 / int8 weights (fbgemm): each against float32, the rules of auto, and the
real model's predictions against its float32 self."""

from __future__ import annotations

import pytest
import torch
from hf_reference import KvModel, ledger_text

from kvserve.cpu_features import bf16_native, cpu_flags
from kvserve.kernels.cpu import cpu_kernels
from kvserve.kernels.q5 import q5_blocks, q5_dequantize
from kvserve.models import Gemma3ForCausalLM
from kvserve.models.attention_ref import sequence_logits
from kvserve.models.quant import (
    I8Linear,
    Q5Linear,
    Q8Bf16Linear,
    Q8Fp16Linear,
    Q8I8Linear,
    Q8Linear,
    dequantized,
    fbgemm_available,
    q8_blocks,
    quantized,
    resolve_quantization,
    serves_i8_head,
    serves_q5,
)

pytestmark = pytest.mark.skipif(not fbgemm_available(),
                                reason="fbgemm needs an x86 CPU with AVX2")
CPU = torch.device("cpu")
GGUF_TYPES = ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.parametrize("tokens", [1, 5, 32])
def test_packed_linears_against_float32(tokens: int) -> None:
    torch.manual_seed(tokens)
    w = torch.randn(300, 640) * 0.05
    # A token with a 50x outlier: per-token activation scales keep the others accurate.
    x = torch.randn(tokens, 640)
    x[0] *= 50
    want = x @ w.T
    assert rel_err(quantized(w, "fp16")(x), want) < 1e-3
    assert rel_err(quantized(w, "q8")(x), want) < 0.01
    assert rel_err(quantized(w, "int8")(x), want) < 0.03
    # bf16 activations come back as bf16, computed from the same packed weight.
    out = quantized(w, "fp16")(x.bfloat16())
    assert out.dtype == torch.bfloat16 and rel_err(out, want) < 0.01


@pytest.mark.parametrize("kind", ["fp16", "q8", "int8"])
def test_a_step_that_samples_nothing_runs_the_head_on_zero_rows(kind: str) -> None:
    """A prefill chunk that does not finish its prompt gives the LM head no rows."""
    w = torch.randn(300, 640) * 0.05
    assert quantized(w, kind)(torch.randn(0, 640)).shape == (0, 300)


@pytest.mark.skipif(cpu_kernels() is None, reason="q8 needs the C kernels")
def test_q8_serves_a_q5_0_weight_in_its_own_blocks() -> None:
    """A weight on a Q5_0 grid (a GGUF's Q5_0 tensor, dequantized) is read as Q5_0, with
    nothing rounded again, where the CPU has AVX-512BW; any other as Q8_0."""
    torch.manual_seed(0)
    w5 = q5_dequantize(*q5_blocks(torch.randn(300, 640) * 0.05))
    x = torch.randn(3, 640)
    q5 = quantized(w5, "q8")
    if "avx512bw" not in cpu_flags():
        assert isinstance(q5, Q8Linear)
        return
    assert isinstance(q5, Q5Linear) and q5.nbytes() == 300 * 640 * 11 // 16
    assert rel_err(q5(x), x @ w5.T) < 1e-4  # only the int16 rounding of x
    assert isinstance(quantized(torch.randn(300, 640), "q8"), Q8Linear)
    if bf16_native():
        hybrid = quantized(w5, "q8+bf16")
        assert isinstance(hybrid, Q8Bf16Linear) and isinstance(hybrid.q8, Q5Linear)
        assert torch.equal(hybrid(x), q5(x))


def test_auto_keeps_what_the_file_ships_without_losing_quality() -> None:
    kernels = cpu_kernels() is not None
    assert resolve_quantization("auto", CPU, GGUF_TYPES) == ("q8+fp16" if kernels else "fp16")
    bf16 = "q8+bf16" if kernels else "none"
    expect = bf16 if bf16_native() else "q8+fp16" if kernels else "fp16"
    assert resolve_quantization("auto", CPU, GGUF_TYPES, torch.bfloat16) == expect
    assert resolve_quantization("auto", CPU, ["F32"]) == "none"
    assert resolve_quantization("auto", CPU, []) == "none"
    assert resolve_quantization("auto", torch.device("cuda"), GGUF_TYPES) == "none"
    assert resolve_quantization("int8", CPU, []) == "int8"


@pytest.mark.skipif(not bf16_native() or cpu_kernels() is None,
                    reason="q8+bf16 needs native bf16 (AVX-512 BF16 or AMX) and the C kernels")
def test_q8_bf16_reads_q8_for_a_few_rows_and_bf16_for_batches() -> None:
    torch.manual_seed(0)
    w = torch.randn(300, 640) * 0.05
    hybrid, q8 = quantized(w, "q8+bf16"), quantized(w, "q8")
    assert hybrid.SMALL == (4 if "amx_bf16" in cpu_flags() else 8)  # bf16 from 5 or 9 rows
    for rows in (1, 4, 5, 8, 9, 16, 17, 64):
        x = torch.randn(rows, 640, dtype=torch.bfloat16)
        got = hybrid(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 300)
        want_bf16 = torch.nn.functional.linear(x, w.bfloat16())
        if rows <= hybrid.SMALL:  # the Q8_0 copy: exactly what q8 alone gives
            assert torch.equal(got, q8(x))
        else:  # the bf16 GEMM on the bf16 copy (N = 300: oneDNN)
            assert rel_err(got, want_bf16.float()) < 1e-2
            assert not torch.equal(got, q8(x))
    assert hybrid(torch.randn(0, 640)).shape == (0, 300)
    assert hybrid.nbytes() == q8.nbytes() + 300 * 640 * 2


def split_calls(hybrid, q8, large, row_counts) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    """A two-copy layer on float32 and bf16 rows: bit for bit its Q8_0 copy (what q8 alone
    gives) up to SMALL rows, its large copy above. The large calls' (rows, outputs)."""
    large_calls = []
    for rows in row_counts:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, hybrid.in_features).to(dtype)
            got = hybrid(x)
            assert got.dtype == dtype and got.shape == (rows, hybrid.out_features)
            if rows <= hybrid.SMALL:
                assert torch.equal(got, q8(x))
            else:
                assert torch.equal(got, large(x)) and not torch.equal(got, q8(x))
                large_calls.append((x, got))
    return large_calls


@pytest.mark.skipif(cpu_kernels() is None, reason="q8+fp16 needs the C kernels")
def test_q8_fp16_reads_q8_for_a_few_rows_and_fp16_for_batches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvserve.models.quant as quant

    monkeypatch.setattr(quant, "fp16_small", lambda n, k: 8)  # as if fp16 won from 16 rows
    torch.manual_seed(0)
    w = torch.randn(300, 640) * 0.05
    hybrid, q8 = quantized(w, "q8+fp16"), quantized(w, "q8")
    assert isinstance(hybrid, Q8Fp16Linear) and hybrid.SMALL == 8
    assert hybrid.pending_bytes() == 300 * 640 * 2  # the fp16 copy is made at first use
    w8 = dequantized(q8).half().float()  # the values both copies compute with
    # above SMALL rows: fbgemm's fp16 GEMM over the Q8_0 copy's values
    for x, got in split_calls(hybrid, q8, hybrid.large, (1, 8, 9, 64)):
        assert rel_err(got, x.float() @ w8.T) < (1e-5 if x.dtype == torch.float32 else 1e-2)
    assert hybrid(torch.randn(0, 640)).shape == (0, 300)
    assert hybrid.nbytes() == q8.nbytes() + 300 * 640 * 2 and hybrid.pending_bytes() == 0
    assert hybrid.packed_state().keys() == q8.packed_state().keys()  # saved as q8 is
    # A shape where fp16 is no faster on this CPU keeps its Q8_0 copy alone.
    monkeypatch.setattr(quant, "fp16_small", lambda n, k: None)
    assert isinstance(quantized(w, "q8+fp16"), Q8Linear)


@pytest.mark.skipif(cpu_kernels() is None, reason="block copies need the C kernels")
def test_dequantized_gives_back_the_values_the_blocks_hold() -> None:
    torch.manual_seed(0)
    # K = 608: the packed rows carry a padding block past K
    q, d = q8_blocks(torch.randn(300, 608) * 0.05)
    w8 = (q.float().view(300, 19, 32) * d[..., None]).view(300, 608)  # on the Q8_0 grid
    assert torch.equal(dequantized(Q8Linear(w8)), w8)
    w5 = q5_dequantize(*q5_blocks(w8))  # Q5_0 blocks (served where the CPU has AVX-512BW)
    assert torch.equal(dequantized(Q5Linear(w5)), w5)


@pytest.mark.skipif(bf16_native(), reason="this CPU computes bf16 natively")
def test_q8_bf16_is_refused_where_bf16_is_emulated() -> None:
    with pytest.raises(ValueError, match="computes bf16 natively"):
        resolve_quantization("q8+bf16", CPU, GGUF_TYPES, torch.bfloat16)


@pytest.mark.skipif(cpu_kernels() is None, reason="q8+int8 needs the C kernels")
def test_q8_int8_reads_q8_for_a_few_rows_and_int8_blocks_for_batches() -> None:
    torch.manual_seed(0)
    w = torch.randn(304, 640) * 0.05
    hybrid, q8 = quantized(w, "q8+int8"), quantized(w, "q8")
    assert isinstance(hybrid, Q8I8Linear)
    for x, got in split_calls(hybrid, q8, hybrid.large, (1, 16, 17, 64)):  # int8 blocks above
        assert rel_err(got, x.float() @ w.T) < 0.02
    assert hybrid(torch.randn(0, 640)).shape == (0, 304)
    assert hybrid.nbytes() == q8.nbytes() + 304 * 640 + 304 * 20 * 4
    # i8matmul.c takes columns 16 at a time: any other count is served by q8 alone.
    assert isinstance(quantized(torch.randn(300, 640), "q8+int8"), Q8Linear)
    # A Q5_0 weight keeps its own blocks for a few rows and gets an int8 copy beside them.
    w5 = q5_dequantize(*q5_blocks(w))
    if serves_q5():
        small = quantized(w5, "q8+int8").q8
        assert isinstance(small, Q5Linear)
    assert isinstance(quantized(w5, "q8+int8").large, I8Linear)


ALL_Q8 = {"q8", "q8+bf16", "q8+int8"}


@pytest.mark.parametrize(("flags", "measured", "i8_in"), [
    ({"avx2", "fma", "avx512_vnni"}, False, ALL_Q8),  # VNNI: not measured
    ({"avx2", "fma", "avx512_vnni", "amx_bf16"}, False, {"q8", "q8+int8"}),  # its bf16 copy
    ({"avx2", "fma"}, True, ALL_Q8),  # AVX2: where i8matmul.c measured faster than int16
    ({"avx2", "fma"}, False, set()),
    ({"avx2", "fma", "avx512bw"}, True, set()),  # no VNNI: the int16 kernel's wider vectors
])
def test_the_head_takes_int8_blocks_where_they_are_the_fastest_batch_copy(
        monkeypatch: pytest.MonkeyPatch, flags: set[str], measured: bool,
        i8_in: set[str]) -> None:
    import kvserve.models.quant as quant

    monkeypatch.setattr(quant, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(quant, "i8_wins", lambda: measured)
    for mode in ("q8", "q8+bf16", "q8+int8"):
        assert serves_i8_head(mode, 262144) == (mode in i8_in)
        assert not serves_i8_head(mode, 262144 + 8)  # i8matmul.c takes 16 columns at a time


def test_bad_choices_are_refused_up_front() -> None:
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_quantization("int3", CPU, GGUF_TYPES)
    with pytest.raises(ValueError, match="runs on CPUs"):
        resolve_quantization("int8", torch.device("cuda"), GGUF_TYPES)


def predictions(model: Gemma3ForCausalLM, ids: list[int], step: int | None = None):
    return sequence_logits(model, ids, step).argmax(-1)


@pytest.mark.slow
def test_real_model_quantized_predicts_like_float32(kv: KvModel) -> None:
    ids = kv.tokenizer(ledger_text(12)).input_ids[:120]
    want = predictions(kv.model, ids)
    agreement = {}
    for mode in ("q8", "q8+fp16", "fp16", "int8", "q8+int8"):
        model = Gemma3ForCausalLM.from_state_dict(kv.config, dict(kv.state_dict))
        held = model.quantize(mode)
        assert model.model.layers[0].mlp.down_proj.weight.is_meta  # float copy dropped
        head = kv.state_dict["model.embed_tokens.weight"]
        # Where serves_i8_head, the head has q8+int8's second copy (int8 blocks: 1.125 bytes
        # a weight) in every q8 mode.
        second = 1.13 * head.numel() if serves_i8_head(mode, head.shape[0]) else 0
        assert held <= second + {"q8": 1.13, "q8+fp16": 3.13, "fp16": 2, "int8": 1.1,
                                 "q8+int8": 2.3}[mode] * sum(
            w.numel() for n, w in kv.state_dict.items() if n.endswith("proj.weight")
            or n == "model.embed_tokens.weight")
        agreement[mode] = float((predictions(model, ids) == want).float().mean())
    # Measured 98.8% (q8), 99.98% (fp16) and 82.6% (int8) on ShareGPT text
    # (benchmarks/quant_quality.py); a wrong scale or layout agrees on almost nothing.
    assert agreement["fp16"] >= 0.98 and agreement["q8"] >= 0.97, agreement
    assert agreement["q8+fp16"] >= 0.97, agreement
    assert agreement["int8"] >= 0.6, agreement
    # q8+int8 (whole texts at once: its int8 copy) measured 97.4% there.
    assert agreement.get("q8+int8", 1.0) >= 0.95, agreement
