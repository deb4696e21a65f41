"""Session fixtures: the real Gemma 3 270M, loaded once, and HF's reference on the same GGUF."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# Everything must come from the packaged GGUF; fail rather than reach for the hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402
from hf_reference import (  # noqa: E402
    NEW_TOKENS,
    SHORT_TEXT,
    HfGreedy,
    KvModel,
    gguf_parsed_once,
    ledger_text,
)

from kvserve.models import Gemma3ForCausalLM, default_gguf_path, load_model_files  # noqa: E402


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="session")
def kv(gguf_path: Path) -> KvModel:
    config, state_dict, tokenizer = load_model_files(gguf_path)
    model = Gemma3ForCausalLM.from_state_dict(config, state_dict)
    return KvModel(config, state_dict, tokenizer, model)


@pytest.fixture(scope="session")
def hf_model(gguf_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():  # one parse for the config and the tensors (and the tokenizer)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model: torch.nn.Module) -> Callable[[list[int]], HfGreedy]:
    """Memoised HF ``generate(do_sample=False)``: several tests share the same prompts."""
    memo: dict[tuple[int, ...], HfGreedy] = {}

    def run(prompt: list[int]) -> HfGreedy:
        if tuple(prompt) not in memo:
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            memo[tuple(prompt)] = HfGreedy(tokens, [step[0].float() for step in out.logits])
        return memo[tuple(prompt)]

    return run


@pytest.fixture(scope="session")
def short_prompt(kv: KvModel) -> list[int]:
    ids = kv.tokenizer(SHORT_TEXT).input_ids
    assert 15 <= len(ids) <= 25
    return ids


@pytest.fixture(scope="session")
def long_prompt(kv: KvModel) -> list[int]:
    ids = kv.tokenizer(ledger_text(60)).input_ids[:700]
    assert len(ids) == 700 > kv.config.sliding_window
    return ids


def pytest_sessionstart(session: pytest.Session) -> None:
    """Which CPU paths this run covers (native bf16, AVX-512 kernels, or AVX2 only): a
    line that `-q` (pyproject's addopts) keeps, unlike a report header, which it hides."""
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        from kvserve.cpu_features import summary

        terminal.write_line(f"cpu: {summary()}")
