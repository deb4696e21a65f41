"""Llama 4 text (chunked local attention, NoPE global layers with temperature tuning,
L2 qk-norm, mixture of experts) against transformers.

A tiny seeded random model saved and loaded back as an HF directory: 4 layers (three
chunked RoPE layers, the fourth NoPE and global), MoE on layers 1 and 3 (top-2 of 4
experts), chunks of 8 tokens over 4-token pages, so prompts of 5-61 tokens cross chunks
and pages. floor_scale 4 makes the NoPE layers' query temperature grow within the
prompts (HF's 8192 would leave it at 1). Each prompt is compared with HF's generate run
alone: HF's left-padded batches shift its temperature positions.
"""

from __future__ import annotations

import pytest
import torch
from hf_tiny import (
    BASE,
    check_alone_then_cached,
    check_bounded,
    check_greedy,
    check_preemption,
    engine_greedy,
    engine_run,
    hf_greedy,
    load_engine,
    random_prompts,
    save_tiny,
)

from kvserve.engine.engine import LLMEngine
from kvserve.memory.spec import LayerKind
from kvserve.models.attention_ref import sequence_logits
from kvserve.models.llama4 import Llama4MoE

NEW = 12
LENGTHS = [23, 5, 61, 40]
CHUNK, PAGE = 8, 4


def _save(directory, chunk: int = CHUNK):
    import transformers as tf

    cfg = tf.Llama4TextConfig(**{**BASE, "intermediate_size": 32}, num_hidden_layers=4,
                              head_dim=16, intermediate_size_mlp=128, attention_chunk_size=chunk,
                              num_local_experts=4, num_experts_per_tok=2,
                              interleave_moe_layer_step=2, floor_scale=4, attn_scale=0.5)
    return save_tiny(cfg, tf.Llama4ForCausalLM, directory)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama4")
    hf = _save(directory)
    prompts = random_prompts(LENGTHS)
    # A request sharing the 61-token prompt's first 52 tokens (a prefix-cache hit).
    prompts.append(prompts[2][:52] + random_prompts([9], seed=3)[0])
    return hf, directory, prompts, [hf_greedy(hf, p, NEW) for p in prompts]


def test_config_parsed_from_hf(tiny):
    _, directory, _, _ = tiny
    eng = load_engine(directory)
    model = eng.model
    assert model.config.family == "llama4"
    chunked = [LayerKind.CHUNKED] * 3
    assert [layer.kind for layer in model.kv_layers] == [*chunked, LayerKind.FULL]
    assert [layer.chunk for layer in model.kv_layers] == [CHUNK] * 3 + [0]
    assert all(layer.scale == 16**-0.5 for layer in model.kv_layers)
    assert model.config.no_rope_layers == [1, 1, 1, 0]
    assert [isinstance(m.feed_forward, Llama4MoE) for m in model.model.layers] == \
        [False, True, False, True]
    specs = {s.kind: s for s in eng.kv.layout.specs}
    assert specs[LayerKind.CHUNKED].num_layers == 3 and specs[LayerKind.CHUNKED].chunk == CHUNK
    assert specs[LayerKind.FULL].num_layers == 1


@torch.inference_mode()
def test_logits_match_hf_and_temperature_matters(tiny):
    hf, directory, prompts, want = tiny
    model = load_engine(directory).model
    ids = prompts[2]
    ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(sequence_logits(model, ids), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sequence_logits(model, ids, step=7), ref, atol=1e-4, rtol=1e-4)
    # Without temperature tuning transformers' own tokens change: serving its tokens (the
    # tests below) takes applying it.
    for layer in hf.model.layers:
        layer.self_attn.attn_temperature_tuning = False
    try:
        assert [hf_greedy(hf, p, NEW) for p in prompts] != want
    finally:
        for layer in hf.model.layers:
            layer.self_attn.attn_temperature_tuning = True


