"""The host tier in the engine: conversations pushed out of the KV pool come back as hits.

Three conversations on the real Gemma 3 270M take turns under a KV pool that
holds about one of them, so each second turn finds its first turn evicted.
With a host tier the evicted pages were written there and the second turn
loads them back: it computes only its new tokens, and its greedy tokens equal
HF's and the engine's without the tier.
"""

from __future__ import annotations

import pytest
from hf_reference import NEW_TOKENS, assert_same_greedy, ledger_text, serve_in_order
from tiny_gemma import ByteTokenizer, tiny_gemma

from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import SamplingParams
from kvserve.memory import OutOfPages
from kvserve.physical.mempool import Addr

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
MiB = 1 << 20
DOC = 600


def serve(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    return serve_in_order(engine, prompts, GREEDY)


def conversations(tokenizer, engine_factory) -> tuple[list[list[int]], list[list[int]], list]:
    """Turn 1 of three conversations, then turn 2 (turn 1 + its answer + a question)."""
    ids = tokenizer(ledger_text(200)).input_ids
    first = [ids[:1] + ids[1 + DOC * d: DOC * (d + 1)] for d in range(3)]
    engine = engine_factory()
    answers, _ = serve(engine, first)
    ask = tokenizer("\nWhich ship came last?").input_ids[1:]
    second = [p + a + ask for p, a in zip(first, answers)]
    return first, second, engine


@pytest.mark.slow
def test_turns_evicted_to_the_host_tier_hit_with_the_same_tokens(kv, hf_greedy):
    def engine():
        return LLMEngine(kv.model, kv.tokenizer,
                         EngineConfig(kv_memory=32 * MiB, host_kv_memory=256 * MiB))

    first, second, tiered = conversations(kv.tokenizer, engine)
    outs, hits = serve(tiered, second)
    host = tiered.kv.stats().host
    assert host.pages_out > 0 and host.pages_in > 0
    # The pool holds about one conversation: without the tier the second turns of
    # the first two would find nothing (test_tiny_model_... shows the difference).
    assert all(h >= len(p) - 16 for h, p in zip(hits, first)), hits  # whole first turns
    assert host.hit_tokens >= sum(len(p) for p in first[:2]) - 2 * 16
    for prompt, out in zip(second, outs, strict=True):
        assert_same_greedy(out, hf_greedy(prompt))


def tiny_engine(**kw) -> LLMEngine:
    return LLMEngine(tiny_gemma(), ByteTokenizer(), EngineConfig(tokens_per_page=4, **kw))


def test_tiny_model_same_tokens_with_and_without_the_tier():
    texts = [f"conversation {i}: " + "abcdefghij" * 6 for i in range(6)]
    prompts = [ByteTokenizer().encode(t) for t in texts]
    again = [p + [40, 41, 42] for p in prompts]
    runs = {}
    for host in (0, 1 << 20):
        engine = tiny_engine(kv_memory=128 << 10, host_kv_memory=host)
        runs[host] = serve(engine, prompts + again)
    (outs0, hits0), (outs1, hits1) = runs[0], runs[1 << 20]
    assert outs0 == outs1
    assert sum(hits1) > sum(hits0)


def test_host_tier_config_errors():
    with pytest.raises(ValueError, match="paged"):
        EngineConfig(host_kv_memory=1 << 20, kv_backend="vtensor")
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig(host_kv_memory=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="bytes"):
        EngineConfig(host_kv_memory=-1)
    with pytest.raises(ValueError, match="host_kv_memory"):
        EngineConfig(host_kv_file="/tmp/x")


def test_mempool_api_round_trip(tmp_path):
    engine = tiny_engine(kv_memory=256 << 10, host_kv_memory=256 << 10,
                         host_kv_file=str(tmp_path / "host.kv"))
    pool = engine.mempool
    prompt = ByteTokenizer().encode("the same prefix, asked again and again")
    serve(engine, [prompt])
    n, addrs = pool.match(prompt)
    assert n == len(prompt) // 4 * 4 and all(a is None or a.tier == "device"
                                              for row in addrs.values() for a in row)
    full = [a for a in addrs["full"] if a is not None]
    before = pool.device.pages(0)[[a.page for a in full]].clone()

    moved = pool.swap_out(1 << 10)  # everything cached goes to the host tier
    assert moved > 0
    n2, addrs2 = pool.match(prompt)
    assert n2 == n and {a.tier for row in addrs2.values() for a in row if a} == {"host"}
    host_full = [a for a in addrs2["full"] if a is not None]
    assert (pool.host.pages(0)[[a.page for a in host_full]] == before).all()

    back = pool.swap_in(host_full)
    assert (pool.device.pages(0)[[a.page for a in back]] == before).all()
    pool.free_mem(back)

    assert pool.delete(prompt) > 0
    assert pool.match(prompt)[0] == 0
    # alloc_mem / transfer_with_insert: publish copies as the prompt's KV again
    dst = pool.transfer_with_insert(0, prompt, addrs2, tier="host")
    assert pool.match(prompt) == (n, dst)
    pool.free_mem([a for row in dst.values() for a in row if a is not None])
    with pytest.raises(NotImplementedError, match="remote"):
        pool.alloc_mem({"full": 1}, instance=3)
    with pytest.raises(OutOfPages):
        pool.alloc_mem({"full": 1 << 20})
    with pytest.raises(ValueError, match="host-tier"):
        pool.swap_in([Addr(0, "device", "full", 0)])


