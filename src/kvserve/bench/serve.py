"""Replay sessions against an OpenAI-compatible server and measure it, client side.

Sessions start at Poisson arrival times (all at once for an unbounded rate).
Inside a session a turn is sent only once the previous answer has fully
arrived, with the whole history, the model's own answers included (MemServe
§8.2's ShareGPT workload). Every request streams, so the client sees its time
to first token (TTFT) and the gaps between content chunks (ITL); each asks for
exactly its planned output length (`ignore_eos`). With a think time, a session
waits that long (exponentially distributed, seeded) between an answer and its
next turn, as a user reading and typing would: what an idle-memory timeout on
the server (`--kv-idle-release-s`) is measured against.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm.asyncio import tqdm

from kvserve.bench.dataset import Session, Turn

# Server counters read from /metrics before and after a run (kvserve's names).
COUNTERS = ("kvserve_prefix_cache_hit_tokens", "kvserve_prefix_cache_queried_tokens",
            "kvserve_num_preemptions", "kvserve_vtensor_recomputed_tokens")


@dataclass
class RunConfig:
    base_url: str
    model: str
    endpoint: str  # "completions" or "chat"
    request_rate: float  # sessions per second; inf = all at once
    max_concurrency: int | None
    temperature: float
    seed: int
    show_progress: bool = True
    think_time: float = 0.0  # mean seconds between an answer and the session's next turn


@dataclass
class RequestResult:
    session: int
    turn: int
    start: float = 0.0  # seconds since the run began
    think: float = 0.0  # seconds the session waited after the previous answer
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def record(self) -> dict[str, Any]:
        """The per-request row of the JSON report (the text itself is left out)."""
        return {"session": self.session, "turn": self.turn, "start_s": self.start,
                "think_s": self.think, "ok": self.ok, "error": self.error, "ttft_s": self.ttft,
                "latency_s": self.latency, "tpot_s": self.tpot,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "output_tokens": self.output_tokens}


# ------------------------------------------------------------------ server queries


async def server_model(client: httpx.AsyncClient, base_url: str) -> tuple[str, int | None]:
    """(first served model's id, its max_model_len if the server says)."""
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    card = resp.json()["data"][0]
    return card["id"], card.get("max_model_len")


class ServerTokenCounter:
    """Token lengths from the server's own tokenizer (vLLM-style POST /tokenize)."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str,
                 parallel: int = 8) -> None:
        self.client, self.url, self.model = client, f"{base_url}/tokenize", model
        self._slots = asyncio.Semaphore(parallel)

    async def __call__(self, texts: list[str]) -> list[int]:
        return list(await asyncio.gather(*(self._count(t) for t in texts)))

    async def _count(self, text: str) -> int:
        async with self._slots:
            resp = await self.client.post(self.url, json={
                "model": self.model, "prompt": text, "add_special_tokens": False})
        resp.raise_for_status()
        return int(resp.json()["count"])


async def server_counters(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """The COUNTERS the server's /metrics has (none for a server without them)."""
    try:
        resp = await client.get(f"{base_url}/metrics")
        resp.raise_for_status()
    except httpx.HTTPError:
        return {}
    return {family.name: sum(s.value for s in family.samples if s.name.endswith("_total"))
            for family in text_string_to_metric_families(resp.text)
            if family.name in COUNTERS}


# ----------------------------------------------------------------------- requests


def payload(cfg: RunConfig, history: list[dict[str, str]], turn: Turn,
            session: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model, "temperature": cfg.temperature, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if session is not None:
        body["user"] = session  # OpenAI's end-user id: a cluster's session policy uses it
    if cfg.endpoint == "chat":
        body["messages"] = [*history, {"role": "user", "content": turn.prompt}]
        body["max_completion_tokens"] = turn.output_tokens
    else:
        body["prompt"] = turn.prompt
        body["max_tokens"] = turn.output_tokens
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any],
               result: RequestResult) -> None:
    """Stream one request, timing each content chunk as it arrives."""
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            await _read_stream(resp, result, t0)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.latency = time.perf_counter() - t0


async def _read_stream(resp: httpx.Response, result: RequestResult, t0: float) -> None:
    pieces, last = [], t0
    async for line in resp.aiter_lines():
        data = line.removeprefix("data:").strip()
        if not line.startswith("data:") or not data:
            continue
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"].get("message", chunk["error"]))
            return
        if chunk.get("usage"):
            _take_usage(result, chunk["usage"])
        for choice in chunk.get("choices", []):
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - t0
                else:
                    result.itl.append(now - last)
                last = now
                pieces.append(text)
    result.text = "".join(pieces)
    result.ok = result.ttft is not None


def _take_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = usage.get("prompt_tokens", 0)
    result.output_tokens = usage.get("completion_tokens", 0)
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens") or 0


# ------------------------------------------------------------------------ the run


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: exponential gaps of mean 1/rate; all at 0 when rate is inf."""
    if rate == float("inf"):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def think_times(mean: float, seed: int, session: int, turns: int) -> list[float]:
    """Each turn's wait after the previous answer: 0 for the first, then exponential of `mean`.

    Exponential think times are the usual model of a user between requests;
    seeded per session, so every run (and every server setting) sees the same gaps.
    """
    if mean <= 0:
        return [0.0] * turns
    rng = random.Random(f"{seed}:{session}")
    return [0.0] + [rng.expovariate(1 / mean) for _ in range(turns - 1)]


async def run_sessions(cfg: RunConfig, sessions: list[Session],
                       client: httpx.AsyncClient) -> tuple[list[RequestResult], float]:
    """Replay every session; returns the request results and the run's duration."""
    url = f"{cfg.base_url}/v1/{'chat/completions' if cfg.endpoint == 'chat' else 'completions'}"
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=sum(len(s.turns) for s in sessions), disable=not cfg.show_progress,
               desc="requests", unit="req")
    results: list[RequestResult] = []
    t0 = time.perf_counter()

    async def session(i: int, s: Session, at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        history: list[dict[str, str]] = []
        thinks = think_times(cfg.think_time, cfg.seed, i, len(s.turns))
        for k, turn in enumerate(s.turns):
            await asyncio.sleep(thinks[k])  # outside the concurrency slot: no request is open
            r = RequestResult(i, k, start=time.perf_counter() - t0, think=thinks[k])
            body = payload(cfg, history, turn, s.id)
            if slots is None:
                await send(client, url, body, r)
            else:
                async with slots:
                    await send(client, url, body, r)
            results.append(r)
            bar.update(1)
            if not r.ok:
                bar.update(len(s.turns) - k - 1)  # the rest of the session is lost
                return
            history = [*body.get("messages", []), {"role": "assistant", "content": r.text}]

    starts = arrival_times(len(sessions), cfg.request_rate, cfg.seed)
    await asyncio.gather(*(session(i, s, at) for i, (s, at) in enumerate(zip(sessions, starts))))
    bar.close()
    results.sort(key=lambda r: (r.session, r.turn))
    return results, time.perf_counter() - t0
