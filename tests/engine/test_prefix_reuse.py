"""Long documents questioned in turn on the real Gemma 3 270M, under a tight KV budget.

Three 1200-token documents, each asked two questions, round robin (doc 0,
1, 2, 0, 1, 2), one request at a time. The 116 MiB budget holds the three
documents' full-attention KV and last windows, but not their whole KV (what
uniform paging would cache) and not the sliding-window pages every prefill
lets go of. The memory core's rules must keep the second question of every
document hitting the whole document, where the paper's plain LRU rules (out
-of-window pages cached as new) hit none; greedy tokens must still equal HF's.
The paper-rules run needs only the memory core's choices, so a stand-in with the
real model's KV layout and next to no compute serves it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_reference import NEW_TOKENS, assert_same_greedy, ledger_text, serve_in_order

from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import SamplingParams
from kvserve.models import Gemma3ForCausalLM

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
MiB = 1 << 20
DOC = 1200
BUDGET = 116 * MiB
QUESTION = 40  # tokens after the document

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def questions(kv):
    ids = kv.tokenizer(ledger_text(340)).input_ids
    assert len(ids) > 3 * DOC + 1
    docs = [ids[:1] + ids[1 + DOC * d: DOC * (d + 1)] for d in range(3)]
    asks = ["Which town paid the most for copper wire, and in which month was it, counting "
            "every shipment listed in the ledger above from the first line to the very last "
            "line of the final page?",
            "What did the last ship carry, who received the goods at the harbour, and how "
            "much did they pay for all of it, once the harbour fees and the taxes were added "
            "to the price they agreed?"]
    out = []
    for k in range(2):
        ask = kv.tokenizer(f"\nQuestion {k}: {asks[k]}").input_ids[1:1 + QUESTION]
        assert len(ask) == QUESTION
        out += [doc + ask for doc in docs]
    return out


def serve_in_turn(model, tokenizer, questions, paper_rules: bool):
    engine = LLMEngine(model, tokenizer, EngineConfig(kv_memory=BUDGET))
    if paper_rules:  # every released page cached under its release step, no marks, no loops
        for m in engine.kv.managers:
            m.reuse = None
        engine.kv.reuse.protect = False
    outs, hits = serve_in_order(engine, questions, GREEDY)
    return outs, hits, engine.kv


def test_documents_questioned_in_turn_keep_hitting(kv, hf_greedy, questions):
    per_token = 18 * 2 * 256 * 4  # 18 layers, K+V, 1 KV head x 256, float32
    assert 3 * DOC * per_token > BUDGET  # uniform paging cannot cache the three documents
    outs, hits, mgr = serve_in_turn(kv.model, kv.tokenizer, questions, paper_rules=False)
    assert hits == [0, 0, 0, DOC, DOC, DOC]
    assert mgr.hit_tokens == 3 * DOC  # counted by the manager at admission
    for prompt, out in zip(questions[3:], outs[3:], strict=True):  # served from the cache
        assert_same_greedy(out, hf_greedy(prompt))
    # The paper's rules on the same workload. What they cache, evict and hit depends on the
    # KV specs, the pool and the token counts alone (greedy outputs are never part of a
    # later prompt), so a twin with the real model's KV layout and next to no compute runs it.
    _, old_hits, old_mgr = serve_in_turn(layout_twin(kv.model), kv.tokenizer, questions,
                                         paper_rules=True)
    assert (old_mgr.model_specs, old_mgr.layout, old_mgr.pool_bytes) == (
        mgr.model_specs, mgr.layout, mgr.pool_bytes)
    assert sum(old_hits) < DOC


def layout_twin(model: Gemma3ForCausalLM) -> Gemma3ForCausalLM:
    """Random weights, hidden size 8 and one query head, but the same layers, window, KV
    heads, head size and dtype: the same KV specs, pages and schedule for the same tokens."""
    torch.manual_seed(0)
    config = dataclasses.replace(model.config, hidden_size=8, intermediate_size=8,
                                 num_attention_heads=model.config.num_key_value_heads)
    return Gemma3ForCausalLM(config).to(model.dtype).eval()


def test_two_questions_sent_together_compute_their_document_once(kv, hf_greedy, questions):
    # The second request waits while the first computes the document, then hits all of it.
    engine = LLMEngine(kv.model, kv.tokenizer, EngineConfig(kv_memory=BUDGET))
    pair = [questions[0], questions[3]]  # document 0, two questions
    reqs = [engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
            for i, p in enumerate(pair)]
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    assert [r.num_cached_tokens for r in reqs] == [0, DOC]
    for i, prompt in enumerate(pair):
        assert_same_greedy(outs[str(i)], hf_greedy(prompt))
