"""The OpenAI API through the official `openai` client, against the real server and model."""

from __future__ import annotations

import httpx
import openai
from hf_reference import ledger_text
from server_harness import MODEL, LiveServer

PROMPT = "The old lighthouse keeper climbed the spiral stairs every evening, and tonight he"
CHAT = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour of the sea."}]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_health(server: LiveServer) -> None:
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


def test_completion_text_finish_reason_and_usage(client, server: LiveServer, greedy) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert choice.text and choice.finish_reason == "length" and choice.index == 0
    assert choice.text == greedy(PROMPT, 8)  # greedy is deterministic
    prompt_len = len(server.engine.tokenizer.encode(PROMPT))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_len, 8)
    assert out.usage.total_tokens == prompt_len + 8


def test_streamed_completion_equals_non_streamed(client, greedy) -> None:
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy(PROMPT, 8)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 8


def test_chat_completion_uses_the_chat_template(client, server: LiveServer) -> None:
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=6,
                                         temperature=0)
    msg = out.choices[0].message
    assert out.object == "chat.completion" and msg.role == "assistant"
    assert isinstance(msg.content, str)
    ids = server.engine.tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens <= 6


def test_chat_stream_starts_with_the_role_and_equals_non_streamed(client) -> None:
    args = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.total_tokens > 6


def test_repeated_long_prompt_reports_cached_tokens(client) -> None:
    prompt = ledger_text(12)  # a few hundred tokens: many full 16-token pages
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens > 200
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached >= again.usage.prompt_tokens - 32


def test_stop_string_ends_the_completion(client, greedy) -> None:
    full = greedy(PROMPT, 8)
    stop = full.split()[1]  # a word the greedy continuation certainly reaches
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.index(stop)]


def test_batch_of_prompts_answers_each_in_order(client, greedy) -> None:
    prompts = [PROMPT, "Harbour ledger of the merchant house"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [greedy(p, 4) for p in prompts]
    assert out.usage.completion_tokens == 8


def test_seeded_sampling_is_reproducible(client) -> None:
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=7,
                extra_body={"top_k": 50})
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert a.choices[0].text == b.choices[0].text


def test_tokenize_endpoint_matches_the_tokenizer(server: LiveServer) -> None:
    body = httpx.post(f"{server.base_url}/tokenize", json={"prompt": PROMPT}).json()
    assert body["tokens"] == server.engine.tokenizer.encode(PROMPT)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 32768


def test_explicit_nulls_mean_the_defaults(server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": None, "top_p": None,
            "n": None, "stop": None, "stream": None, "seed": None, "stream_options": None}
    resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1
