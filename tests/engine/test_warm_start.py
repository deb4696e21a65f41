"""A warm start (the packed model and the fast tokenizer from the cache) generates exactly
what a cold start (quantizing the float weights) does, on the real Gemma 3 270M."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_reference import ledger_text

from kvserve.engine.engine import EngineConfig, LLMEngine, resolve_dtype
from kvserve.engine.request import SamplingParams
from kvserve.kernels.cpu import cpu_kernels
from kvserve.models import loader, packed
from kvserve.models.quant import fbgemm_available

pytestmark = pytest.mark.skipif(cpu_kernels() is None or not fbgemm_available(),
                                reason="q8 needs the C kernels and an x86 CPU")


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch) -> Path:  # noqa: ANN001
    """A cache dir of its own, holding (as links) the converted model the session has, so
    the packed files this test writes start from nothing and go away with it."""
    source = loader.open_model().entry  # converts the GGUF once if no test did yet
    entry = tmp_path / "kvserve" / source.name
    entry.mkdir(parents=True)
    for item in source.iterdir():
        if not item.name.startswith("packed-"):
            (entry / item.name).symlink_to(item)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return entry


def _greedy(engine: LLMEngine, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize(("dtype", "quantization"), [("auto", "auto"), ("float32", "q8")])
def test_a_warm_start_generates_what_a_cold_one_does(cache_root, dtype, quantization,
                                                     monkeypatch) -> None:
    cfg = EngineConfig(kv_memory=256 << 20, dtype=dtype, quantization=quantization)
    # A short prompt (q8+bf16's Q8_0 steps) and a long one (its bf16 prefill).
    prompts = ["Hello there", ledger_text(8)]
    cold = LLMEngine.load(cfg)
    mode = cold.model.quantization
    assert mode in packed.MODES
    file = packed.packed_file(cache_root, mode, resolve_dtype(dtype, torch.device("cpu")))
    assert file.is_file()
    want = _greedy(cold, prompts)
    del cold
    with monkeypatch.context() as m:  # the warm start must not touch the float weights
        m.setattr(loader, "build_model", _refuse)
        warm = LLMEngine.load(cfg)
    assert _greedy(warm, prompts) == want
    assert warm.tokenizer.encode(prompts[1]) == warm.tokenizer(prompts[1]).input_ids


def _refuse(*_: object, **__: object) -> None:
    raise AssertionError("built from the float weights: the packed file was not used")



def test_the_console_script_streams_the_greedy_text_and_exits_cleanly() -> None:
    """`kvserve generate` ends its process as soon as the text is flushed (cli.QUICK_EXIT):
    all of it is printed, and the exit status is 0."""
    import subprocess
    import sys

    engine = LLMEngine.load(EngineConfig(kv_memory=256 << 20))
    params = SamplingParams(temperature=0, max_tokens=6)
    engine.add_request("0", "Hello there", params)
    want = ""
    while engine.has_unfinished():
        want += "".join(out.new_text for out in engine.step())
    got = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "--max-tokens", "6",
                          "Hello there"], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    assert got.stdout == want + "\n"
