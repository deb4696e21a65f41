"""Continuous batching and aborts: many streams share steps; a client that leaves frees its KV."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
from hf_reference import ledger_text
from server_harness import MODEL, LiveServer

# Different lengths, so prefills of different sizes and decodes share the same steps.
PROMPTS = [
    "The old lighthouse keeper climbed the spiral stairs every evening, and tonight he",
    "Once upon a time",
    ledger_text(3),
    "def fibonacci(n):\n    ",
    "The three primary colours are",
    ledger_text(6),
]
CLIENTS = 16
NEW_TOKENS = 6


async def _stream_all(base_url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                timeout=300)

    async def one(prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    try:
        return await asyncio.gather(*(one(PROMPTS[i % len(PROMPTS)]) for i in range(CLIENTS)))
    finally:
        await client.close()


def test_concurrent_streams_equal_one_at_a_time(server: LiveServer, greedy) -> None:
    alone = [greedy(p, NEW_TOKENS) for p in PROMPTS]  # sequential, non-streaming
    before = server.metrics()[("kvserve_num_preemptions_total", ())]
    texts = asyncio.run(_stream_all(server.base_url))
    assert texts == [alone[i % len(PROMPTS)] for i in range(CLIENTS)]
    m = server.wait_idle()
    assert m[("kvserve_num_requests_running", ())] == 0
    assert m[("kvserve_num_preemptions_total", ())] == before  # 256 MiB holds them all


def _aborts(server: LiveServer) -> float:
    return server.metrics().get(
        ("kvserve_request_success_total", (("finished_reason", "abort"),)), 0.0)


def _assert_released(server: LiveServer) -> None:
    m = server.wait_idle()
    assert m[("kvserve_num_requests_running", ())] == 0
    assert m[("kvserve_num_requests_waiting", ())] == 0
    used = {dict(labels)["layer_type"]: v for (name, labels), v in m.items()
            if name == "kvserve_kv_used_bytes"}
    assert used and all(v == 0 for v in used.values()), used


def test_client_leaving_a_stream_aborts_and_frees_its_pages(server: LiveServer) -> None:
    aborts = _aborts(server)
    body = {"model": MODEL, "prompt": ledger_text(4), "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        held = server.metrics()
        assert held[("kvserve_num_requests_running", ())] == 1
    # Leaving the `with` closed the connection in mid-stream.
    _assert_released(server)
    assert _aborts(server) == aborts + 1


def test_client_leaving_a_plain_request_aborts_it(server: LiveServer) -> None:
    aborts = _aborts(server)
    body = {"model": MODEL, "prompt": ledger_text(4), "max_tokens": 2000, "ignore_eos": True}
    started = time.monotonic()
    try:
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=2.0)
        raise AssertionError("2000 tokens cannot be ready in 2 s on this model")
    except httpx.ReadTimeout:
        pass
    _assert_released(server)
    assert _aborts(server) == aborts + 1
    assert time.monotonic() - started < 60


def test_server_still_answers_after_the_aborts(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens >= 1
