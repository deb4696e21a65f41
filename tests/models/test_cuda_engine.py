"""The engine on a CUDA GPU (skipped without one): tiny seeded random models of three
families, built from transformers' configs, decode HF's greedy tokens there, batched, after
a prefix hit, and through preemption. On CPU the same paths run as `torch_attention`
(tests/models/test_llama.py); here the pool, the block tables and the attention gathers
are CUDA tensors."""

from __future__ import annotations

import pytest
import torch
from hf_reference import NEAR_TIE
from hf_tiny import BASE, NoTokenizer, engine_run, hf_greedy, random_prompts, save_tiny

from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.models.loader import _load_hf_dir, build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW = 10


def _case(name: str):
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(**BASE, num_hidden_layers=3, head_dim=16), tf.LlamaForCausalLM
    if name == "ministral":  # sliding and full layers: two layer types in one pool
        return tf.MinistralConfig(**BASE, num_hidden_layers=4, head_dim=16, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention"] * 2), \
            tf.MinistralForCausalLM
    if name == "gemma2":  # soft-capping, windows, sandwich norms (test_gemma2.py's)
        # eager: the image's older transformers (5.17) defaults to SDPA, which skips the
        # scores' soft-capping, so its tokens would not be Gemma 2's.
        return tf.Gemma2Config(**BASE, num_hidden_layers=4, head_dim=16,
                               query_pre_attn_scalar=16, sliding_window=8,
                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                               attn_implementation="eager"), tf.Gemma2ForCausalLM
    raise KeyError(name)


def _same_or_near_tie(hf: torch.nn.Module, prompts: list[list[int]], got: list[list[int]],
                      want: list[list[int]]) -> None:
    """Each request's tokens are HF's, up to a first divergence where HF's own top two
    logits are within NEAR_TIE and ours is its runner-up: GPU float32 sums in another
    order than the CPU reference may decide a near-tie the other way (and the two
    continuations then legitimately differ)."""
    for prompt, mine, theirs in zip(prompts, got, want, strict=True):
        step = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if step is None:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + theirs[:step]])).logits[0, -1]
        top = torch.topk(logits, 2)
        gap = float(top.values[0] - top.values[1])
        assert gap < NEAR_TIE and mine[step] == int(top.indices[1]), (
            f"divergence at step {step}: ours {mine}, HF {theirs}, HF's gap {gap:.3g}")


def _engine(directory, room_tokens: int, **cfg) -> LLMEngine:  # noqa: ANN001
    """The HF directory on the GPU, its pool holding room_tokens tokens of every spec."""
    config, state_dict = _load_hf_dir(directory)
    model = build_model(config, state_dict, device="cuda")
    args = dict(tokens_per_page=4, max_num_batched_tokens=64, quantization="none",
                dtype="float32", device="cuda", kv_memory=2 << 20)
    per_token = sum(s.token_bytes() for s in LLMEngine(model, NoTokenizer(), EngineConfig(
        **args)).kv.layout.specs)
    return LLMEngine(model, NoTokenizer(), EngineConfig(
        **{**args, **cfg, "kv_memory": per_token * room_tokens}))


# Room for the longest request and little more (windows bound the sliding layers, so a
# model with more of them needs less): the others wait or are preempted and resumed.
ROOM = {"llama": 80, "ministral": 80, "gemma2": 50}


@pytest.mark.parametrize("family", list(ROOM))
def test_the_engine_on_cuda_decodes_hf_greedy_tokens(tmp_path, family: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as the CPU reference computes it
    cfg, cls = _case(family)
    hf = save_tiny(cfg, cls, tmp_path)
    prompts = random_prompts([23, 5, 61, 40])
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    engine = _engine(tmp_path, 1024)
    assert engine.model.device.type == "cuda"
    got, _ = engine_run(engine, prompts, NEW)
    _same_or_near_tie(hf, prompts, got, want)
    # Again: the prompts' pages are cached on the GPU now, and the tokens are the same.
    again, cached = engine_run(engine, prompts, NEW, ids=["a", "b", "c", "d"])
    assert again == got and sum(cached) > 0
    # A pool too small for all four at once: preemption and recompute on the GPU.
    small = _engine(tmp_path, ROOM[family], max_num_seqs=4, max_num_batched_tokens=16)
    preempted, _ = engine_run(small, prompts, NEW)
    assert preempted == got and small.scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", ["ministral", "gemma2"])
def test_prompts_longer_than_their_end_region_page_only_what_later_steps_read(tmp_path,
                                                                               family):
    """On the GPU every prefill chunk reads its own keys from k and v (window_only):
    prompts of 330-400 tokens in one step leave their sliding layers' keys before the
    prompt's end region unpaged, and the tokens are still HF's, alone and from the cache."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg, cls = _case(family)
    hf = save_tiny(cfg, cls, tmp_path)
    prompts = random_prompts([400, 330], seed=3)
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    engine = _engine(tmp_path, 2048, max_num_batched_tokens=1024)
    assert engine.runner.attn.window_only
    got = [engine_run(engine, [p], NEW, ids=[f"alone{i}"])[0][0] for i, p in enumerate(prompts)]
    _same_or_near_tie(hf, prompts, got, want)
    again, cached = engine_run(engine, prompts, NEW, ids=["a", "b"])
    assert again == got and min(cached) > 0
