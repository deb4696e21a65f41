"""The cluster's front end: routes each request through its instances, streams it back.

`Cluster` stands where a single server has its EngineLoop (add / abort /
snapshot / alive), so the same OpenAI routes, streaming and error handling serve
a cluster. Per request it runs one asyncio task in the front end's event loop:

    choose the instance(s)            GlobalScheduler (policy, prompt trees, load)
    colocated: stream from it         Instance.generate, a Ray streaming generator
    disaggregated: P prefills ->      Instance.prefill returns the first token and,
      D imports the KV and decodes    as a second object, the KV: Ray hands that
                                      object to D without the front end reading it
    afterwards                        learn the prompt trees; pd-caching-3: D's
                                      finished turn goes back to P

Failures (MemServe §4.4): heartbeats poll every instance (load, KV events); one
that dies, or times out, is removed: its prompt-tree entries go, and the
requests it was serving start again elsewhere from where their streams got
(prompt + the tokens already sent), so no client sees the loss. Nothing needs
releasing on the survivors: a transfer is copied into the receiver's own pages
and cached there, never held on behalf of another instance.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions as rex

from kvserve.cluster.disagg import Design, design
from kvserve.cluster.global_scheduler import GlobalScheduler, Member
from kvserve.cluster.instance import (
    COLOCATED,
    DECODE,
    PREFILL,
    Heartbeat,
    Instance,
    finished_early,
)
from kvserve.cluster.placement import GManager, PerfModel
from kvserve.cluster.prompt_tree import block_hashes
from kvserve.engine.engine import LLMEngine
from kvserve.engine.request import CompletionOutput, InvalidRequest, RequestOutput
from kvserve.models.dist_attention import RemoteKVLost
from kvserve.server.engine_loop import EngineFailure, RequestGroup, Submission

log = logging.getLogger("kvserve.cluster")
# what a call raises when its instance is gone (killed, crashed, its node lost)
# Algorithm 1's thresholds: instances running at most BETA_THRES requests may borrow,
# those at most UTIL_THRES full may lend (and are never filled past it).
BETA_THRES, UTIL_THRES = 4, 0.8
MIN_SAMPLES = 16  # decode steps before the performance model is fitted
LOST = (rex.RayActorError, rex.ActorUnavailableError, rex.OwnerDiedError, rex.ObjectLostError)


@dataclass
class InstanceSpec:
    name: str
    role: str
    build: Callable[[], LLMEngine]  # runs inside the actor: loads the model there
    threads: int | None = None  # torch threads of this instance


@dataclass
class _Vocab:
    vocab_size: int


@dataclass
class FrontModel:
    """What the OpenAI layer reads from an engine, here gathered from the instances."""

    tokenizer: Any
    max_model_len: int
    config: _Vocab


class InstanceLost(Exception):
    def __init__(self, member: Member) -> None:
        super().__init__(f"instance {member.name} is gone")
        self.member = member


class Cluster:
    def __init__(self, scheduler: GlobalScheduler, design_name: str = "colocated", *,
                 heartbeat_s: float = 0.5, heartbeat_timeout_s: float = 10.0,
                 retries: int = 3, dist_attention: bool = False) -> None:
        """`dist_attention`: an instance whose pool is full lends running requests' KV to
        the others (Infinite-LLM's DistAttention), so prompts longer than one pool run."""
        self.scheduler, self.design = scheduler, design(design_name)
        self.dist_attention = dist_attention
        # Infinite-LLM's gManager: the placement map from the instances' heartbeats, and
        # Algorithm 1 once their decode steps have fitted the performance model.
        self.gmanager = GManager(PerfModel(1, 0.0, 0.0, 0.0), BETA_THRES, UTIL_THRES)
        self.step_samples: deque[tuple[int, int, float]] = deque(maxlen=1024)
        self.fitted = False
        self.heartbeat_s, self.heartbeat_timeout_s, self.retries = (
            heartbeat_s, heartbeat_timeout_s, retries)
        self.engine: FrontModel | None = None
        self.metrics = None  # ServerMetrics: latency histograms observed here
        self._tasks: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._beat: asyncio.Task | None = None
        self.max_prompt = 0  # longest prompt every role's pool fits (InvalidRequest beyond)
        self.lost: list[str] = []  # instances removed after failing

    # ------------------------------------------------------------ instances

    def launch(self, specs: Sequence[InstanceSpec]) -> None:
        """Start the instances as Ray actors and wait until each has loaded its model."""
        roles = {s.role for s in specs}
        needed = {PREFILL, DECODE} if self.design.disaggregated else {COLOCATED}
        if roles != needed:
            raise ValueError(f"design {self.design.name} needs instances of roles "
                             f"{sorted(needed)}, got {sorted(roles)}")
        actors = [self._actor(s) for s in specs]
        infos = ray.get([a.info.remote() for a in actors])
        members = [Member(info, a) for info, a in zip(infos, actors)]
        for m in members:
            self.scheduler.add(m)
        self._refresh_limits()
        ray.get(self._share_peers())
        tok = ray.get(members[0].handle.tokenizer.remote())
        self.engine = FrontModel(tok, min(m.info.max_model_len for m in members),
                                 _Vocab(infos[0].vocab_size))

    async def add_instance(self, spec: InstanceSpec) -> Member:
        """Start one more instance while serving; it takes requests once loaded."""
        actor = self._actor(spec)
        member = Member(await actor.info.remote(), actor)
        self.scheduler.add(member)
        self._refresh_limits()
        await asyncio.gather(*self._share_peers())
        return member

    def _share_peers(self) -> list[Any]:
        """Tell every instance the others (DistAttention's creditors); their calls."""
        if not self.dist_attention:
            return []
        peers = {m.name: m.handle for m in self.scheduler.members.values()}
        return [m.handle.set_peers.remote(peers) for m in self.scheduler.members.values()]

    @staticmethod
    def _actor(spec: InstanceSpec) -> Any:
        # num_cpus=0: instances share the machine's cores by their torch threads, and
        # Ray's CPU accounting must not refuse a second actor on a 2-core machine.
        return ray.remote(Instance).options(num_cpus=0).remote(
            spec.name, spec.role, spec.build, spec.threads)

    def _refresh_limits(self) -> None:
        members = list(self.scheduler.members.values())
        if not members:
            return
        self.max_prompt = min(m.info.max_prompt for m in members)
        if self.dist_attention:  # its own pool, and what every other instance lends
            lend = sum(m.info.lend_tokens for m in members)
            self.max_prompt = min(min(m.info.max_prompt + lend - m.info.lend_tokens
                                      for m in members),
                                  min(m.info.max_model_len for m in members) - 1)

    def remove(self, name: str, why: str) -> None:
        if self.scheduler.remove(name) is not None:
            log.warning("instance %s removed: %s", name, why)
            self.lost.append(name)
            self._refresh_limits()
            self.gmanager.drop_instance(name)
            if self.dist_attention:  # what its requests lent elsewhere goes too
                self._share_peers()
                for m in self.scheduler.members.values():
                    m.handle.drop_debtor.remote(name)

    # -------------------------------------------------- EngineLoop's interface

    def start(self) -> None:
        if self._beat is None:
            self._beat = asyncio.get_running_loop().create_task(self._heartbeats())

    def stop(self, timeout: float = 30.0) -> None:
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
        for task in list(self._tasks.values()) + list(self._background):
            task.cancel()

    def shutdown(self) -> None:
        """Kill every instance actor (the cluster owns them)."""
        self.stop()
        for m in list(self.scheduler.members.values()):
            ray.kill(m.handle)
            self.scheduler.remove(m.name)

    @property
    def alive(self) -> bool:
        roles = {m.info.role for m in self.scheduler.members.values()}
        needed = {PREFILL, DECODE} if self.design.disaggregated else {COLOCATED}
        return needed <= roles

    async def add(self, subs: list[Submission], arrival: float) -> RequestGroup:
        """Route every submission; InvalidRequest (nothing started) as a single engine would."""
        if not self.alive:
            raise EngineFailure("no live instances to serve the request")
        for s in subs:
            self._check(s)
        group = RequestGroup(self, [s.request_id for s in subs])
        for s in subs:
            task = asyncio.get_running_loop().create_task(
                self._serve(s, group, arrival))
            self._tasks[s.request_id] = task
            task.add_done_callback(lambda _, rid=s.request_id: self._tasks.pop(rid, None))
        return group

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            task = self._tasks.get(rid)
            if task is not None:
                task.cancel()

    async def snapshot(self) -> dict[str, Any]:
        """Per live instance (name -> (role, EngineSnapshot)); an instance that does not
        answer is left out."""
        members = list(self.scheduler.members.values())
        results = await asyncio.gather(
            *[asyncio.wait_for(_awaitable(m.handle.snapshot.remote()), self.heartbeat_timeout_s)
              for m in members], return_exceptions=True)
        return {m.name: (m.info.role, r) for m, r in zip(members, results)
                if not isinstance(r, BaseException)}

    def _check(self, s: Submission) -> None:
        assert self.engine is not None
        vocab = self.engine.config.vocab_size
        bad = [t for t in s.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"unknown token ids {bad[:5]} (vocabulary has {vocab})")
        n = len(s.prompt_token_ids)
        if not n:
            raise InvalidRequest("the prompt is empty")
        if n >= self.engine.max_model_len:
            raise InvalidRequest(f"the prompt has {n} tokens; this model takes at most "
                                 f"{self.engine.max_model_len - 1} so that one token can be "
                                 "generated")
        if n > self.max_prompt:
            raise InvalidRequest(f"the prompt of {n} tokens needs more KV memory than the "
                                 f"instances' pools hold (at most {self.max_prompt} tokens)")
        s.params.validate(vocab)

    # ----------------------------------------------------------- one request

    async def _serve(self, sub: Submission, group: RequestGroup, arrival: float) -> None:
        """Run sub until it finishes, starting again elsewhere when an instance dies."""
        sent = _Sent(sub)
        try:
            for _ in range(self.retries + 1):
                part = sent.remainder()
                if part is None:  # everything was sent before the instance died
                    group.put(sent.finish("length"))
                    return
                try:
                    # read to the end: after the last output an attempt learns and moves KV
                    async for out in self._attempt(part):
                        out = sent.stitch(out)
                        self._observe(arrival, sent, out)
                        group.put(out)
                    return
                except InstanceLost as e:
                    if not await self.check_all():
                        raise EngineFailure(f"{e} (but every instance answers)") from e
                except RemoteKVLost:  # a creditor died: recompute, lending to survivors
                    await self.check_all()
            group.put(EngineFailure(f"no instance could finish {sub.request_id} after "
                                    f"{self.retries} retries"))
        except asyncio.CancelledError:
            raise
        except InvalidRequest as e:
            group.put(e)
        except Exception as e:  # a bug or a failed instance call: fail only this request
            log.exception("request %s failed", sub.request_id)
            group.put(EngineFailure(f"the cluster failed: {type(e).__name__}: {e}"))

    def _attempt(self, sub: Submission) -> AsyncIterator[RequestOutput]:
        if self.design.disaggregated:
            return self._disaggregated(sub)
        return self._colocated(sub)

    async def _colocated(self, sub: Submission) -> AsyncIterator[RequestOutput]:
        m, cached = await self._route(COLOCATED, sub)
        self.scheduler.started(m, sub.request_id, len(sub.prompt_token_ids), cached)
        out = None
        try:
            async for out in _stream(m, m.handle.generate, sub):
                yield out
        finally:
            self.scheduler.done(m, sub.request_id)
        if out is not None:
            self.scheduler.learn(m, sub.prompt_token_ids + out.outputs[0].token_ids,
                                 time.monotonic())

    async def _disaggregated(self, sub: Submission) -> AsyncIterator[RequestOutput]:
        d_: Design = self.design
        prompt = sub.prompt_token_ids
        p, cached = await self._route(PREFILL, sub)
        d, _ = await self._route(DECODE, sub, pull=False)
        have = None
        if d_.keep_at_decode:  # pinned at d until its lookup took them (lease: the request)
            have = await _call(d, d.handle.held.remote(prompt, sub.request_id))
        self.scheduler.started(p, sub.request_id, len(prompt), cached)
        out_ref, kv_ref = p.handle.prefill.options(num_returns=2).remote(
            sub, have, d_.keep_at_prefill)
        try:
            first = await _call(p, out_ref)
        except asyncio.CancelledError:  # the client left: stop the prefill there too
            _cancel(out_ref)
            raise
        finally:
            self.scheduler.done(p, sub.request_id)
        if d_.keep_at_prefill:
            self.scheduler.learn(p, prompt, time.monotonic())
        if finished_early(first, sub):
            yield first
            return
        yield dataclasses.replace(first, finished=False, outputs=[dataclasses.replace(
            first.outputs[0], finish_reason=None)])
        head = first.outputs[0].token_ids
        rest = Submission(sub.request_id, prompt + head, None, dataclasses.replace(
            sub.params, max_tokens=sub.params.max_tokens - len(head)), sub.session)
        self.scheduler.started(d, sub.request_id, 1, 1)
        out = None
        try:
            async for out in _stream(d, d.handle.decode, rest, kv_ref, d_.keep_at_decode):
                yield _after(first, out)
        finally:
            self.scheduler.done(d, sub.request_id)
        if out is None or not out.finished:
            return
        tokens = rest.prompt_token_ids + out.outputs[0].token_ids
        if d_.keep_at_decode:
            self.scheduler.learn(d, tokens, time.monotonic())
        if d_.return_to_prefill:
            self._later(self._move(d, p, tokens))

    async def _route(self, role: str, sub: Submission,
                     pull: bool = True) -> tuple[Member, int]:
        """The scheduler's choice; under prompt-tree, first pull a longer cached prefix
        from another instance of the role when Eq. 2 says moving beats recomputing."""
        tokens, now = sub.prompt_token_ids, time.monotonic()
        block = next(iter(self.scheduler.members.values())).info.block
        hashes = block_hashes(tokens, block)
        m, cached = self.scheduler.choose(role, hashes, len(tokens), now, sub.session)
        if pull and self.scheduler.policy == "prompt-tree":
            plan = self.scheduler.plan_pull(role, m, hashes, len(tokens), now)
            if plan is not None:
                try:
                    await self._move(plan.source, m, tokens[:plan.blocks * block])
                    cached = plan.blocks
                except InstanceLost:
                    await self.check_all()  # the pull is skipped: the tokens get recomputed
        return m, cached

    async def _move(self, src: Member, dst: Member, tokens: list[int]) -> int:
        """transfer_with_insert between two instances: src's cached KV of tokens, less
        what dst holds, into dst's cache. Returns the pages dst inserted."""
        lease = f"move-{uuid.uuid4().hex}"
        # What Eq. 2 sees queued on both NICs meanwhile (at most the tokens' KV)
        nbytes = int(len(tokens) * src.info.kv_bytes_per_token)
        self.scheduler.transfer(src, dst, nbytes)
        try:
            have = await _call(dst, dst.handle.held.remote(tokens, lease))
            ref = src.handle.export_kv.remote(tokens, have)
            n = await _call(dst, dst.handle.import_kv.remote(ref, lease))
        finally:
            self.scheduler.transfer(src, dst, -nbytes)
        self.scheduler.learn(dst, tokens, time.monotonic())
        return n

    def _later(self, coro: Any) -> None:
        """Run off the request's path (pd-caching-3's return); failures are logged."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.warning("background transfer failed: %r", t.exception())
        task.add_done_callback(done)

    async def drain(self) -> None:
        """Wait until every request's task and background transfer has ended."""
        while self._background or self._tasks:
            await asyncio.gather(*self._background, *self._tasks.values(),
                                 return_exceptions=True)

    # ------------------------------------------------------------ heartbeats

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self.beat()

    async def beat(self) -> None:
        """One heartbeat round: load and KV events from every instance; the silent go."""
        beats = await self._poll_all(lambda m: m.handle.poll.remote())
        for hb in beats:
            self.scheduler.heartbeat(hb)
        if self.dist_attention:
            self._place(beats)
        now = time.monotonic()
        for tree in self.scheduler.trees.values():
            tree.expire(now)

    def _place(self, beats: list[Heartbeat]) -> None:
        """One gManager round: the instances' entries into the placement map, each
        instance told its creditors (most free first, never a debtor), and Algorithm 1's
        moves sent to their debtors (move_kvcache; a stale one is refused there)."""
        gm, members = self.gmanager, self.scheduler.members
        for hb in beats:
            if hb.load is not None:
                gm.heartbeat(hb.load, hb.entries)
            self.step_samples.extend(hb.samples)
        for m in members.values():
            m.handle.set_creditors.remote(gm.creditors(m.name, 1))
        if self._fit():
            for mv in gm.plan():
                if mv.src in members and mv.dst in members:
                    members[mv.src].handle.move_kvcache.remote(mv.req_id, mv.num_blocks,
                                                               mv.dst)

    def _fit(self) -> bool:
        """Eq. 5 fitted on the instances' own decode steps (batch, blocks, seconds), once
        they vary enough to determine it."""
        samples = list(self.step_samples)
        if len(samples) < MIN_SAMPLES or len({(b, k) for b, k, _ in samples}) < 3:
            return self.fitted
        try:
            perf = PerfModel.fit(samples, n_layers=1)
        except ValueError:
            return self.fitted
        if perf.per_block_s > 0 and perf.fixed_s + perf.per_seq_s > 0:
            self.gmanager.perf, self.fitted = perf, True
        return self.fitted

    async def check_all(self) -> list[str]:
        """Ping every instance (a call failed: which one died?); returns those removed."""
        before = set(self.scheduler.members)
        await self._poll_all(lambda m: m.handle.ping.remote())
        return sorted(before - set(self.scheduler.members))

    async def _poll_all(self, call: Callable[[Member], Any]) -> list[Any]:
        """call on every instance at once; one that fails or stays silent is removed."""
        members = list(self.scheduler.members.values())
        results = await asyncio.gather(
            *[asyncio.wait_for(_call(m, call(m)), self.heartbeat_timeout_s)
              for m in members], return_exceptions=True)
        for m, r in zip(members, results):
            if isinstance(r, BaseException):
                self.remove(m.name, f"no answer ({type(r).__name__})")
        return [r for r in results if not isinstance(r, BaseException)]

    # --------------------------------------------------------------- metrics

    def _observe(self, arrival: float, sent: _Sent, out: RequestOutput) -> None:
        if self.metrics is None:
            return
        now = time.monotonic()
        if sent.first_token is None and out.new_token_ids:
            sent.first_token = now
            self.metrics.ttft.observe(now - arrival)
        if out.finished:
            n = len(out.outputs[0].token_ids)
            self.metrics.e2e.observe(now - arrival)
            if n > 1 and sent.first_token is not None:
                self.metrics.tpot.observe((now - sent.first_token) / (n - 1))
            self.metrics.request_finished(out.outputs[0].finish_reason or "abort")


# ---------------------------------------------------------------- helpers


class _Sent:
    """What a request has streamed so far, to start it again elsewhere and to stitch
    the new instance's outputs (relative to its own prompt) onto the old ones."""

    def __init__(self, sub: Submission) -> None:
        self.sub = sub
        self.ids: list[int] = []  # tokens sent before the current attempt
        self.text = ""
        self.cur_ids: list[int] = []  # ... and within it
        self.cur_text = ""
        self.cached: int | None = None
        self.first_token: float | None = None

    def remainder(self) -> Submission | None:
        self.ids, self.text = self.ids + self.cur_ids, self.text + self.cur_text
        self.cur_ids, self.cur_text = [], ""
        left = self.sub.params.max_tokens - len(self.ids)
        if left <= 0:
            return None
        return Submission(self.sub.request_id, self.sub.prompt_token_ids + self.ids, None,
                          dataclasses.replace(self.sub.params, max_tokens=left),
                          self.sub.session)

    def stitch(self, out: RequestOutput) -> RequestOutput:
        self.cur_ids = list(out.outputs[0].token_ids)
        self.cur_text += out.new_text
        if self.cached is None:
            self.cached = out.num_cached_tokens
        o = out.outputs[0]
        full = CompletionOutput(0, self.text + (o.text if out.finished else self.cur_text),
                                self.ids + self.cur_ids, o.finish_reason, o.stop_reason)
        return RequestOutput(self.sub.request_id, self.sub.prompt, self.sub.prompt_token_ids,
                             [full], out.finished, self.cached, out.new_text,
                             list(out.new_token_ids))

    def finish(self, reason: str) -> RequestOutput:
        full = CompletionOutput(0, self.text, self.ids, reason)
        return RequestOutput(self.sub.request_id, self.sub.prompt, self.sub.prompt_token_ids,
                             [full], True, self.cached or 0)


def _after(first: RequestOutput, out: RequestOutput) -> RequestOutput:
    """A decode instance's output, continuing the prefill instance's first token."""
    f, o = first.outputs[0], out.outputs[0]
    full = CompletionOutput(0, f.text + o.text, f.token_ids + o.token_ids, o.finish_reason,
                            o.stop_reason)
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, [full],
                         out.finished, first.num_cached_tokens, out.new_text,
                         list(out.new_token_ids))


