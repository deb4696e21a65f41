"""The saved packed model (models/packed.py): a warm start serves exactly what quantizing
from the float weights serves, and a file that is not right is rebuilt, never trusted."""

from __future__ import annotations

import errno
import os
import struct
import warnings
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvserve.cpu_features import bf16_native
from kvserve.kernels.cpu import CpuKernels, cpu_kernels
from kvserve.kernels.q5 import q5_blocks, q5_dequantize
from kvserve.models import Gemma3Config, Gemma3ForCausalLM, loader, packed, quant
from kvserve.models.attention_ref import sequence_logits
from kvserve.models.quant import serves_i8_head, serves_q5

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="q8 needs the C kernels")
MODES = [("q8", torch.float32), ("q8+fp16", torch.float32)] + (
    [("q8+bf16", torch.bfloat16), ("q8+int8", torch.bfloat16)] if bf16_native() else
    [("q8+int8", torch.float32)])
IDS = [2, 17, 99, 5, 250, 31, 64, 8, 120, 77, 13, 200, 150, 42, 9, 11, 23, 180, 55, 3]


def _tiny_state(vocab: int = 300) -> tuple[Gemma3Config, dict[str, torch.Tensor]]:
    """A tiny random Gemma 3 as float32 weights; K = 64 is padded to one 128-wide group. A
    vocabulary of 300 rows keeps the head off I8Linear (16 columns at a time), 304 not."""
    torch.manual_seed(0)
    config = Gemma3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k in state:  # Q5_0 already, as a GGUF's: served (and saved) as Q5_0 blocks
        if k.endswith(("gate_proj.weight", "up_proj.weight")):
            state[k] = q5_dequantize(*q5_blocks(state[k]))
    return config, state


@pytest.fixture
def entry(tmp_path: Path, request) -> tuple[Path, object, dict[str, torch.Tensor]]:  # noqa: ANN001
    """A converted-cache entry holding the tiny model's float weights (vocabulary: the
    parameter, else 300)."""
    config, state = _tiny_state(getattr(request, "param", 300))
    save_file(state, tmp_path / "model.safetensors")
    return tmp_path, config, state


def _opened(entry: tuple) -> loader.OpenedModel:
    path, config, state = entry
    return loader.OpenedModel(config, dict(state), path, path, Future())  # no tokenizer


def _from_float(config, state, mode: str, dtype: torch.dtype) -> Gemma3ForCausalLM:  # noqa: ANN001
    model = Gemma3ForCausalLM.from_state_dict(config, dict(state))
    model.quantize(mode)
    return model.to(dtype)


def _logits(model: Gemma3ForCausalLM) -> list[torch.Tensor]:
    # All 20 rows at once take q8+bf16's bf16 path (> 16 rows), one at a time its Q8_0 one.
    return [sequence_logits(model, IDS), sequence_logits(model, IDS[:6], step=1)]


def _warm(entry: tuple, mode: str, dtype: torch.dtype, monkeypatch) -> Gemma3ForCausalLM:  # noqa: ANN001
    """build_quantized where building from the float weights is not allowed."""
    with monkeypatch.context() as m:
        m.setattr(loader, "build_model", _refuse)
        return loader.build_quantized(_opened(entry), mode, dtype)


def _refuse(*_: object, **__: object) -> None:
    raise AssertionError("built from the float weights: the packed file was not used")


@pytest.mark.parametrize("entry", [300, 304], indirect=True)
@pytest.mark.parametrize(("mode", "dtype"), MODES)
def test_a_warm_start_serves_bit_identically_to_quantizing(entry, mode, dtype,
                                                           monkeypatch) -> None:
    path, config, state = entry
    if mode == "q8+fp16":  # its fp16 copy from 9 rows, whatever this CPU's timings say
        monkeypatch.setattr(quant, "fp16_small", lambda n, k: 8)
    want = _logits(_from_float(config, state, mode, dtype))
    cold = loader.build_quantized(_opened(entry), mode, dtype)  # quantizes, saves
    assert packed.packed_file(path, mode, dtype).is_file()
    warm = _warm(entry, mode, dtype, monkeypatch)
    assert warm.quantization == mode and warm.dtype == dtype
    assert warm.model.layers[0].mlp.down_proj.weight.is_meta  # no float copy
    small = [getattr(m.quant, "q8", m.quant) for m in (warm.model.layers[0].mlp.gate_up_proj,
                                                         warm.model.layers[0].mlp.down_proj)]
    assert [type(s).__name__ for s in small] == [
        "Q5Linear" if serves_q5() else "Q8Linear", "Q8Linear"]
    with safe_open(packed.packed_file(path, mode, dtype), "pt") as f:
        names = set(f.keys())
    assert f"{packed.HEAD}.bf16" not in names
    assert f"{packed.HEAD}.q" in names
    if serves_i8_head(mode, config.vocab_size):  # served as q8+int8 serves any linear
        assert type(warm.quant_head).__name__ == "Q8I8Linear"
        assert f"{packed.HEAD}.i8q" in names
    if mode == "q8+bf16" and not serves_i8_head(mode, config.vocab_size):
        # q8+bf16's bf16 head is the (tied) embedding table: saved once, mapped once.
        emb = warm.model.embed_tokens.weight
        assert warm.quant_head.bf16.data_ptr() == emb.data_ptr()
    if mode == "q8+fp16":
        assert type(warm.model.layers[0].mlp.down_proj.quant).__name__ == "Q8Fp16Linear"
        down = warm.model.layers[0].mlp.down_proj  # every copy pends, the largest twice more
        assert warm.pending_bytes() > 2 * down.out_features * down.in_features * 2
    for got in (_logits(cold), _logits(warm)):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert warm.pending_bytes() == 0  # the 20-row step made every fp16 copy


