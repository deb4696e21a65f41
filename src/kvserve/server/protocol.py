"""Request bodies and response builders in OpenAI's wire format.

Request models are strict: a string where a number belongs is a 400, not a silent
coercion. Unknown fields are ignored (OpenAI clients send extras such as `user`);
known OpenAI features the engine lacks are refused by name when set, so a client
never gets a silently different behaviour.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvserve.engine.request import RequestOutput

NonNegFloat = Annotated[float, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model, as vLLM does
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: NonNegFloat = 1.0
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)  # extension: 0 or -1 = no limit
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)  # extension
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension (benchmarks)
    include_stop_str_in_output: bool = False  # extension
    # OpenAI's end-user id; a cluster's session policy keeps one user's requests together
    user: str | None = None
    # OpenAI features the engine does not implement: refused when used (see _unsupported).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def _unsupported(self) -> list[str]:
        out = []
        if self.presence_penalty:
            out.append("presence_penalty")
        if self.frequency_penalty:
            out.append("frequency_penalty")
        if self.logit_bias:
            out.append("logit_bias")
        return out

    @field_validator("temperature", "top_p", "top_k", "n", "stream", "ignore_eos",
                     "include_stop_str_in_output", "stop_token_ids", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        # OpenAI accepts an explicit null for an optional parameter: it means the default.
        if value is None and info.field_name is not None:
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @model_validator(mode="after")
    def _check_supported(self) -> _SamplingRequest:
        unsupported = self._unsupported()
        if unsupported:
            raise ValueError(f"not supported by this server: {', '.join(unsupported)}")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptField = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: PromptField
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's (and vLLM's) default
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def _unsupported(self) -> list[str]:
        out = super()._unsupported()
        if self.echo:
            out.append("echo")
        if self.logprobs is not None:
            out.append("logprobs")
        if self.best_of not in (None, 1):
            out.append("best_of")
        if self.suffix:
            out.append("suffix")
        return out

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, p: PromptField) -> PromptField:
        empty = not p if isinstance(p, str) else not p or any(
            isinstance(item, (str, list)) and not item for item in p)
        if empty:
            raise ValueError("must not be empty")
        return p

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (a batch of one unless a list was sent)."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def _unsupported(self) -> list[str]:
        out = super()._unsupported()
        if self.logprobs or self.top_logprobs:
            out.append("logprobs")
        if self.tools:
            out.append("tools")
        if self.response_format and self.response_format.get("type") != "text":
            out.append("response_format")
        return out

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; max_tokens is deprecated but common.
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them: plain-text content, known roles."""
    # The template has no 'developer' role; OpenAI treats it as the system prompt.
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages]


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


# ----------------------------------------------------------------------------- responses


def now() -> int:
    return int(time.time())


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)},
    }


def completion_choice(index: int, text: str, out: RequestOutput) -> dict[str, Any]:
    c = out.outputs[0]
    return {"index": index, "text": text, "logprobs": None,
            "finish_reason": c.finish_reason if out.finished else None,
            "stop_reason": c.stop_reason if out.finished else None}


def chat_choice(index: int, out: RequestOutput) -> dict[str, Any]:
    c = out.outputs[0]
    return {"index": index, "message": {"role": "assistant", "content": c.text},
            "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def chat_delta(index: int, delta: dict[str, str], out: RequestOutput | None) -> dict[str, Any]:
    finished = out is not None and out.finished
    c = out.outputs[0] if out is not None else None
    return {"index": index, "delta": delta, "logprobs": None,
            "finish_reason": c.finish_reason if finished and c else None,
            "stop_reason": c.stop_reason if finished and c else None}


def envelope(kind: str, rid: str, created: int, model: str, choices: list[dict],
             **extra: Any) -> dict[str, Any]:
    """The fields every completion object and chunk share."""
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices,
            **extra}


def model_card(name: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "kvserve",
            "root": name, "parent": None, "max_model_len": max_model_len}
