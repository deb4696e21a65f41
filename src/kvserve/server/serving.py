"""OpenAI completions and chat completions on top of the engine thread.

A handler tokenizes (on its own tokenizer thread; with its own copy of a transformers
tokenizer, which changes its backend's settings on every call and so cannot be shared
with the engine thread's detokenizing, while kvserve's FastTokenizer only reads its
backend and is shared), checks lengths and parameters,
submits every prompt to the engine loop at once, then either streams SSE chunks
or waits for the end. A client that goes away, streaming or not, aborts its
engine requests, which frees their KV pages.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, suppress
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.types import Receive, Scope, Send

from kvserve.engine.request import InvalidRequest, RequestOutput, SamplingParams
from kvserve.models.tokenizer import FastTokenizer
from kvserve.server import protocol as p
from kvserve.server.engine_loop import EngineFailure, EngineLoop, RequestGroup, Submission
from kvserve.server.errors import APIError, error_body

T = TypeVar("T")
Prompt = tuple[str | None, list[int]]  # (text if given as text, token ids)


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


class OpenAIServing:
    def __init__(self, engine_loop: EngineLoop, model_name: str) -> None:
        engine = engine_loop.engine
        self.engine_loop = engine_loop
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.config.vocab_size
        self.created = p.now()
        tokenizer = engine.tokenizer
        # A copy of the 262k-entry tokenizer takes ~1 s of a server's start: only where needed.
        self._tokenizer = (tokenizer if isinstance(tokenizer, FastTokenizer)
                           else copy.deepcopy(tokenizer))
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ endpoints

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return p.model_card(self.model_name, self.max_model_len, self.created)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

    async def completions(self, body: p.CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        prompts = await self._on_tokenizer(lambda: [self._encode(x) for x in body.prompts()])
        rid = f"cmpl-{uuid.uuid4().hex}"
        params = [self._params(body, len(ids), body.max_tokens, "prompt") for _, ids in prompts]
        group = await self._submit(rid, prompts, params, arrival, body.user)
        if body.stream:
            return _SSE(self._completion_chunks(group, rid, body.include_usage_in_stream), group)
        outs = await _collect(group, raw)
        choices = [p.completion_choice(i, o.outputs[0].text, o) for i, o in enumerate(outs)]
        return JSONResponse(p.envelope("text_completion", rid, p.now(), self.model_name, choices,
                                       usage=p.usage(outs)))

    async def chat(self, body: p.ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        messages = body.template_messages()
        ids = await self._on_tokenizer(lambda: self._chat_ids(messages))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        params = self._params(body, len(ids), body.requested_max_tokens, "messages")
        group = await self._submit(rid, [(None, ids)], [params], arrival, body.user)
        if body.stream:
            return _SSE(self._chat_chunks(group, rid, body.include_usage_in_stream), group)
        outs = await _collect(group, raw)
        choices = [p.chat_choice(i, o) for i, o in enumerate(outs)]
        return JSONResponse(p.envelope("chat.completion", rid, p.now(), self.model_name, choices,
                                       usage=p.usage(outs)))

    async def tokenize(self, body: p.TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if body.messages is not None:
            msgs = p.template_messages(body.messages)
            ids = await self._on_tokenizer(lambda: self._chat_ids(msgs))
        else:
            text, special = body.prompt or "", body.add_special_tokens
            ids = await self._on_tokenizer(
                lambda: self._tokenizer.encode(text, add_special_tokens=special))
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    # ---------------------------------------------------------------- preparation

    async def _on_tokenizer(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn)

    def _encode(self, prompt: str | list[int]) -> Prompt:
        if isinstance(prompt, str):
            return prompt, self._tokenizer.encode(prompt)
        return None, prompt  # token ids: the engine checks them against the vocabulary

    def _chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            out = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        except (TemplateError, ValueError) as e:  # jinja's raise_exception, or HF's checks
            raise APIError(400, f"the messages do not fit the chat template: {e}",
                           param="messages") from e
        return list(out["input_ids"])

    def _params(self, body: p._SamplingRequest, prompt_len: int, max_tokens: int | None,
                field: str) -> SamplingParams:
        if max_tokens is None:  # as vLLM: whatever room the context leaves
            max_tokens = max(self.max_model_len - prompt_len, 1)
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                f"{field}, {max_tokens} in the completion). Please reduce the length of the "
                f"{field} or completion.", param=field, code="context_length_exceeded")
        params = SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, seed=body.seed, stop=body.stop,
            stop_token_ids=list(body.stop_token_ids), ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output)
        try:
            params.validate(self.vocab_size)
        except InvalidRequest as e:
            raise APIError(400, str(e)) from e
        return params

    async def _submit(self, rid: str, prompts: list[Prompt], params: list[SamplingParams],
                      arrival: float, session: str | None = None) -> RequestGroup:
        subs = [Submission(f"{rid}-{i}", ids, text, sp, session)
                for i, ((text, ids), sp) in enumerate(zip(prompts, params))]
        try:
            return await self.engine_loop.add(subs, arrival)
        except InvalidRequest as e:
            raise APIError(400, str(e), param="prompt") from e
        except EngineFailure as e:
            raise APIError(503, str(e)) from e

    # ----------------------------------------------------------------- streaming

    def _completion_chunks(self, group: RequestGroup, rid: str,
                           include_usage: bool) -> AsyncIterator[str]:
        return self._chunks(group, rid, include_usage, "text_completion",
                            lambda i, out: p.completion_choice(i, out.new_text, out))

    def _chat_chunks(self, group: RequestGroup, rid: str,
                     include_usage: bool) -> AsyncIterator[str]:
        # OpenAI clients expect the role first, before any content.
        opening = [p.chat_delta(i, {"role": "assistant", "content": ""}, None)
                   for i in range(len(group.request_ids))]
        return self._chunks(
            group, rid, include_usage, "chat.completion.chunk",
            lambda i, out: p.chat_delta(i, {"content": out.new_text} if out.new_text else {}, out),
            opening)

    async def _chunks(self, group: RequestGroup, rid: str, include_usage: bool, obj: str,
                      choice: Callable[[int, RequestOutput], dict[str, Any]],
                      opening: list[dict[str, Any]] | None = None) -> AsyncIterator[str]:
        """The SSE events of one streamed request group: a chunk per new text, a usage
        chunk when asked for, an error event if the engine fails, then [DONE]."""
        created, extra = p.now(), {"usage": None} if include_usage else {}

        def chunk(choices: list[dict[str, Any]], **more: Any) -> str:
            return _event(p.envelope(obj, rid, created, self.model_name, choices,
                                     **{**extra, **more}))

        if opening:
            yield chunk(opening)
        final: dict[int, RequestOutput] = {}
        try:
            async with aclosing(group.outputs()) as outs:
                async for i, out in outs:
                    if out.finished:
                        final[i] = out
                    if out.new_text or out.finished:
                        yield chunk([choice(i, out)])
        except EngineFailure as e:
            yield _event(error_body(APIError(500, str(e))))
        else:
            if include_usage:
                yield chunk([], usage=p.usage(_ordered(final)))
        yield "data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _SSE(StreamingResponse):
    """An event stream that aborts its requests however it ends.

    A client gone before the first chunk cancels the response before the chunk
    generator ever starts, so the generator's own cleanup cannot be relied on.
    """

    def __init__(self, chunks: AsyncIterator[str], group: RequestGroup) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.close()


def _ordered(final: dict[int, RequestOutput]) -> list[RequestOutput]:
    return [final[i] for i in sorted(final)]


async def _collect(group: RequestGroup, raw: Request) -> list[RequestOutput]:
    """Wait for every request of the group to finish, or abort them if the client leaves."""
    final: dict[int, RequestOutput] = {}

    async def consume() -> None:
        async with aclosing(group.outputs()) as outs:
            async for i, out in outs:
                if out.finished:
                    final[i] = out

    work = asyncio.ensure_future(consume())
    gone = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()  # cancelling `work` closes outputs(), which aborts what still runs
        with suppress(asyncio.CancelledError, Exception):
            await gone
    if not work.done() or work.cancelled():
        with suppress(asyncio.CancelledError, Exception):
            await work
        raise ClientGone()
    try:
        work.result()
    except EngineFailure as e:
        raise APIError(500, str(e)) from e
    return _ordered(final)


async def _disconnected(raw: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass
