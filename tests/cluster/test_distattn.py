"""DistAttention between engines in one process: a request longer than its instance's pool
completes with its KV spread over creditors, with a big enough instance's greedy tokens."""

import pytest
from cluster_helpers import tiny_engine

from kvserve.cluster.distattn import Debtor, LocalCreditor, ShardStore
from kvserve.engine.request import InvalidRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = [2] + [(7 * i + i * i) % 250 + 3 for i in range(299)]  # 300 tokens, 75 blocks of 4
SMALL = 128 << 10  # 64 pages of 2 KiB: 300 tokens need 75 full-attention pages alone


def run(engine, prompts, others=()):
    """Step `engine` (and any creditor engines with work) until every request is done."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, GREEDY)
    done = {}
    while engine.has_unfinished() or any(o.has_unfinished() for o in others):
        for e in (engine, *others):
            if e.has_unfinished():
                for out in e.step():
                    if out.finished:
                        done[out.request_id] = out
    return done


def spread_pair(creditors=1, kv_memory=SMALL):
    debtor = tiny_engine(kv_memory=kv_memory)
    stores = [ShardStore(tiny_engine(kv_memory=1 << 20)) for _ in range(creditors)]
    handles = [LocalCreditor(f"c{i}", s) for i, s in enumerate(stores)]
    lender = Debtor(debtor, lambda n: handles)
    debtor.lend_with(lender)
    return debtor, lender, stores


def test_a_prompt_longer_than_the_pool_is_refused_alone():
    with pytest.raises(InvalidRequest, match="more KV memory"):
        tiny_engine(kv_memory=SMALL).add_request("x", {"prompt_token_ids": LONG}, GREEDY)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_a_spread_request_gives_a_big_instances_greedy_tokens(path):
    want = run(tiny_engine(), {"r": LONG})["r"].outputs[0].token_ids
    debtor, lender, stores = spread_pair()
    if path == "torch":  # the path GPUs take: gathered pages, torch attention
        debtor.runner.attn.kernels = None
    got = run(debtor, {"r": LONG})["r"]
    assert got.outputs[0].token_ids == want and got.outputs[0].finish_reason == "length"
    # At least what did not fit its pool lived on the creditor (78 full blocks, 64 pages),
    # full-attention pages only: the sliding window stayed.
    full_page = debtor.kv.layout.page_bytes[debtor.kv.layout.index("full")]
    assert lender.moved_bytes >= (78 - 64) * full_page
    assert lender.moved_bytes % full_page == 0
    # Nothing leaks: the creditor dropped its shards, the debtor holds no page.
    assert stores[0].shards == {} and stores[0].engine.kv.stats().used == 0
    assert debtor.kv.stats().used == 0 and lender.lent == {}


def test_short_requests_beside_a_spread_one_and_on_the_creditor():
    short = {f"s{i}": [2] + [(11 * i + 5 * j) % 250 + 3 for j in range(20)] for i in range(3)}
    want = run(tiny_engine(), {"r": LONG, **short})
    debtor, _, stores = spread_pair()
    creditor = stores[0].engine
    # The creditor serves its own requests while it holds the debtor's blocks.
    for rid, prompt in short.items():
        creditor.add_request("own-" + rid, {"prompt_token_ids": prompt}, GREEDY)
    got = run(debtor, {"r": LONG, **short}, others=[creditor])
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    assert stores[0].shards == {} and creditor.kv.stats().used == 0


def test_spread_over_two_creditors_when_one_is_full():
    want = run(tiny_engine(), {"r": LONG})["r"].outputs[0].token_ids
    debtor = tiny_engine(kv_memory=SMALL)
    # The first creditor lends at most half of a small pool; the rest goes to the second.
    stores = [ShardStore(tiny_engine(kv_memory=96 << 10)), ShardStore(tiny_engine())]
    handles = [LocalCreditor(f"c{i}", s) for i, s in enumerate(stores)]
    took = {h.name: 0 for h in handles}
    for h in handles:
        def counted(req, n, debtor="", h=h, take=h.try_move_kvcache):
            ok = take(req, n, debtor)
            took[h.name] += n if ok else 0
            return ok
        h.try_move_kvcache = counted
    lender = Debtor(debtor, lambda n: handles)
    debtor.lend_with(lender)
    got = run(debtor, {"r": LONG})["r"]
    assert got.outputs[0].token_ids == want
    assert took["c0"] > 0 and took["c1"] > 0
    # c0 never lent more than its share of its pool
    assert took["c0"] * 2048 <= stores[0].limit  # one full spec, 2 KiB pages
    assert all(s.shards == {} and s.engine.kv.stats().used == 0 for s in stores)


def test_no_creditor_room_fails_the_request_and_keeps_the_engine():
    debtor, lender, stores = spread_pair()
    lender.creditors = lambda n: []  # the cluster lends nothing
    out = run(debtor, {"r": LONG})["r"]
    assert out.outputs[0].finish_reason == "abort"
    assert debtor.kv.stats().used == 0
    # The engine goes on serving what fits.
    short = run(debtor, {"s": LONG[:40]})["s"]
    assert len(short.outputs[0].token_ids) == GREEDY.max_tokens
