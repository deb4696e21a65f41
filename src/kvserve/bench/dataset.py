"""ShareGPT conversations for the serving benchmark.

Records come from kvserve.datasets.sharegpt, which reads the packaged JSON up to
the point where the file is cut off.

A conversation becomes a session: its leading (user, assistant) pairs, in order,
until the roles stop alternating. Each turn keeps the user text and the token
length of the dataset's answer, which becomes that turn's output length.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.datasets.sharegpt import packaged_records, records

USER_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "chatgpt", "bing", "assistant"}
MIN_TOKENS = 4  # vLLM's filter: too-short prompts and answers say little about serving
# Tokens the chat template adds per message (Gemma: <start_of_turn>role\n ... <end_of_turn>\n).
CHAT_OVERHEAD_TOKENS = 6

CountTokens = Callable[[list[str]], Awaitable[list[int]]]


@dataclass
class Turn:
    prompt: str  # the user's message
    prompt_tokens: int  # its own length (a multi-turn request also carries the history)
    output_tokens: int  # the dataset answer's length, capped by --max-tokens


@dataclass
class Session:
    id: str
    turns: list[Turn]


def sharegpt_records(path: Path | None = None) -> Iterator[dict]:
    """Every complete record of the ShareGPT JSON array, stopping cleanly at the cut."""
    if path is None:
        yield from packaged_records()
    else:
        yield from records(path.read_text(encoding="utf-8"))


def dialogue(record: dict) -> list[tuple[str, str]]:
    """The record's leading (user, assistant) text pairs; a system turn first is skipped."""
    msgs = [m for m in record.get("conversations", []) if isinstance(m.get("value"), str)]
    if msgs and msgs[0].get("from") == "system":
        msgs = msgs[1:]
    pairs = []
    for user, answer in zip(msgs[0::2], msgs[1::2]):
        if user.get("from") not in USER_ROLES or answer.get("from") not in ASSISTANT_ROLES:
            break
        pairs.append((user["value"], answer["value"]))
    return pairs


@dataclass
class Limits:
    max_tokens: int  # output cap per request
    max_prompt_tokens: int  # a request's prompt, history included
    max_model_len: int  # prompt + output
    multi_turn: bool


async def sample_sessions(
    records: Sequence[dict], num: int, count_tokens: CountTokens, limits: Limits, seed: int
) -> list[Session]:
    """`num` sessions drawn at random (seeded) among the records that pass the filters."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    sessions: list[Session] = []
    for i in order:
        if len(sessions) == num:
            break
        pairs = dialogue(records[i])
        if not limits.multi_turn:
            pairs = pairs[:1]
        if pairs:
            session = await _session(records[i].get("id", str(i)), pairs, count_tokens, limits)
            if session is not None:
                sessions.append(session)
    return sessions


async def _session(sid: str, pairs: list[tuple[str, str]], count_tokens: CountTokens,
                   limits: Limits) -> Session | None:
    lengths = await count_tokens([text for pair in pairs for text in pair])
    turns, context = [], 0
    for (user, _), user_len, answer_len in zip(pairs, lengths[0::2], lengths[1::2]):
        if user_len < MIN_TOKENS or answer_len < MIN_TOKENS:
            break
        out = min(answer_len, limits.max_tokens)
        # The request's prompt is the history so far plus this message (chat template added).
        prompt = context + user_len + CHAT_OVERHEAD_TOKENS * (1 if limits.multi_turn else 0)
        too_long = prompt + out + CHAT_OVERHEAD_TOKENS > limits.max_model_len
        if prompt > limits.max_prompt_tokens or too_long:
            break
        turns.append(Turn(user, user_len, out))
        context = prompt + out + CHAT_OVERHEAD_TOKENS
    return Session(sid, turns) if turns else None
