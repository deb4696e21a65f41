"""The engine on the real Gemma 3 270M against HF transformers' greedy generate.

Prompts from 20 to 3000 tokens (crossing the 512-token window), one at a time
and batched, with chunked prefill, with a prefix-cache hit and under a pool
small enough to force preemption: greedy tokens must equal HF's (a near-tie
of HF's own top-2 logits is the one accepted divergence).
"""

from __future__ import annotations

import pytest
from hf_reference import NEW_TOKENS, assert_same_greedy, ledger_text

from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import SamplingParams
from kvserve.memory import KVCacheManager

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
MiB = 1 << 20


@pytest.fixture(scope="module")
def prompts(kv):
    ids = kv.tokenizer(ledger_text(260)).input_ids
    assert len(ids) > 3000
    return {"p20": ids[:20], "p700": ids[:700], "p3000": ids[:3000]}


def make_engine(kv, **kw) -> LLMEngine:
    args = dict(kv_memory=256 * MiB)
    args.update(kw)
    return LLMEngine(kv.model, kv.tokenizer, EngineConfig(**args))


def generate(engine: LLMEngine, token_lists, params=GREEDY):
    reqs = [engine.add_request(f"r{i}", {"prompt_token_ids": t}, params)
            for i, t in enumerate(token_lists)]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[r.request_id].outputs[0].token_ids for r in reqs], reqs


def check(hf_greedy, token_lists, outputs):
    for toks, out in zip(token_lists, outputs, strict=True):
        assert_same_greedy(out, hf_greedy(toks))


@pytest.fixture(scope="module")
def one_at_a_time(kv, prompts):
    """p20, p700 and p3000 through one engine, each alone, in that order: their tokens, and
    the KV held when p3000's prompt is computed (before its first decode step)."""
    engine = make_engine(kv)
    outs, held = {}, None
    for name, p in prompts.items():
        req = engine.add_request("r0", {"prompt_token_ids": p}, GREEDY)
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[name] = o.outputs[0].token_ids
            if name == "p3000" and held is None and req.num_computed >= len(p):
                held = engine.kv.stats().used
    return outs, held, engine


def test_one_at_a_time_matches_hf(hf_greedy, prompts, one_at_a_time):
    outs, _, _ = one_at_a_time
    for name, p in prompts.items():
        check(hf_greedy, [p], [outs[name]])


def test_batched_with_chunked_prefill_matches_hf(kv, hf_greedy, prompts):
    engine = make_engine(kv, max_num_batched_tokens=384)
    ps = list(prompts.values())
    out, _ = generate(engine, ps)
    check(hf_greedy, ps, out)
    assert engine.kv.stats().used == 0


def test_prefix_hit_computes_less_and_matches_hf(kv, hf_greedy, prompts):
    engine = make_engine(kv)
    generate(engine, [prompts["p700"]])
    follow = prompts["p700"][:650] + prompts["p20"][1:]  # shares 650 tokens, then differs
    out, reqs = generate(engine, [follow])
    assert reqs[0].num_cached_tokens == 640  # whole 16-token pages of the shared prefix
    check(hf_greedy, [follow], out)


def test_preemption_under_a_small_budget_matches_hf(kv, hf_greedy, prompts):
    base = prompts["p700"]
    # No shared prefix (a request would wait for another's and hit it instead).
    ps = [base[:1] + base[1 + 7 * i:300 + 40 * i] for i in range(3)]
    # 20 MiB does not hold the three requests' decodes: one is preempted mid-decode and
    # recomputed (at 24 MiB none is).
    engine = make_engine(kv, kv_memory=20 * MiB, max_num_batched_tokens=512)
    out, _ = generate(engine, ps)
    assert engine.scheduler.num_preemptions > 0
    check(hf_greedy, ps, out)
    assert engine.kv.stats().used == 0


def test_3000_token_request_holds_window_not_history(prompts, one_at_a_time):
    """Held KV <= 3 full layers x all tokens + 15 sliding x (window + a page); uniform: 18 x all.

    Measured on the one-at-a-time engine, where p3000 reuses p700's cached pages (whose
    sliding-window pages must be let go of like its own) and computes the other ~2300
    tokens in two steps; a fresh engine holds the same bytes.
    """
    p = prompts["p3000"]
    _, held, engine = one_at_a_time
    assert held is not None
    # The uniform baseline on the same specs and tokens, through the manager alone.
    uniform = KVCacheManager(engine.kv.model_specs, 256 * MiB, policy="uniform")
    uniform.add_request("r", list(p))
    uniform.lookup("r")
    assert uniform.allocate_slots("r", len(p))
    uniform.advance("r", len(p))
    per_token_layer = 2 * 256 * 4  # K+V, 1 KV head x 256 dims, float32
    T = 16
    n = len(p) + 1  # the first sampled token already has a slot
    limit = 3 * -(-n // T) * T * per_token_layer + 15 * (512 + T) * per_token_layer
    assert held <= limit
    assert uniform.stats().used >= 18 * len(p) * per_token_layer
