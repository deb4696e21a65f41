"""The engine's own thread: the only caller of LLMEngine, fed through a thread-safe inbox.

HTTP handlers run on the asyncio event loop and never touch the engine. They put
commands (add a group of requests, abort, take a metrics snapshot) in `inbox`; the
engine thread applies them between steps, so every HTTP request that arrived
during a step joins the next one (continuous batching). Outputs go back to each
HTTP request's own asyncio queue with `call_soon_threadsafe`. With nothing to run
the thread blocks on the inbox instead of spinning, waking every
`engine.idle_poll_s()` (vtensor backend) to give idle KV memory back.

Nothing a client sends may kill this thread: each command and each step is
guarded; a failing step fails only the requests in flight and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvserve.engine.engine import LLMEngine
from kvserve.engine.request import RequestOutput, SamplingParams
from kvserve.server.metrics import EngineSnapshot, ServerMetrics

log = logging.getLogger("kvserve.server")


class EngineFailure(RuntimeError):
    """The engine raised while running a request (a server bug, not the client's)."""


@dataclass
class Submission:
    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    session: str | None = None  # the client's user / session id (a cluster routes by it)


@dataclass
class _Tracked:
    """Per engine request: where its outputs go and the times the metrics need."""

    group: RequestGroup
    arrival: float
    first_token: float | None = None


class RequestGroup:
    """The engine requests of one HTTP request, as the event loop sees them.

    Iterate `outputs()` for (index, RequestOutput) until all are finished. `close()`
    aborts whatever still runs; leaving `outputs()` early calls it, and so must
    whoever holds a group it may never iterate (a response the client left before
    it started).
    """

    def __init__(self, engine_loop: EngineLoop, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.unfinished = set(request_ids)
        self.loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._engine_loop = engine_loop

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread side: hand over an output (or the error that ends the group)."""
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while self.unfinished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    self.unfinished.clear()  # the engine thread already dropped them
                    raise item
                if item.finished:
                    self.unfinished.discard(item.request_id)
                yield self.index[item.request_id], item
        finally:
            self.close()

    def close(self) -> None:
        """Abort the requests that have not finished; idempotent."""
        if self.unfinished:
            self._engine_loop.abort(sorted(self.unfinished))
            self.unfinished.clear()


@dataclass
class _Command:
    run: Callable[[], None]
    done: Future | None = None  # None: nobody waits (aborts)


_STOP = object()


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[_Command | object] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------- event-loop side

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def add(self, subs: list[Submission], arrival: float,
                  before: Callable[[LLMEngine], object] | None = None) -> RequestGroup:
        """Queue all of `subs` or none: the engine's InvalidRequest comes back raised.
        `before` runs on the engine in the same command (no step between: a cluster
        instance imports transferred KV so that the requests find it)."""
        group = RequestGroup(self, [s.request_id for s in subs])
        try:
            await self.call(lambda: self._add(group, subs, arrival, before))
        except asyncio.CancelledError:
            group.close()  # queued after the add, so it finds the requests if they got in
            raise
        return group

    def abort(self, request_ids: list[str]) -> None:
        """Thread-safe and non-blocking: callable from a `finally` during cancellation."""
        self._inbox.put(_Command(lambda: self._abort(request_ids)))

    async def snapshot(self) -> EngineSnapshot:
        return await self.call(self._snapshot)

    async def call(self, fn: Callable[[], object]) -> object:
        """Run fn on the engine thread between two steps; its result or error comes back."""
        if not self.alive:
            raise EngineFailure("the engine is not running")
        done: Future = Future()

        def run() -> None:
            result = fn()
            if done.set_running_or_notify_cancel():  # False: the waiter was cancelled
                done.set_result(result)

        self._inbox.put(_Command(run, done))
        return await asyncio.wrap_future(done)

    # ---------------------------------------------------------------- engine thread

    def _run(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception:  # a bug in this loop must not take the server down
                log.exception("engine loop error")

    def _iterate(self) -> bool:
        """Apply the commands that came in, then run one step; False once stopped."""
        idle = not self.engine.has_unfinished()
        commands = self._drain(block=idle, timeout=self.engine.idle_poll_s() if idle else None)
        if _STOP in commands:
            stopping = EngineFailure("the server is shutting down")
            for cmd in commands:
                if isinstance(cmd, _Command) and cmd.done is not None and not cmd.done.done():
                    cmd.done.set_exception(stopping)
            self._fail_all(stopping)
            return False
        for cmd in commands:
            self._apply(cmd)
        if self.engine.has_unfinished():
            self._step()
        self._release_idle()
        return True

    def _drain(self, block: bool, timeout: float | None = None) -> list[_Command | object]:
        """Every queued command; with `block`, wait for one first (at most `timeout` s)."""
        commands: list[_Command | object] = []
        if block:
            try:
                commands.append(self._inbox.get(timeout=timeout))
            except queue.Empty:  # idle for a poll period: time to look at idle memory
                return commands
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _release_idle(self) -> None:
        """Give back KV memory unused for --kv-idle-release-s.

        Called after every step and every idle wake-up; the engine rate-limits it.
        """
        try:
            self.engine.maybe_release_idle(time.monotonic())
        except Exception:
            log.exception("releasing idle KV memory failed")

    @staticmethod
    def _apply(cmd: _Command) -> None:
        try:
            cmd.run()
        except Exception as e:
            if cmd.done is not None and not cmd.done.done():
                if cmd.done.set_running_or_notify_cancel():
                    cmd.done.set_exception(e)  # the waiting handler turns it into a response
            else:
                log.exception("engine command failed")

    def _add(self, group: RequestGroup, subs: list[Submission], arrival: float,
             before: Callable[[LLMEngine], object] | None = None) -> None:
        if before is not None:
            before(self.engine)
        added = []
        try:
            for s in subs:
                self.engine.add_request(
                    s.request_id, {"prompt_token_ids": s.prompt_token_ids, "prompt": s.prompt},
                    s.params)
                added.append(s.request_id)
                self._tracked[s.request_id] = _Tracked(group, arrival)
        except Exception:
            self._abort(added)
            raise

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._tracked.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                if self.metrics:
                    self.metrics.request_finished("abort")

    def _snapshot(self) -> EngineSnapshot:
        e = self.engine
        return EngineSnapshot(
            running=len(e.scheduler.running), waiting=len(e.scheduler.waiting),
            kv=e.kv.stats(), preemptions=e.scheduler.num_preemptions,
            prompt_tokens=e.counters["prompt_tokens"],
            generation_tokens=e.counters["generation_tokens"],
            vtensor=e.runner.vtensor_stats(),
            kv_physical_bytes=None if e.runner.pool is None else e.runner.pool.physical_bytes(),
        )

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(EngineFailure(f"the engine failed: {type(e).__name__}: {e}"))
            return
        now = time.monotonic()
        for out in outs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted by its client this very step
            self._observe(tracked, out, now)
            if out.finished:
                del self._tracked[out.request_id]
            tracked.group.put(out)

    def _observe(self, t: _Tracked, out: RequestOutput, now: float) -> None:
        if self.metrics is None:
            return
        if t.first_token is None and out.new_token_ids:
            t.first_token = now
            self.metrics.ttft.observe(now - t.arrival)
        if out.finished:
            n = len(out.outputs[0].token_ids)
            self.metrics.e2e.observe(now - t.arrival)
            if n > 1 and t.first_token is not None:
                self.metrics.tpot.observe((now - t.first_token) / (n - 1))
            self.metrics.request_finished(out.outputs[0].finish_reason or "abort")

    def _fail_all(self, error: Exception) -> None:
        for rid, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("could not abort %s", rid)
            tracked.group.put(error)
        self._tracked.clear()