def _damage(path: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(path, path.stat().st_size - 100)
    elif how == "corrupted":  # one byte in the middle of the tensor data
        with open(path, "r+b") as fh:
            fh.seek(path.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0x40]))
    elif how == "garbage":
        path.write_bytes(b"\xff" * 64)


@pytest.mark.parametrize("how", ["truncated", "corrupted", "garbage", "stale layout",
                                 "stale source"])
def test_a_bad_file_is_detected_and_rebuilt(entry, how, monkeypatch) -> None:
    path, config, state = entry
    mode, dtype = MODES[-1]
    loader.build_quantized(_opened(entry), mode, dtype)
    file = packed.packed_file(path, mode, dtype)
    if how == "stale layout":  # the kernels' packing changed since the file was made
        monkeypatch.setattr(CpuKernels, "Q8_LAYOUT", CpuKernels.Q8_LAYOUT + 1)
    elif how == "stale source":  # the float weights were rewritten
        os.utime(path / "model.safetensors", ns=(1, 1))
    else:
        _damage(file, how)
    with pytest.warns(UserWarning, match="quantizing again"):
        rebuilt = loader.build_quantized(_opened(entry), mode, dtype)
    want = _logits(_from_float(config, state, mode, dtype))
    assert all(torch.equal(g, w) for g, w in zip(_logits(rebuilt), want))
    # The rebuilt file is whole again, and the next start uses it.
    warm = _warm(entry, mode, dtype, monkeypatch)
    assert all(torch.equal(g, w) for g, w in zip(_logits(warm), want))


def _short_write(real):  # noqa: ANN001, ANN202
    """save_file on a full disk: safetensors reports nothing and leaves a short file."""
    def write(state, path, metadata=None):  # noqa: ANN001, ANN202
        real(state, path, metadata=metadata)
        os.truncate(path, os.path.getsize(path) // 2)
    return write


def _corrupt_write(real):  # noqa: ANN001, ANN202
    """save_file that writes one byte of the data wrong (bad memory, a faulty disk)."""
    def write(state, path, metadata=None):  # noqa: ANN001, ANN202
        real(state, path, metadata=metadata)
        _damage(Path(path), "corrupted")
    return write


def _raise(code: int):  # noqa: ANN202
    def fail(*_: object, **__: object) -> None:
        raise OSError(code, os.strerror(code))
    return fail


@pytest.mark.parametrize("how", ["full disk", "corrupted write", "read-only", "no permission"])
def test_an_unwritable_cache_only_costs_the_next_start(entry, how, monkeypatch) -> None:
    path, config, state = entry
    mode, dtype = MODES[0]
    if how == "full disk":
        monkeypatch.setattr(packed, "save_file", _short_write(packed.save_file))
    elif how == "corrupted write":  # caught: the CRC is of the tensors in memory
        monkeypatch.setattr(packed, "save_file", _corrupt_write(packed.save_file))
    else:  # the directory refuses new files
        code = errno.EROFS if how == "read-only" else errno.EACCES
        monkeypatch.setattr(packed.tempfile, "mkstemp", _raise(code))
    with pytest.warns(UserWarning, match="could not save the packed model"):
        model = loader.build_quantized(_opened(entry), mode, dtype)
    want = _logits(_from_float(config, state, mode, dtype))
    assert all(torch.equal(g, w) for g, w in zip(_logits(model), want))
    assert [p.name for p in path.iterdir()] == ["model.safetensors"]  # no file, no temp


def test_a_bad_file_in_a_read_only_cache_is_ignored(entry, monkeypatch) -> None:
    """Neither removed nor replaced there: each start quantizes, and none crashes."""
    path, config, state = entry
    mode, dtype = MODES[0]
    loader.build_quantized(_opened(entry), mode, dtype)
    file = packed.packed_file(path, mode, dtype)
    _damage(file, "corrupted")
    monkeypatch.setattr(packed.tempfile, "mkstemp", _raise(errno.EROFS))
    monkeypatch.setattr(Path, "unlink", _raise(errno.EROFS))
    with pytest.warns(UserWarning) as seen:
        model = loader.build_quantized(_opened(entry), mode, dtype)
    assert {"quantizing again", "could not save"} <= {
        m for w in seen for m in ("quantizing again", "could not save") if m in str(w.message)}
    want = _logits(_from_float(config, state, mode, dtype))
    assert all(torch.equal(g, w) for g, w in zip(_logits(model), want))


def test_modes_without_a_saved_form_and_hf_directories_quantize_as_before(entry) -> None:
    path, config, state = entry
    opened = _opened(entry)
    opened.entry = None  # an HF directory: nothing of ours to write into
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = loader.build_quantized(opened, "q8", torch.float32)
    assert model.quantization == "q8"
    assert not any(p.name.startswith("packed-") for p in path.iterdir())


def test_the_crc_check_of_a_missing_or_empty_file_neither_hangs_nor_passes(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        packed.data_crc_soon(tmp_path / "none").result(timeout=10)
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(struct.error):  # no 8-byte header length to read
        packed.data_crc_soon(tmp_path / "empty").result(timeout=10)
