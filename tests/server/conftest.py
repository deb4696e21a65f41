"""One real server for the whole session: Gemma 3 270M (float32), uvicorn on a loopback port.

The model is the session's `kv` fixture (already loaded for the engine tests), so
the server costs an engine around it and a thread, not another load.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import openai
import pytest
import torch
from server_harness import KV_MEMORY, MODEL, LiveServer, serving

from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.models import Gemma3Config, Gemma3ForCausalLM
from kvserve.server.app import build_app

os.environ["HF_HUB_OFFLINE"] = "1"


@contextlib.contextmanager
def live_server(engine: LLMEngine, name: str = MODEL) -> Iterator[LiveServer]:
    """`engine` behind the real app, served by uvicorn on a free loopback port."""
    with serving(build_app(engine, name)) as url:
        yield LiveServer(url, engine)


@pytest.fixture(scope="session")
def serve_engine() -> Callable[..., contextlib.AbstractContextManager[LiveServer]]:
    """live_server, for a test that serves an engine of its own (a fixture rather than an
    import of this conftest, which another directory's conftest can shadow)."""
    return live_server


@pytest.fixture(scope="session")
def server(kv) -> Iterator[LiveServer]:
    with live_server(LLMEngine(kv.model, kv.tokenizer, EngineConfig(kv_memory=KV_MEMORY))) as s:
        yield s


@pytest.fixture(scope="session")
def tiny_server(kv) -> Iterator[LiveServer]:
    """The real tokenizer and chat template in front of a tiny seeded random model whose
    context is 48 tokens, so that any generated request finishes within a second (for
    fuzzing)."""
    torch.manual_seed(0)
    config = Gemma3Config(
        vocab_size=kv.config.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        sliding_window=8, max_position_embeddings=48, eos_token_ids=kv.config.eos_token_ids)
    model = Gemma3ForCausalLM(config).eval()
    with live_server(LLMEngine(model, kv.tokenizer, EngineConfig(kv_memory=16 << 20))) as s:
        yield s


@pytest.fixture(scope="session")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="session")
def greedy(client: openai.OpenAI):
    """Memoised non-streaming greedy completion, one request at a time."""
    memo: dict[tuple[str, int], str] = {}

    def run(prompt: str, max_tokens: int) -> str:
        if (prompt, max_tokens) not in memo:
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                            temperature=0, extra_body={"ignore_eos": True})
            memo[prompt, max_tokens] = out.choices[0].text
        return memo[prompt, max_tokens]

    return run
