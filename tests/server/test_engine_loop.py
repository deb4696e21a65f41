"""The engine thread on a scripted fake engine: batching, atomic adds, failures, idling."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from types import SimpleNamespace

import pytest

from kvserve.engine.request import CompletionOutput, InvalidRequest, RequestOutput, SamplingParams
from kvserve.server.engine_loop import EngineFailure, EngineLoop, Submission


class FakeEngine:
    """One token per running request per step; `max_tokens > 100` is refused."""

    def __init__(self) -> None:
        self.requests: dict[str, list] = {}
        self.steps = 0
        self.fail_next_step = False
        self.aborted: list[str] = []
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0}

    def add_request(self, rid: str, prompt: dict, params: SamplingParams) -> None:
        if params.max_tokens > 100:
            raise InvalidRequest("max_tokens is too large")
        self.requests[rid] = [prompt["prompt_token_ids"], params.max_tokens, []]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def idle_poll_s(self) -> float | None:
        return None  # the paged pool: nothing to give back

    def maybe_release_idle(self, now: float) -> int:
        return 0

    def abort_request(self, rid: str) -> None:
        self.requests.pop(rid)
        self.aborted.append(rid)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.005)  # a step takes time, so commands can arrive during one
        self.steps += 1
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs = []
        for rid, (ids, max_tokens, out) in list(self.requests.items()):
            out.append(7)
            done = len(out) == max_tokens
            if done:
                del self.requests[rid]
            outs.append(RequestOutput(rid, None, ids, [CompletionOutput(
                0, "x" * len(out), list(out), "length" if done else None)], done,
                new_text="x", new_token_ids=[7]))
        return outs


def _sub(rid: str, max_tokens: int) -> Submission:
    return Submission(rid, [1, 2, 3], None, SamplingParams(max_tokens=max_tokens))


async def _finals(group) -> list[RequestOutput]:
    return [out async for _, out in group.outputs() if out.finished]


@pytest.fixture
def loop_and_engine():
    engine = FakeEngine()
    loop = EngineLoop(engine)  # type: ignore[arg-type]
    loop.start()
    yield loop, engine
    loop.stop()


def test_concurrent_requests_share_steps(loop_and_engine) -> None:
    loop, engine = loop_and_engine

    async def main() -> list[list[RequestOutput]]:
        groups = await asyncio.gather(*(loop.add([_sub(f"r{i}", 5)], 0.0) for i in range(8)))
        return await asyncio.gather(*(_finals(g) for g in groups))

    finals = asyncio.run(main())
    assert all(len(f) == 1 and len(f[0].outputs[0].token_ids) == 5 for f in finals)
    assert engine.steps < 8 * 5  # continuous batching: the eight ran side by side


def test_a_refused_prompt_leaves_nothing_of_its_group(loop_and_engine) -> None:
    loop, engine = loop_and_engine

    async def main() -> None:
        with pytest.raises(InvalidRequest, match="too large"):
            await loop.add([_sub("ok", 5), _sub("bad", 500)], 0.0)

    asyncio.run(main())
    assert engine.aborted == ["ok"] and not engine.requests


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(loop_and_engine) -> None:
    loop, engine = loop_and_engine

    async def main() -> list[RequestOutput]:
        engine.fail_next_step = True
        group = await loop.add([_sub("a", 3)], 0.0)
        with pytest.raises(EngineFailure, match="boom"):
            await _finals(group)
        return await _finals(await loop.add([_sub("b", 3)], 0.0))

    assert [o.request_id for o in asyncio.run(main())] == ["b"]
    assert loop.alive and engine.aborted == ["a"]


def test_leaving_early_aborts_and_an_idle_loop_does_not_spin(loop_and_engine) -> None:
    loop, engine = loop_and_engine

    async def main() -> None:
        group = await loop.add([_sub("long", 100)], 0.0)
        async with aclosing(group.outputs()) as outs:
            async for _, out in outs:
                assert not out.finished
                break  # the client leaves after its first token

    asyncio.run(main())
    deadline = time.monotonic() + 5
    while engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.aborted == ["long"]
    steps = engine.steps
    time.sleep(0.3)
    assert engine.steps == steps and loop.alive
