"""Client mistakes get a 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import MODEL, LiveServer

OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
OK_CMPL = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
TOO_LONG = "hello " * 33_000  # > 32768 tokens


def _with(base: dict, **changes: object) -> dict:
    out = {**base, **changes}
    return {k: v for k, v in out.items() if v is not ...}  # `...` drops a field


CASES = [
    # (path, body (str = raw bytes), status, code or None, param or None)
    ("/v1/completions", "{not json", 400, None, None),
    ("/v1/completions", "[1, 2]", 400, None, None),
    ("/v1/completions", _with(OK_CMPL, prompt=...), 400, None, "prompt"),
    ("/v1/completions", _with(OK_CMPL, prompt=5), 400, None, "prompt"),
    ("/v1/completions", _with(OK_CMPL, prompt=""), 400, None, "prompt"),
    ("/v1/completions", _with(OK_CMPL, prompt=[-1, 5]), 400, None, "prompt"),
    ("/v1/completions", _with(OK_CMPL, prompt=[10**9]), 400, None, "prompt"),
    ("/v1/completions", _with(OK_CMPL, max_tokens="5"), 400, None, "max_tokens"),
    ("/v1/completions", _with(OK_CMPL, max_tokens=0), 400, None, "max_tokens"),
    ("/v1/completions", _with(OK_CMPL, temperature=-1), 400, None, "temperature"),
    ("/v1/completions", _with(OK_CMPL, temperature="hot"), 400, None, "temperature"),
    ("/v1/completions", _with(OK_CMPL, top_p=0), 400, None, "top_p"),
    ("/v1/completions", _with(OK_CMPL, top_k=-5), 400, None, "top_k"),
    ("/v1/completions", _with(OK_CMPL, stop=[""]), 400, None, None),
    ("/v1/completions", _with(OK_CMPL, stream="yes"), 400, None, "stream"),
    ("/v1/completions", _with(OK_CMPL, n=2), 400, None, "n"),
    ("/v1/completions", _with(OK_CMPL, logprobs=2), 400, None, None),
    ("/v1/completions", _with(OK_CMPL, prompt=TOO_LONG), 400, "context_length_exceeded",
     "prompt"),
    ("/v1/completions", _with(OK_CMPL, max_tokens=40_000), 400, "context_length_exceeded",
     "prompt"),
    ("/v1/completions", _with(OK_CMPL, model="gpt-4"), 404, "model_not_found", "model"),
    ("/v1/chat/completions", _with(OK_CHAT, messages=...), 400, None, "messages"),
    ("/v1/chat/completions", _with(OK_CHAT, messages=[]), 400, None, "messages"),
    ("/v1/chat/completions", _with(OK_CHAT, messages="Hi"), 400, None, "messages"),
    ("/v1/chat/completions", _with(OK_CHAT, messages=[{"role": "wizard", "content": "x"}]),
     400, None, "messages.0.role"),
    ("/v1/chat/completions", _with(OK_CHAT, messages=[{"role": "user", "content": TOO_LONG}]),
     400, "context_length_exceeded", "messages"),
    ("/v1/chat/completions", _with(OK_CHAT, n=3), 400, None, "n"),
    ("/v1/chat/completions", _with(OK_CHAT, model="nope"), 404, "model_not_found", "model"),
    ("/v1/nothing-here", OK_CMPL, 404, None, None),
]


@pytest.mark.parametrize(("path", "body", "status", "code", "param"), CASES,
                         ids=[f"{i}:{c[0].rsplit('/', 1)[-1]}:{c[2]}" for i, c in
                              enumerate(CASES)])
def test_bad_request_gets_an_openai_error(server: LiveServer, path, body, status, code,
                                          param) -> None:
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    resp = httpx.post(f"{server.base_url}{path}", headers={"content-type": "application/json"},
                      timeout=60, **kw)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param


def test_openai_client_raises_its_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    assert bad.value.status_code == 400 and "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])


def test_server_still_serves_after_bad_requests(server: LiveServer, client) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    out = client.chat.completions.create(**{**OK_CHAT, "max_tokens": 2})
    assert out.usage.completion_tokens >= 1
    assert server.wait_idle()[("kvserve_num_requests_running", ())] == 0
