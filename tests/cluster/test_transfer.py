"""transfer_with_insert between two engines in one process: what moves, and that it hits."""

import pytest
from cluster_helpers import tiny_engine

from kvserve.cluster.transfer import export_kv, import_kv
from kvserve.engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [2] + [(7 * i) % 250 + 3 for i in range(45)]  # 46 tokens: 11 full blocks of 4


def run(engine, prompt, rid="r"):
    engine.add_request(rid, {"prompt_token_ids": prompt}, GREEDY)
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            last = out
    return last


@pytest.fixture
def pair():
    return tiny_engine(), tiny_engine()


def test_imported_kv_is_a_hit_with_the_same_tokens(pair):
    a, b = pair
    want = run(a, PROMPT)
    payload = export_kv(a.mempool, PROMPT)
    assert len(payload.tokens) == 44  # every full block a hit needs (the last is computed)
    # full attention carries every block, the sliding window (8 tokens) only its last two
    assert payload.blocks == {"full": list(range(11)), "sliding": [9, 10]}
    assert payload.nbytes == sum(a.kv.layout.page_bytes[a.kv.layout.index(n)] * len(b_)
                                 for n, b_ in payload.blocks.items())
    assert import_kv(b.mempool, payload) == 13
    got = run(b, PROMPT)
    assert got.num_cached_tokens == 44
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert b.kv.stats().used == 0  # the imported pages are cache, held by no one


def test_blocks_the_receiver_holds_are_not_sent(pair):
    a, b = pair
    run(a, PROMPT)
    run(b, PROMPT[:25])  # b caches 6 blocks of the same prefix
    have, pins = b.kv.hold(PROMPT)
    assert have["full"] == set(range(6))
    b.kv.alloc.evict(1 << 20)  # evict everything evictable: the pinned pages stay
    again, more = b.kv.hold(PROMPT)
    assert again == have
    b.kv.release(more)
    payload = export_kv(a.mempool, PROMPT, have)
    assert payload.blocks["full"] == list(range(6, 11))
    import_kv(b.mempool, payload)
    b.kv.release(pins)
    assert b.kv.stats().used == 0
    assert run(b, PROMPT, "again").num_cached_tokens == 44


def test_a_receiver_without_room_imports_nothing_and_leaks_nothing():
    a, small = tiny_engine(), tiny_engine(kv_memory=48 << 10)
    run(a, PROMPT)
    payload = export_kv(a.mempool, PROMPT)
    small.add_request("busy", {"prompt_token_ids": PROMPT[::-1]}, GREEDY)
    small.step()  # its pages leave no room for the payload's 13
    before = small.kv.stats()
    assert import_kv(small.mempool, payload) == 0
    after = small.kv.stats()
    assert (after.used, after.evictable) == (before.used, before.evictable)
    while small.has_unfinished():
        small.step()
    want = run(a, PROMPT, "again").outputs[0].token_ids
    assert run(small, PROMPT).outputs[0].token_ids == want  # recomputed instead
    assert small.kv.stats().used == 0


def test_a_mamba_hybrid_moves_every_attention_block_and_one_state():
    """Memory core + byte pools only: a Jamba-like model's prefix travels as all of its
    full-attention pages and the single Mamba checkpoint the hit point needs."""
    import torch

    from kvserve.memory import KVCacheManager, KVSpec, LayerKind
    from kvserve.physical.mempool import MemPool
    from kvserve.physical.pool import KVPool

    specs = [KVSpec("attn", LayerKind.FULL, 2, 64),
             KVSpec("mamba", LayerKind.MAMBA, 6, 512, checkpoint_every=16)]

    def instance():
        kv = KVCacheManager(specs, 1 << 20, tokens_per_page=4)
        return MemPool(kv, KVPool(kv.layout, kv.alloc.num_large, {}))

    a, b = instance(), instance()
    tokens = list(range(3, 40))  # 37 tokens: a hit covers 9 blocks = 36 tokens
    a.kv.add_request("r", tokens)
    a.kv.lookup("r")
    a.kv.begin_step()
    assert a.kv.allocate_slots("r", len(tokens))
    a.kv.advance("r", len(tokens))
    a.kv.finish("r")
    for s in range(2):
        rows = a.device.pages(s)
        rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8))
    n, where = a.match(tokens)
    payload = export_kv(a, tokens)
    assert n == 32 and len(payload.tokens) == 32  # the last checkpoint before 36 is at 32
    assert payload.blocks == {"attn": list(range(8)), "mamba": [7]}
    assert import_kv(b, payload) == 9
    n_b, where_b = b.match(tokens)
    assert n_b == 32
    for name in ("attn", "mamba"):
        s = b.kv.layout.index(name)
        for pa, pb in zip(where[name], where_b[name]):
            assert (pa is None) == (pb is None)
            if pa is not None:
                assert torch.equal(a.device.pages(s)[pa.page], b.device.pages(s)[pb.page])