@pytest.mark.parametrize("kw", [
    {},  # batched; compiled kernels for decode rows, SDPA over gathered pages for prefill
    {"max_num_batched_tokens": 9},  # chunked prefill, several chunks per prompt
    {"torch_attention": True},  # the GPU path: gathers and batched matmuls
    {"torch_attention": True, "max_num_batched_tokens": 9},
])
def test_greedy_matches_hf(tiny, kw):
    _, directory, prompts, want = tiny
    check_greedy(directory, prompts, want, **kw)


@pytest.mark.parametrize("torch_attention", [False, True])
def test_one_at_a_time_and_prefix_hit(tiny, torch_attention):
    _, directory, prompts, want = tiny
    eng = load_engine(directory)
    if torch_attention:
        eng.runner.attn.kernels = None
    check_alone_then_cached(eng, prompts[:4], want[:4])
    # Shares 52 tokens with prompt 2: a hit (its chunk's pages, the full layer's all).
    got, cached = engine_run(eng, [prompts[4]], NEW, ["shared"])
    assert got == [want[4]]
    assert cached[0] >= 40


def test_preemption_keeps_tokens(tiny):
    _, directory, prompts, want = tiny
    check_preemption(directory, prompts, want, room_tokens=50)


def test_chunked_memory_is_bounded(tiny):
    _, directory, prompts, _ = tiny
    check_bounded(directory, prompts, LayerKind.CHUNKED, CHUNK + PAGE, NEW)


@pytest.mark.parametrize("batched_tokens", [64, 9])
def test_vtensor_backend_unmaps_what_left_the_attention_chunk(tiny, monkeypatch,
                                                              batched_tokens):
    """kv_backend vtensor: HF's tokens, with prefill whole and in 9-token steps, while the
    chunked layers keep only the chunks of the current attention chunk (+ one ahead) and
    the full layer the whole history."""
    from kvserve.models import virtual_attention as va

    monkeypatch.setattr(va, "CHUNK_TARGET", 4096)  # 16-token vTensor chunks: 8 tokens are
    # an attention chunk, so they leave it every 8 tokens and a chunk every 16
    _, directory, prompts, want = tiny
    eng = load_engine(directory, kv_backend="vtensor", max_num_batched_tokens=batched_tokens)
    attn = eng.runner.attn
    tpc = attn.tokens_per_chunk
    assert tpc == 16 and attn.attention_chunks == [CHUNK] * 3 + [0]
    seen = []

    def check(e: LLMEngine) -> None:
        for req in e.scheduler.running:
            done = attn.computed.get(req.request_id)
            if done is None:
                continue
            vts = [p.active[req.request_id] for p in attn.pools]
            for vt in vts[:3]:  # chunked: nothing wholly before the query's attention chunk
                assert vt.head == done // CHUNK * CHUNK // tpc
                assert vt.num_mapped <= CHUNK // tpc + 2  # its chunks, a ragged start, ahead
            assert vts[3].head == 0 and vts[3].num_mapped >= -(-done // tpc)
            seen.append((done, vts[0].head))
    got, _ = engine_run(eng, prompts, NEW, each_step=check)
    assert got == want
    assert max(head for _, head in seen) >= 3  # the 61 + 12 tokens went past 3 chunks
    stats = attn.stats()  # released lazily: the cached vTensors keep what they had mapped
    assert stats["chunked_mapped_bytes"] == sum(p.stats().mapped_bytes for p in attn.pools[:3])
    assert stats["sliding_mapped_bytes"] == 0


def test_chunk_of_one_page(tmp_path):
    # Chunks as long as a page: every page boundary starts a chunk and frees the page
    # before it. (The memory core refuses chunks that are not a multiple of the page.)
    hf = _save(tmp_path, chunk=PAGE)
    prompts = random_prompts(LENGTHS[:3], seed=2)
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    assert engine_greedy(load_engine(tmp_path, max_num_batched_tokens=9), prompts, NEW) == want
    eng = load_engine(tmp_path)
    eng.runner.attn.kernels = None
    assert engine_greedy(eng, prompts, NEW) == want
    with pytest.raises(ValueError, match="multiple"):
        load_engine(tmp_path, tokens_per_page=3)
