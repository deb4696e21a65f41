"""The engine with kv_backend="vtensor" against the paged backend (itself checked against HF).

The real Gemma 3 270M (the session fixture) runs the same schedules on both
backends: greedy tokens must be equal, across the 512-token sliding window,
with chunked prefill, a prefix shared while its owner still runs, and a pool
small enough to force preemption; afterwards no chunk may be left referenced.
A tiny random Gemma 3 with 16-token chunks covers the edges in milliseconds:
a vTensor prefix match shorter than the memory core's hit is recomputed.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from hf_reference import NEW_TOKENS, assert_same_greedy, ledger_text
from tiny_gemma import VOCAB, ByteTokenizer, tiny_gemma

from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import SamplingParams
from kvserve.entrypoints.model_args import add_model_arguments, model_config
from kvserve.models import virtual_attention as va

GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
MiB = 1 << 20


@pytest.fixture(scope="module")
def prompts(kv):
    ids = kv.tokenizer(ledger_text(80)).input_ids
    assert len(ids) > 700
    return {"p20": ids[:20], "p700": ids[:700]}


def make_engine(model, tokenizer, backend: str, **kw) -> LLMEngine:
    args = dict(kv_memory=256 * MiB, kv_backend=backend)
    args.update(kw)
    return LLMEngine(model, tokenizer, EngineConfig(**args))


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return done


def generate(engine: LLMEngine, token_lists, params=GREEDY) -> list[list[int]]:
    for i, t in enumerate(token_lists):
        engine.add_request(f"r{i}", {"prompt_token_ids": t}, params)
    done = drain(engine)
    return [done[f"r{i}"] for i in range(len(token_lists))]


def both(kv, scenario, **kw):
    """Run `scenario(engine)` on each backend; the vTensor engine comes second."""
    results = {}
    for backend in ("paged", "vtensor"):
        engine = make_engine(kv.model, kv.tokenizer, backend, **kw)
        results[backend] = (scenario(engine), engine)
    return results["paged"][0], *results["vtensor"]


def assert_no_leak(engine: LLMEngine) -> None:
    attn = engine.runner.attn
    assert attn.stats()["active"] == 0  # released lazily: caches and trees still hold chunks
    attn.trim()
    stats = attn.stats()
    assert stats["referenced_bytes"] == 0 and stats["mapped_bytes"] == 0
    assert stats["physical_bytes"] == 0  # punched back to the OS
    assert engine.kv.stats().used == 0


# ------------------------------------------------------------- real model


def test_tokens_equal_paged_across_the_window(kv, prompts):
    ps = [prompts["p20"], prompts["p700"]]
    paged, vt, engine = both(kv, lambda e: [generate(e, [p])[0] for p in ps])
    assert vt == paged
    assert engine.runner.pool is None  # the KV data is not in a byte pool
    assert_no_leak(engine)


def test_sliding_layers_map_only_their_window(kv, prompts, hf_greedy):
    """A prompt past the 512-token window, then decode: HF's tokens, while each sliding
    layer keeps about window + a chunk mapped and each full layer the whole history.

    Chunked prefill (256-token steps) unmaps as the window moves, decode crosses
    a chunk boundary (716 tokens, 32-token chunks). The prefix trees still hold
    what the sliding layers unmapped, so only a trim gives that memory back.
    """
    prompt = prompts["p700"]
    engine = make_engine(kv.model, kv.tokenizer, "vtensor", max_num_batched_tokens=256)
    attn = engine.runner.attn
    window, tpc = kv.config.sliding_window, attn.tokens_per_chunk
    sliding = [p for p, w in zip(attn.pools, attn.windows) if w]
    full = [p for p, w in zip(attn.pools, attn.windows) if not w]
    assert sliding and full and {w for w in attn.windows if w} == {window}
    engine.add_request("r", {"prompt_token_ids": prompt}, GREEDY)
    seen, out = [], None
    while engine.has_unfinished():
        for o in engine.step():
            out = o.outputs[0].token_ids if o.finished else out
        if "r" in engine.requests:
            stats = attn.stats()
            assert stats["sliding_mapped_bytes"] == sum(p.stats().mapped_bytes for p in sliding)
            seen.append((engine.requests["r"].num_computed,
                         {(p.active["r"].head, p.active["r"].num_mapped) for p in sliding},
                         {p.active["r"].num_mapped for p in full}))
    assert_same_greedy(out, hf_greedy(prompt))
    assert len(seen) > 3 and seen[-1][0] > len(prompt)
    for computed, sliding_maps, full_mapped in seen:
        ((head, mapped),) = sliding_maps  # every sliding layer alike
        # The next query at `computed` sees keys from computed - 511 on: those stay
        # mapped, and no chunk wholly before them does.
        assert head == max(0, computed - window + 1) // tpc
        assert mapped <= window // tpc + 2  # the window, its ragged start, one ahead
        assert min(full_mapped) >= -(-computed // tpc)  # full layers: the whole history
    assert seen[-1][1] != seen[0][1] and min(seen[-1][2]) > max(seen[0][2])
    # Released and cached now. The sliding trees still hold the chunks unmapped from
    # the vTensor (a later prefix hit maps the whole history): trimming gives them back.
    held = sliding[0].tree.match(prompt, 0.0)
    assert len(held) == len(prompt) // tpc > next(iter(sliding[0].cached)).num_mapped
    assert not set(held) & attn.chunks.free
    assert_no_leak(engine)


@pytest.mark.slow
def test_batched_chunked_prefill_equal_paged(kv, prompts):
    ps = [prompts["p20"], prompts["p700"], prompts["p700"][:450]]
    paged, vt, engine = both(kv, lambda e: generate(e, ps), max_num_batched_tokens=384)
    assert vt == paged
    assert_no_leak(engine)


def test_shared_prefix_maps_shared_chunks(kv, prompts):
    """B arrives while A decodes: B's prefix hit maps A's chunks; tokens still equal.

    The hit (336 tokens, whole 16-token pages) ends inside a 32-token chunk, so
    the vTensor side matches 320 and recomputes the 16 tokens in between.
    """
    a = prompts["p700"][:400]
    b = a[:350] + prompts["p20"][1:]
    seen = {}

    def scenario(engine):
        engine.add_request("a", {"prompt_token_ids": a}, GREEDY)
        while engine.requests["a"].num_computed < len(a):
            engine.step()
        engine.add_request("b", {"prompt_token_ids": b}, GREEDY)
        engine.step()
        seen[engine.cfg.kv_backend] = engine.requests["b"].num_cached_tokens
        if engine.cfg.kv_backend == "vtensor":
            seen["stats"] = engine.runner.attn.stats()
        done = drain(engine)
        return [done["a"], done["b"]]

    paged, vt, engine = both(kv, scenario)
    assert vt == paged
    hit = seen["vtensor"]
    assert hit == seen["paged"] == 336  # the memory core's hit, whole pages
    attn = engine.runner.attn
    stats, tpc = seen["stats"], attn.tokens_per_chunk
    matched = hit // tpc
    assert stats["shared_chunks"] == kv.config.num_hidden_layers * matched  # A's, in every layer
    assert stats["mapped_bytes"] > stats["referenced_bytes"]  # a shared chunk, mapped twice
    assert attn.recomputed_tokens == hit - matched * tpc == 16
    assert_no_leak(engine)


def test_preemption_under_a_small_budget_equal_paged(kv, prompts):
    base = prompts["p700"]
    ps = [base[:300 + 40 * i] for i in range(5)]
    preempted = {}

    def scenario(engine):
        out = generate(engine, ps)
        preempted[engine.cfg.kv_backend] = engine.scheduler.num_preemptions
        return out

    # Under vtensor --kv-memory is the physical ceiling, every layer counts its whole
    # history and chunk rounding is kept aside (core_budget): 100 MiB admits 20 MiB.
    paged, vt, engine = both(kv, scenario, kv_memory=100 * MiB, max_num_batched_tokens=512)
    assert preempted["vtensor"] > 0
    assert vt == paged
    assert_no_leak(engine)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown kv_backend 'pages'; choose from paged, vtensor"):
        EngineConfig(kv_backend="pages")


def test_kv_backend_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert model_config(parser.parse_args([])).kv_backend == "paged"
    assert model_config(parser.parse_args(["--kv-backend", "vtensor"])).kv_backend == "vtensor"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-backend", "pages"])


# -------------------------------------------------------------- tiny model

@pytest.fixture(scope="module")
def tiny():
    return tiny_gemma()


@pytest.fixture
def small_chunks(monkeypatch):
    """4 KiB chunks: 16 tokens of the tiny model, so its short prompts share chunks."""
    monkeypatch.setattr(va, "CHUNK_TARGET", 4096)


def tiny_prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


TINY = dict(kv_memory=1 << 20, tokens_per_page=4, max_num_batched_tokens=64)


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 8},  # chunked prefill, several chunks per prompt
    {"kv_memory": 512 << 10, "max_num_batched_tokens": 32},  # preemption (vtensor: core_budget)
])
def test_tiny_equal_paged(tiny, small_chunks, kw):
    ps = tiny_prompts([5, 17, 3, 40, 9, 26])
    args = {**TINY, **kw}
    paged = generate(make_engine(tiny, ByteTokenizer(), "paged", **args), ps)
    engine = make_engine(tiny, ByteTokenizer(), "vtensor", **args)
    assert generate(engine, ps) == paged
    assert engine.scheduler.num_preemptions > 0 or "kv_memory" not in kw
    assert_no_leak(engine)


def test_tiny_short_match_is_recomputed(tiny, small_chunks):
    """The vTensor trees are trimmed, the memory core still hits: the gap is recomputed."""
    base = tiny_prompts([60])[0]
    follow = base[:50] + [7, 8, 9]
    engines = {b: make_engine(tiny, ByteTokenizer(), b, **TINY) for b in ("paged", "vtensor")}
    out = {}
    for backend, engine in engines.items():
        generate(engine, [base])
        if backend == "vtensor":
            engine.runner.attn.trim()  # drops the recorded prefix; the memory core keeps it
        engine.add_request("f", {"prompt_token_ids": follow}, GREEDY)
        out[backend] = drain(engine)["f"]
    attn = engines["vtensor"].runner.attn
    assert attn.recomputed_tokens == 48  # the memory core's 48-token hit, all recomputed
    assert out["vtensor"] == out["paged"]
    assert_no_leak(engines["vtensor"])


def count_maps(attn: va.VirtualAttention) -> dict[str, list[int]]:
    """Map calls made inside each decode-only `prepare` and inside each `commit`."""
    backend, seen = attn.chunks.backend, {"prepare": [], "commit": []}
    real_prepare, real_commit = attn.prepare, attn.commit

    def prepare(seqs):
        decode = all(s.num_new == 1 for s in seqs)
        before = backend.map_calls
        out = real_prepare(seqs)
        if decode:
            seen["prepare"].append(backend.map_calls - before)
        return out

    def commit():
        before = backend.map_calls
        real_commit()
        seen["commit"].append(backend.map_calls - before)

    attn.prepare, attn.commit = prepare, commit
    return seen


@pytest.mark.parametrize("ahead", [None, 0], ids=["extend-ahead", "no-ahead"])
def test_tiny_decode_maps_after_the_step_not_before(tiny, small_chunks, ahead):
    """Extend ahead (the default): each commit maps the next chunk's worth of tokens, so a
    decode step's prepare maps nothing; without it, prepare maps as boundaries are crossed."""
    ps = tiny_prompts([5, 21])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # 3 chunk boundaries
    paged = generate(make_engine(tiny, ByteTokenizer(), "paged", **TINY), ps, params)
    engine = make_engine(tiny, ByteTokenizer(), "vtensor", **TINY)
    attn = engine.runner.attn
    if ahead is not None:
        attn.ahead_tokens = ahead
    maps = count_maps(attn)
    assert generate(engine, ps, params) == paged
    assert len(maps["prepare"]) >= 39
    if ahead is None:
        assert attn.ahead_tokens == attn.tokens_per_chunk
        assert sum(maps["prepare"]) == 0 and sum(maps["commit"]) > 0
    else:
        assert sum(maps["prepare"]) > 0 and sum(maps["commit"]) == 0
    assert_no_leak(engine)
