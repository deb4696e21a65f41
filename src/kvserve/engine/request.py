"""Requests, sampling parameters and outputs, in vLLM's shape."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from kvserve.memory.prefix_cache import ImageInput


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says why. Nothing was allocated."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0

    def validate(self, vocab_size: int) -> None:
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (_finite(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0, got {self.temperature!r}"),
            (_finite(self.top_p) and 0 < self.top_p <= 1,
             f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
            (all(isinstance(s, str) and s for s in self.stop),
             "stop must be non-empty strings"),
            (all(isinstance(t, int) and 0 <= t < vocab_size for t in self.stop_token_ids),
             f"stop_token_ids must be token ids in [0, {vocab_size})"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequest(msg)

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflow to inf (NaN probabilities); the
        # distribution is a point mass anyway. vLLM draws the same line.
        return self.temperature < GREEDY_BELOW


GREEDY_BELOW = 1e-5


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    seq: int = 0  # place in the scheduler's arrival order
    token_ids: list[int] = field(default_factory=list)  # prompt + output; the KV manager reads it
    images: tuple[ImageInput, ...] = ()
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    admitted: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    first_token_time: float | None = None
    sent_text: int = 0  # streaming: characters / output tokens already reported
    sent_tokens: int = 0
    # Of its tokens' full blocks, hashed once: the queue's order and the memory core's
    # lookups read them every step it waits (KVCacheManager.add_request).
    block_hashes: list[int] = field(default_factory=list)
    queued_at: int = 0  # the scheduler's first admissions when it was queued

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Streaming: what this step added.
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