def test_host_file_must_be_new(tmp_path):
    path = tmp_path / "taken"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="exists"):
        tiny_engine(kv_memory=64 << 10, host_kv_memory=64 << 10, host_kv_file=str(path))


@pytest.mark.parametrize("seconds_per_token, loads", [(0.0, False), (1.0, True)])
def test_a_cost_profile_decides_load_or_recompute(tmp_path, seconds_per_token, loads):
    """Eq. 2 with a saved profile: free recompute never loads, costly recompute does."""
    from kvserve.engine.cost_model import CostModel, LinearOp

    path = tmp_path / "cost.json"
    CostModel([LinearOp("linear", [seconds_per_token, 0.0])], {}).save(path)
    texts = [f"conversation {i}: " + "abcdefghij" * 6 for i in range(6)]
    prompts = [ByteTokenizer().encode(t) for t in texts]
    engine = tiny_engine(kv_memory=128 << 10, host_kv_memory=1 << 20, cost_profile=str(path))
    serve(engine, prompts + [p + [40, 41] for p in prompts])
    host = engine.kv.stats().host
    assert host.pages_out > 0
    assert (host.hit_tokens > 0) == loads and (host.pages_in > 0) == loads


def test_aborts_and_preemptions_leave_no_page_held_on_either_tier():
    """Requests aborted mid-prefill or mid-decode, and preempted ones, under a pool that
    evicts every few steps: afterwards no device page is used and, once the write-behind
    copies are joined (the engine's last step before idling joins them), no host page
    is pinned."""
    engine = tiny_engine(kv_memory=96 << 10, host_kv_memory=1 << 20,
                         max_num_batched_tokens=24)
    texts = [f"request {i}: " + "klmnopqrst" * (3 + i % 4) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, t in enumerate(texts * 2):
        engine.add_request(f"r{i}", t, params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps % 3 == 0 and engine.requests:  # abort whichever request is oldest now
            engine.abort_request(next(iter(engine.requests)))
    st = engine.kv.stats()
    assert st.used == 0 and all(sp.n_used == 0 for sp in engine.kv.host.alloc.specs)
    assert st.host.pages_out > 0 and st.host.hit_tokens > 0
    assert engine.scheduler.num_preemptions > 0
    engine.add_request("last", texts[0] + " once more", params)  # an abort ends the work
    engine.step()
    engine.step()
    engine.abort_request("last")
    assert not engine.has_unfinished() and not engine.kv.host.ahead
    assert all(sp.n_used == 0 for sp in engine.kv.host.alloc.specs)
