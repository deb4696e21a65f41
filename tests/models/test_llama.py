"""Llama-style families (Llama, Mistral, Ministral, Qwen2, Qwen3) against transformers.

Tiny seeded random models of each, saved and loaded back as HF directories; windows of
16 tokens and 4-token pages so prompts of 20-70 tokens cross windows and pages.
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
    hf_greedy,
    load_engine,
    random_prompts,
    save_tiny,
)

from kvserve.memory.spec import LayerKind

NEW = 12
LENGTHS = [23, 5, 61, 40]


def _case(name: str):
    import transformers as tf

    if name == "llama":
        cfg = tf.LlamaConfig(**BASE, num_hidden_layers=3, head_dim=16, attention_bias=True,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                              "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
        return cfg, tf.LlamaForCausalLM
    if name == "mistral":  # a window on every layer
        return tf.MistralConfig(**BASE, num_hidden_layers=3, head_dim=16,
                                sliding_window=16), tf.MistralForCausalLM
    if name == "ministral":
        return tf.MinistralConfig(**BASE, num_hidden_layers=4, head_dim=16, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention"] * 2), \
            tf.MinistralForCausalLM
    if name == "qwen2":  # q/k/v biases; windows above max_window_layers
        return tf.Qwen2Config(**BASE, num_hidden_layers=4, use_sliding_window=True,
                              sliding_window=16, max_window_layers=2), tf.Qwen2ForCausalLM
    if name == "qwen3":  # per-head q/k norms
        return tf.Qwen3Config(**BASE, num_hidden_layers=4, head_dim=16, use_sliding_window=True,
                              sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"] * 2), \
            tf.Qwen3ForCausalLM
    raise KeyError(name)


FAMILIES = ["llama", "mistral", "ministral", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    cfg, cls = _case(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(cfg, cls, directory)
    prompts = random_prompts(LENGTHS)
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    return request.param, directory, prompts, want


def test_config_parsed_from_hf(tiny):
    name, directory, _, _ = tiny
    eng = load_engine(directory)
    kinds = [layer.kind for layer in eng.model.kv_layers]
    sliding = {"llama": 0, "mistral": 3, "ministral": 2, "qwen2": 2, "qwen3": 2}[name]
    assert kinds.count(LayerKind.SLIDING) == sliding
    assert all(layer.window == 16 for layer in eng.model.kv_layers
               if layer.kind is LayerKind.SLIDING)


@pytest.mark.parametrize("kw", [
    {},  # batched, compiled kernels
    {"max_num_batched_tokens": 9},  # chunked prefill, several chunks per prompt
    {"torch_attention": True},  # the GPU path: gathers and SDPA
])
def test_greedy_matches_hf(tiny, kw):
    _, directory, prompts, want = tiny
    check_greedy(directory, prompts, want, **kw)


def test_one_at_a_time_and_prefix_hit(tiny):
    _, directory, prompts, want = tiny
    check_alone_then_cached(load_engine(directory), prompts, want)


def test_preemption_keeps_tokens(tiny):
    _, directory, prompts, want = tiny
    # Room for the longest request and little more: the rest wait or are preempted and
    # resumed (windows bound the sliding layers, so a windows-only model needs less).
    windows_only = tiny[0] == "mistral"
    check_preemption(directory, prompts, want, room_tokens=40 if windows_only else 80)


def test_sliding_memory_is_bounded(tiny):
    name, directory, prompts, _ = tiny
    if name == "llama":
        pytest.skip("no sliding layers")
    check_bounded(directory, prompts, LayerKind.SLIDING, 16 + 4, NEW)


def test_qwen2_biases_are_loaded(tiny):
    name, directory, _, _ = tiny
    if name != "qwen2":
        pytest.skip("qwen2 only")
    eng = load_engine(directory)
    proj = eng.model.model.layers[0].self_attn.qkv_proj
    assert proj.bias is not None and bool(proj.bias.abs().sum() > 0)
    assert torch.is_tensor(proj.bias)