async def _awaitable(ref: Any) -> Any:
    return await ref



async def _call(m: Member, ref: Any) -> Any:
    """Await an instance's call; its death becomes InstanceLost, its refusal the error."""
    try:
        return await ref
    except LOST as e:
        raise InstanceLost(m) from e
    except rex.RayTaskError as e:
        cause = e.as_instanceof_cause()
        if isinstance(cause, InvalidRequest):
            raise InvalidRequest(str(e.cause)) from None
        if isinstance(cause, RemoteKVLost):
            raise RemoteKVLost(e.cause.req_id) from None
        raise


async def _stream(m: Member, method: Any, *args: Any) -> AsyncIterator[RequestOutput]:
    """An instance's streaming generator, cancelled (aborting the request there) however
    the consumer stops."""
    gen = method.options(num_returns="streaming").remote(*args)
    done = False
    try:
        async for ref in gen:
            yield await _call(m, ref)
        done = True
    except LOST as e:
        raise InstanceLost(m) from e
    finally:
        if not done:
            _cancel(gen)


def _cancel(ref: Any) -> None:
    """Cancel an instance's call (a request, or a streaming generator); the instance
    aborts it and frees its pages. A call already finished or lost is left alone."""
    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 (the actor may be gone; nothing left to stop)
        log.debug("cancel failed", exc_info=True)
