"""The vllm_align policy: vLLM v1's block geometry for Mamba hybrids, hits in whole blocks."""

from invariants import check_invariants

from kvserve.memory import KVCacheManager, KVSpec, LayerKind
from kvserve.memory.baselines import vllm_block_size

MiB = 1 << 20
# Jamba-1.5-Mini's shapes: 4 attention layers of 4 KiB per token, 28 Mamba-1 layers
# of 8192 x (3 + 16) x bf16 = 304 KiB of state each.
JAMBA = [
    KVSpec("full", LayerKind.FULL, 4, 4096),
    KVSpec("mamba", LayerKind.MAMBA, 28, 311296),
]
# Bamba-9B's: 3 attention layers, 29 Mamba-2 layers of (8448 x 3 + 128 x 64 x 128) x bf16.
BAMBA = [
    KVSpec("full", LayerKind.FULL, 3, 4096),
    KVSpec("mamba", LayerKind.MAMBA, 29, 2147840),
]


def serve(mgr: KVCacheManager, rid, tokens: list[int]) -> int:
    """Prefill in one step, finish; returns the prefix hit."""
    mgr.begin_step()
    mgr.add_request(rid, tokens)
    hit = mgr.lookup(rid)
    assert mgr.allocate_slots(rid, len(tokens) - hit)
    mgr.advance(rid, len(tokens) - hit)
    mgr.begin_step()
    mgr.finish(rid)
    check_invariants(mgr)
    return hit


def test_block_size_is_vllms() -> None:
    # 16 x cdiv(state, 16 x 4096): 311296 B -> 80 tokens, 2147840 B -> 528 tokens
    # (vLLM logs the same 528 for Qwen3.5-4B, issue #40696).
    assert vllm_block_size(JAMBA) == 80
    assert vllm_block_size(BAMBA) == 528
    assert vllm_block_size(JAMBA, 64) == 128  # a larger kernel block rounds up to it
    assert vllm_block_size(JAMBA[:1]) == 16  # no Mamba: the kernel block


def test_layout_pads_states_and_layer_groups() -> None:
    jamba = KVCacheManager(JAMBA, 256 * MiB, 16, policy="vllm_align")
    assert jamba.T == 80
    block = 80 * 4096  # every layer's page: one attention block = one padded state
    # Groups of 4 layers (the fewest of a type): 1 attention group, 7 Mamba groups.
    assert jamba.layout.page_bytes == (4 * block, 28 * block)
    mamba = jamba.layout.specs[1]
    assert (mamba.checkpoint_every, mamba.checkpoint_last_only) == (80, True)
    bamba = KVCacheManager(BAMBA, 1 << 30, 16, policy="vllm_align")
    # 29 Mamba layers in groups of 3: 10 groups, one padding layer.
    assert bamba.layout.page_bytes == (3 * 528 * 4096, 30 * 528 * 4096)
    # Without Mamba layers the layout is jenga's.
    plain = KVCacheManager(JAMBA[:1], 64 * MiB, 16, policy="vllm_align")
    assert (plain.T, plain.layout.page_bytes) == (16, (4 * 16 * 4096,))


def test_a_prefix_of_one_and_a_half_blocks_hits_one_block() -> None:
    vllm = KVCacheManager(JAMBA, 512 * MiB, 16, policy="vllm_align")
    jenga = KVCacheManager(JAMBA, 512 * MiB, 16)
    B = vllm.T
    turn1 = list(range(3 * B // 2))  # 120 tokens: 1.5 blocks
    turn2 = turn1 + [7001] * 50  # the next turn extends the conversation
    for mgr in (vllm, jenga):
        assert serve(mgr, "a", turn1) == 0
    assert serve(vllm, "b", turn2) == B  # one whole block: 80 of the 120 tokens
    # jenga checkpoints every 512 tokens: 120 shared tokens hit nothing.
    assert serve(jenga, "b", turn2) == 0
    jenga8 = KVCacheManager([JAMBA[0], KVSpec("mamba", LayerKind.MAMBA, 28, 311296,
                                              checkpoint_every=16)], 512 * MiB, 16)
    assert serve(jenga8, "a", turn1) == 0
    assert serve(jenga8, "b", turn2) == 112  # checkpoints every 16: all but 8 tokens


def test_one_state_per_step_at_its_last_block_end() -> None:
    vllm = KVCacheManager(JAMBA, 512 * MiB, 16, policy="vllm_align")
    B = vllm.T
    tokens = list(range(5 * B + 30))
    vllm.begin_step()
    vllm.add_request("a", tokens)
    vllm.lookup("a")
    assert vllm.allocate_slots("a", len(tokens))
    # The live state and one checkpoint at 5B, not one per block end.
    assert [pos for pos, _ in vllm.pending_copies("a", "mamba")] == [5 * B]
    vllm.advance("a", len(tokens))
    vllm.finish("a")
    check_invariants(vllm)
    vllm.begin_step()
    assert serve(vllm, "b", tokens + [9]) == 5 * B
    assert serve(vllm, "c", tokens[:3 * B + 10]) == 0  # no state at 3B
