"""kvserve's Gemma 3 against Hugging Face transformers, both loaded from the real 270M GGUF.

The reference is HF's own Gemma3ForCausalLM dequantised from the same file in float32; the
check is greedy token identity (with the one legitimate exception of a near-tie, see
``assert_same_greedy``), plus tighter logit checks where cheap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hf_reference import (
    NEW_TOKENS,
    SHORT_TEXT,
    HfGreedy,
    KvModel,
    assert_same_greedy,
    gguf_parsed_once,
    ledger_text,
)

from kvserve.models import (
    ContiguousAttention,
    Gemma3Config,
    Gemma3ForCausalLM,
    greedy_generate,
    load_model_files,
    render_chat,
)
from kvserve.models import loader as loader_mod

# Observed max |logit difference| vs HF is ~3e-5 (logits reach ~20); 1e-3 leaves headroom
# for BLAS differences while staying far below anything a real bug produces.
LOGIT_ATOL = 1e-3


def test_comparison_accepts_only_near_ties() -> None:
    logits = torch.zeros(3, 10)
    logits[0, 4] = 5.0
    logits[1, 2], logits[1, 7] = 3.0, 3.0 - 1e-4  # near-tie: 2 vs 7
    logits[2, 1], logits[2, 8] = 3.0, 2.0  # clear winner
    ref = HfGreedy([4, 2, 1], list(logits))
    assert assert_same_greedy([4, 2, 1], ref) == 3
    with pytest.warns(UserWarning, match="near-tie"):
        assert assert_same_greedy([4, 7, 9], ref) == 1  # stops at the tie
    with pytest.raises(AssertionError, match="step 2"):
        assert_same_greedy([4, 2, 8], ref)
    with pytest.raises(AssertionError, match="step 0"):
        assert_same_greedy([5, 2, 1], ref)
    with pytest.raises(AssertionError, match="step 1"):  # diverging to a non-runner-up
        assert_same_greedy([4, 3, 1], ref)


# ---------------------------------------------------------------------------- model vs HF


def test_weights_match_hf_gguf_dequantisation(kv: KvModel, hf_model: torch.nn.Module) -> None:
    ref = hf_model.state_dict()
    assert set(kv.state_dict) == {k for k in ref if k != "lm_head.weight"}  # head is tied
    for name, tensor in kv.state_dict.items():
        assert torch.equal(tensor, ref[name]), name


def test_short_prompt_greedy_matches_hf(kv: KvModel, hf_greedy: Callable, short_prompt) -> None:
    ours = greedy_generate(kv.model, [short_prompt], NEW_TOKENS)[0]
    assert_same_greedy(ours, hf_greedy(short_prompt))


def test_long_prompt_crossing_window_matches_hf(
    kv: KvModel, hf_greedy: Callable, long_prompt
) -> None:
    ours = greedy_generate(kv.model, [long_prompt], NEW_TOKENS)[0]
    assert_same_greedy(ours, hf_greedy(long_prompt))


def test_varlen_batch_matches_hf_per_sequence(
    kv: KvModel, hf_greedy: Callable, short_prompt, long_prompt
) -> None:
    # One flattened batch holding a 700-token, a ~20-token and a chat-formatted sequence (with
    # <start_of_turn>/<end_of_turn> tokens): prefill together, then decode together.
    chat = kv.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    prompts = [long_prompt, short_prompt, chat]
    ours = greedy_generate(kv.model, prompts, NEW_TOKENS)
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert_same_greedy(tokens, hf_greedy(prompt))


@torch.inference_mode()
def test_prefill_logits_close_to_hf_and_window_matters(
    kv: KvModel, hf_model: torch.nn.Module, long_prompt
) -> None:
    tail = 4  # logits only for the last rows: [700, 262144] floats would be 730 MB
    ref = hf_model(torch.tensor([long_prompt]), logits_to_keep=tail).logits[0]
    ours = _prefill_logits(kv.model, kv.config, long_prompt, tail)
    torch.testing.assert_close(ours, ref, atol=LOGIT_ATOL, rtol=0)
    # The same forward with the window switched off must be visibly different, otherwise
    # this prompt would not be exercising sliding-window masking at all.
    unwindowed = dataclasses.replace(kv.config, sliding_window=10**9)
    no_window = _prefill_logits(kv.model, unwindowed, long_prompt, tail)
    assert (no_window - ref).abs().max() > 100 * LOGIT_ATOL


def _prefill_logits(
    model: Gemma3ForCausalLM, config: Gemma3Config, ids: list[int], tail: int
) -> torch.Tensor:
    attn = ContiguousAttention(config.kv_layers())
    positions = attn.begin_batch([0], [len(ids)])
    return model.compute_logits(model(torch.tensor(ids), positions, attn)[-tail:])


# ---------------------------------------------------------------------------- loader


def test_tokenizer_matches_transformers_gguf_conversion(kv: KvModel, gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    with gguf_parsed_once():  # the file as hf_model's load parsed it (when it ran first)
        ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    texts = [SHORT_TEXT, ledger_text(3), "naïve café — 東京 🚀\n\n  x<start_of_turn>user\n"]
    for text in texts:
        assert kv.tokenizer(text).input_ids == ref(text).input_ids
    assert kv.tokenizer.bos_token_id == kv.config.bos_token_id == 2


def test_config_from_gguf_metadata(kv: KvModel) -> None:
    cfg = kv.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (18, 640, 2048)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 1, 256)
    assert cfg.vocab_size == 262144 and cfg.tie_word_embeddings
    assert cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256
    assert (cfg.rope_theta, cfg.rope_local_base_freq) == (1e6, 1e4)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17]
    assert cfg.eos_token_ids == [1, 106]  # <eos>, <end_of_turn>


def test_second_load_comes_from_cache(
    kv: KvModel, gguf_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_run(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the GGUF was converted again instead of read from the cache")

    monkeypatch.setattr(loader_mod, "_convert_gguf_to_cache", must_not_run)
    monkeypatch.setattr(loader_mod, "read_gguf", must_not_run)
    start = time.perf_counter()
    config, state_dict, _ = load_model_files(gguf_path)
    elapsed = time.perf_counter() - start
    assert config == kv.config
    assert torch.equal(
        state_dict["model.layers.3.mlp.down_proj.weight"],
        kv.state_dict["model.layers.3.mlp.down_proj.weight"],
    )
    assert elapsed < 20, f"cached load took {elapsed:.1f}s"
    entry = loader_mod.default_cache_dir() / f"{_sha256(gguf_path)}-v{loader_mod.CACHE_FORMAT}"
    assert (entry / "model.safetensors").is_file()
    assert (entry / "tokenizer" / "tokenizer.json").is_file()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def test_chat_template(kv: KvModel) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Capital of Peru?"}]},
    ]
    expected = (
        "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nCapital of Peru?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert render_chat(messages) == expected
    rendered = kv.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert rendered == expected
    ids = kv.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ids == kv.tokenizer(expected, add_special_tokens=False).input_ids
    assert ids.count(kv.config.bos_token_id) == 1


# ---------------------------------------------------------------------------- HF directory


@torch.inference_mode()
def test_hf_directory_tiny_random_model(kv: KvModel, tmp_path: Path) -> None:
    """HF-directory loading + the non-default paths (linear RoPE scaling, untied head, final
    softcapping, GQA group 2, window 4) against HF on a tiny random Gemma 3, in milliseconds."""
    from transformers import Gemma3ForCausalLM as HfGemma3
    from transformers import Gemma3TextConfig

    torch.manual_seed(0)
    hf_config = Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * 2, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, tie_word_embeddings=False, max_position_embeddings=128,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    )  # fmt: skip
    hf = HfGemma3(hf_config).eval()
    for name, param in hf.named_parameters():  # norms init to 0; randomise so (1 + w) matters
        if "norm" in name:
            param.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    kv.tokenizer.save_pretrained(tmp_path)

    config, state_dict, _ = load_model_files(tmp_path)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    model = Gemma3ForCausalLM.from_state_dict(config, state_dict)
    seqs = {"a": torch.randint(0, 300, (11,)), "b": torch.randint(0, 300, (9,))}
    ref = {name: hf(ids[None]).logits[0] for name, ids in seqs.items()}
    # Continuous-batching schedule: "a" prefills in a chunk of 6 then decodes; "b" joins
    # mid-way with its own chunked prefill, so one step mixes a decode and a prefill chunk.
    schedule = [{"a": 6}, {"a": 1, "b": 4}, {"a": 1, "b": 3}, {"a": 1, "b": 1}, {"a": 2, "b": 1}]
    ours = _run_schedule(model, ContiguousAttention(config.kv_layers()), seqs, schedule)
    for name in seqs:
        torch.testing.assert_close(ours[name], ref[name], atol=1e-5, rtol=1e-5)


def _run_schedule(
    model: Gemma3ForCausalLM,
    attn: ContiguousAttention,
    seqs: dict[str, torch.Tensor],
    schedule: list[dict[str, int]],
) -> dict[str, torch.Tensor]:
    """Feed each sequence in the given chunk sizes; return logits for every position."""
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in seqs}
    for step in schedule:
        names = list(step)
        chunks = [seqs[n][attn.seq_len(n) : attn.seq_len(n) + step[n]] for n in names]
        positions = attn.begin_batch(names, [len(c) for c in chunks])
        out = model.compute_logits(model(torch.cat(chunks), positions, attn))
        for name, rows in zip(names, out.split([len(c) for c in chunks]), strict=True):
            logits[name].append(rows)
    return {name: torch.cat(parts) for name, parts in logits.items()}


def test_the_fast_tokenizer_load_matches_transformers_own(kv: KvModel, gguf_path: Path) -> None:
    """The tokenizer the loader builds from the cached tokenizer.json (the generic fast
    class, for speed) gives the same ids and text as AutoTokenizer on the same files."""
    from transformers import AutoTokenizer

    entry = loader_mod.default_cache_dir() / f"{_sha256(gguf_path)}-v{loader_mod.CACHE_FORMAT}"
    want = AutoTokenizer.from_pretrained(str(entry / "tokenizer"))
    got = kv.tokenizer
    texts = ["Hello there", "  spaces\n\nand\ttabs", "émoji 🤖 and 中文", "",
             "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<mask> <pad>x"]
    for text in texts:
        for special in (True, False):
            ids = want(text, add_special_tokens=special).input_ids
            assert got(text, add_special_tokens=special).input_ids == ids
            for skip in (True, False):
                assert got.decode(ids, skip_special_tokens=skip) == want.decode(
                    ids, skip_special_tokens=skip)
    assert got.all_special_ids == want.all_special_ids
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id) == (
        want.bos_token_id, want.eos_token_id, want.pad_token_id)
    assert len(got) == len(want) and got.vocab_size == want.vocab_size
    assert got.encode("Hello there") == want.encode("Hello there")
    # The chat template (the family's: the GGUF ships none) renders and tokenizes alike.
    want.chat_template = got.chat_template
    chats = [[{"role": "user", "content": "Name three colours."}],
             [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "é 🤖"}]]
    for chat in chats:
        for tokenize in (False, True):
            assert got.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize) \
                == want.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize)
        assert got.apply_chat_template(chat, return_dict=True).input_ids == \
            want.apply_chat_template(chat, return_dict=True)["input_ids"]


def test_the_fast_tokenizer_copies_and_pickles(kv: KvModel) -> None:
    """The server gives its tokenizer thread a deep copy; the cluster ships it over Ray."""
    import copy
    import pickle

    from kvserve.models.tokenizer import FastTokenizer

    assert isinstance(kv.tokenizer, FastTokenizer)  # transformers' class stays off this path
    for other in (copy.deepcopy(kv.tokenizer), pickle.loads(pickle.dumps(kv.tokenizer))):
        assert other.encode("émoji 🤖") == kv.tokenizer.encode("émoji 🤖")
        assert other.eos_token_id == kv.tokenizer.eos_token_id
        assert other.chat_template == kv.tokenizer.chat_template


def test_the_fast_tokenizer_is_shared_across_threads(kv: KvModel) -> None:
    """The server's tokenizer thread encodes while the engine thread decodes, with one
    FastTokenizer (it never changes its backend's settings)."""
    from concurrent.futures import ThreadPoolExecutor

    tok = kv.tokenizer
    texts = [ledger_text(k) for k in range(1, 9)]
    want = [tok.encode(t) for t in texts]
    with ThreadPoolExecutor(4) as pool:
        encoded = pool.map(tok.encode, texts * 4)
        decoded = pool.map(tok.decode, want * 4)
        assert list(encoded) == want * 4
        assert list(decoded) == [tok.decode(ids) for ids in want] * 4


def test_cached_tokenizer_keeps_compact_merges_with_the_same_ids(gguf_path: Path) -> None:
    """The cache writes Gemma 3's merges as "left right" strings (faster to parse at every
    start); a tokenizer over the same file with the merges as pairs gives the same ids."""
    import json

    from tokenizers import Tokenizer

    from kvserve.datasets.sharegpt import load_conversations

    entry = loader_mod.default_cache_dir() / f"{_sha256(gguf_path)}-v{loader_mod.CACHE_FORMAT}"
    data = json.loads((entry / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8"))
    merges = data["model"]["merges"]
    assert len(merges) > 500_000 and all(isinstance(m, str) for m in merges)
    compact = Tokenizer.from_str(json.dumps(data))
    data["model"]["merges"] = [m.split(" ") for m in merges]
    assert all(len(pair) == 2 for pair in data["model"]["merges"])
    pairs = Tokenizer.from_str(json.dumps(data))
    texts = [text for conv in load_conversations(limit=60) for _, text in conv.turns]
    texts += ["  spaces\n\nand\ttabs", "émoji 🤖 and 中文", "def f(x):\n    return x ** 2"]
    assert compact.encode_batch(texts) and [e.ids for e in compact.encode_batch(texts)] == \
        [e.ids for e in pairs.encode_batch(texts)]


def test_compact_merges_leaves_a_vocabulary_with_spaces_alone(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    from kvserve.models.tokenizer import compact_merges

    def saved(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Path:
        path = tmp_path / f"t{len(vocab)}.json"
        Tokenizer(BPE(vocab, merges)).save(str(path))
        return path

    spaced = saved({"a": 0, " ": 1, "a ": 2}, [("a", " ")])
    before = spaced.read_bytes()
    assert not compact_merges(spaced) and spaced.read_bytes() == before
    plain = saved({"a": 0, "b": 1, "ab": 2, "abb": 3}, [("a", "b"), ("ab", "b")])
    assert compact_merges(plain)
    assert Tokenizer.from_file(str(plain)).encode("abbab").ids == [3, 2]
    assert not compact_merges(plain)  # already compact
