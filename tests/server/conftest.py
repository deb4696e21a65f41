"""One real server for the whole session: Gemma 3 270M (float32), uvicorn on a loopback port.

The model is the session's `kv` fixture (already loaded for the engine tests), so
the server costs an engine around it and a thread, not another load.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
import uvicorn
from server_harness import KV_MEMORY, MODEL, LiveServer

from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.server.app import build_app

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def server(kv) -> Iterator[LiveServer]:
    engine = LLMEngine(kv.model, kv.tokenizer, EngineConfig(kv_memory=KV_MEMORY))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(build_app(engine, MODEL), log_level="warning", lifespan="on")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield LiveServer(f"http://127.0.0.1:{port}", engine)
    uv.should_exit = True
    thread.join(30)
    sock.close()


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
