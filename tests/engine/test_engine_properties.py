"""The whole engine under random interleavings, on the tiny random Gemma 3.

Requests over shared documents, conversations' next turns (the previous
prompt, its answer and a new message), cancellations and steps arrive in an
order hypothesis draws, in pools small enough to preempt and evict. Every
request that runs to its end must give the reference's greedy tokens for its
prompt alone, and nothing may stay allocated once all have left: prefix hits,
held windows, marks, preemption and the liveness fallbacks (`go_lean`,
`drop_cache`) must never change what a request computes.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_gemma import VOCAB, ByteTokenizer, tiny_gemma

from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import InvalidRequest, SamplingParams
from kvserve.models import greedy_generate

STEPS = 5_000
DOCS = [[3 + (31 * d + 7 * i) % (VOCAB - 3) for i in range(120)] for d in range(3)]


@pytest.fixture(scope="module")
def tiny():
    return tiny_gemma()


def tokens(data, lo: int, hi: int) -> list[int]:
    return data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=lo, max_size=hi))


def step(eng: LLMEngine, done: dict, aborted: set) -> None:
    """One engine step; each request it finished (and no one cancelled) goes to done,
    as (its tokens, its finish reason)."""
    for out in eng.step():
        if out.finished and out.request_id not in aborted:
            done[out.request_id] = out.outputs[0].token_ids, out.outputs[0].finish_reason


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kib=st.integers(16, 160), budget=st.sampled_from([16, 64, 256]),
       T=st.sampled_from([1, 4]))
def test_random_interleavings_give_each_request_its_own_greedy_tokens(tiny, data, kib,
                                                                     budget, T):
    eng = LLMEngine(tiny, ByteTokenizer(), EngineConfig(
        kv_memory=kib << 10, tokens_per_page=T, max_num_batched_tokens=budget))
    prompts, limits, done, aborted = {}, {}, {}, set()
    for i in range(data.draw(st.integers(4, 40))):
        action = data.draw(st.sampled_from(["doc", "doc", "turn", "turn", "abort", "step"]))
        if action == "doc":
            doc = DOCS[data.draw(st.integers(0, len(DOCS) - 1))]
            prompt = doc[:data.draw(st.integers(1, len(doc)))] + tokens(data, 0, 8)
        elif action == "turn" and done:
            prev = data.draw(st.sampled_from(sorted(done)))
            prompt = prompts[prev] + done[prev][0] + tokens(data, 1, 8)
        elif action == "abort" and eng.has_unfinished():
            rid = data.draw(st.sampled_from(sorted(set(prompts) - set(done) - aborted)))
            eng.abort_request(rid)
            aborted.add(rid)
            continue
        else:
            step(eng, done, aborted)
            continue
        n = data.draw(st.integers(1, 32))
        try:
            eng.add_request(str(i), {"prompt_token_ids": prompt},
                            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        except InvalidRequest:  # larger than the pool, or than the context
            continue
        prompts[str(i)], limits[str(i)] = prompt, n
    for _ in range(STEPS):  # far more than the requests need, preempted or not
        if not eng.has_unfinished():
            break
        step(eng, done, aborted)
    assert not eng.has_unfinished(), "the engine stalled: " + str(
        [(r.request_id, r.num_computed, len(r.token_ids)) for r in eng.scheduler.running]
        + [(r.request_id, len(r.token_ids)) for r in eng.scheduler.waiting])
    assert eng.kv.stats().used == 0 and not eng.kv.reqs
    for rid, (got, reason) in done.items():
        if reason == "abort":  # stopped by the engine: only a sequence outgrowing the pool
            assert not eng.kv.fits_alone(len(prompts[rid]) + limits[rid], budget), rid
        else:
            assert len(got) == limits[rid]
        want = greedy_generate(tiny, [prompts[rid]], len(got))[0]
        assert got == want, rid
