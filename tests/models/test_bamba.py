"""Bamba (attention + Mamba-2 layers) against transformers, through the whole engine.

A tiny seeded random Bamba (4 layers, attention at 1 and 3, scan chunks of 16 tokens, so
a Mamba checkpoint every 32 tokens) is saved with `save_pretrained`, loaded through
kvserve's loader and served with 4-token pages. Greedy tokens must equal HF's generate
for prompts crossing checkpoint boundaries: one at a time, batched, with chunked prefill
not aligned to checkpoints, after a prefix hit that restores a checkpoint, and under
preemption. The live states and checkpoints are MAMBA pages of the pool; their memory
and their contents (the state at exactly the checkpoint's position) are checked too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hf_tiny import BASE, engine_greedy, hf_greedy, load_engine, random_prompts, save_tiny

from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.engine.request import SamplingParams
from kvserve.engine.scheduler import Scheduled
from kvserve.memory import LayerKind
from kvserve.models.attention_ref import greedy_generate
from kvserve.models.base import StateSeq
from kvserve.models.loader import _load_hf_dir, build_model
from kvserve.models.mamba2 import ssd_scan
from kvserve.models.paged_attention import SeqStep, state_plan

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

EVERY = 32  # checkpoint interval: 2 scan chunks of 16
NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
LENGTHS = [1, 5, 31, 32, 33, 70, 130]  # 31 + 16 crosses a checkpoint while decoding


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: threads only contend (2 threads on 2 busy cores ran 30x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(**BASE, num_hidden_layers=4, attn_layer_indices=[1, 3],
                         mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                         mamba_expand=2, mamba_chunk_size=16)
    directory = tmp_path_factory.mktemp("bamba")
    return directory, save_tiny(config, BambaForCausalLM, directory)


_refs: dict[tuple[int, ...], list[int]] = {}


def reference(hf: torch.nn.Module, prompt: list[int], n: int = NEW) -> list[int]:
    key = (*prompt, -n)
    if key not in _refs:
        _refs[key] = hf_greedy(hf, prompt, n)
    return _refs[key]


def mamba_spec(eng: LLMEngine) -> int:
    return next(i for i, s in enumerate(eng.kv.layout.specs) if s.kind is LayerKind.MAMBA)


def assert_nothing_held(eng: LLMEngine) -> None:
    """Every request gone: no page in use, everything cached is reclaimable."""
    st = eng.kv.stats()
    assert all(s.used == 0 and s.empty == 0 for s in st.specs), st.specs
    assert st.free + st.evictable == st.pool_bytes


# ------------------------------------------------------------------------------ units


def test_ssd_scan_is_the_recurrence() -> None:
    """The chunked scan (any start offset, a carried state) equals the plain recurrence."""
    g = torch.Generator().manual_seed(0)
    L, H, P, N = 23, 3, 4, 5
    x, B, C = (torch.randn(L, H, k, generator=g) for k in (P, N, N))
    dt = torch.rand(L, H, generator=g) * 0.5
    A = -torch.rand(H, generator=g) - 0.1
    S0 = torch.randn(H, P, N, generator=g)
    S, want = S0.clone(), []
    for t in range(L):
        S = S * torch.exp(dt[t] * A)[:, None, None] + \
            (dt[t][:, None, None] * x[t][:, :, None]) * B[t][:, None, :]
        want.append(torch.einsum("hpn,hn->hp", S, C[t]))
    for offset in (0, 5, 8):
        y, final = ssd_scan(x, dt, A, B, C, 8, S0, offset)
        torch.testing.assert_close(y, torch.stack(want), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(final, S, rtol=1e-4, atol=1e-5)


def test_state_plan_follows_the_memory_core() -> None:
    """pending (0, page): read from that checkpoint; (pos, page): write the state after
    exactly pos tokens there; the live page gets the state at the step's end."""
    seqs = [
        SeqStep(0, 40, {"m": [7]}, pending={"m": [(32, 9)]}),  # fresh, snapshot at 32
        SeqStep(64, 10, {"m": [3]}, pending={"m": [(0, 5)]}),  # prefix hit at 64: restore
        SeqStep(95, 1, {"m": [4]}, pending={"m": [(96, 6)]}),  # decode onto a checkpoint
        SeqStep(50, 1, {"m": [8]}),
    ]
    assert state_plan(seqs, "m") == [
        StateSeq(slice(0, 40), 0, None, ((32, (9,)), (40, (7,)))),
        StateSeq(slice(40, 50), 64, 5, ((10, (3,)),)),
        StateSeq(slice(50, 51), 95, 4, ((1, (6, 4)),)),
        StateSeq(slice(51, 52), 50, 8, ((1, (8,)),)),
    ]


def test_reference_backend_serves_state_layers(tiny) -> None:
    """The model alone over ContiguousAttention (states in plain tensors) equals HF."""
    directory, hf = tiny
    model = build_model(*_load_hf_dir(directory))
    prompts = random_prompts([3, 40], seed=7)
    assert greedy_generate(model, prompts, NEW) == [reference(hf, p) for p in prompts]


# ------------------------------------------------------------------------ the engine


def test_specs_and_pages(tiny) -> None:
    eng = load_engine(tiny[0])
    specs = {s.kind: s for s in eng.kv.layout.specs}
    mamba = specs[LayerKind.MAMBA]
    # Two Mamba layers: conv inputs [160, 3] and SSM state [8 heads, 16, 16], float32.
    assert (mamba.num_layers, mamba.checkpoint_every) == (2, EVERY)
    assert mamba.bytes_per_token == 4 * (160 * 3 + 8 * 16 * 16)
    assert specs[LayerKind.FULL].num_layers == 2
    conv, ssm = eng.runner.pool.state(mamba.name, 1)
    assert conv.shape[1:] == (160, 3) and ssm.shape[1:] == (8, 16, 16)
    assert conv.dtype == ssm.dtype == torch.float32


def test_one_at_a_time_matches_hf(tiny) -> None:
    directory, hf = tiny
    eng = load_engine(directory)
    for prompt in random_prompts(LENGTHS):
        assert engine_greedy(eng, [prompt], NEW) == [reference(hf, prompt)]
    assert_nothing_held(eng)


def test_batched_and_chunked_prefill_match_hf(tiny) -> None:
    """All at once; then with 7-token steps, which split prompts off checkpoints."""
    directory, hf = tiny
    prompts = random_prompts(LENGTHS, seed=2)
    want = [reference(hf, p) for p in prompts]
    for budget in (256, 7):
        eng = load_engine(directory, max_num_batched_tokens=budget)
        assert engine_greedy(eng, prompts, NEW) == want
        assert_nothing_held(eng)


def test_checkpoints_hold_the_state_at_their_position(tiny) -> None:
    """After a chunked prefill (5-token steps), the cached checkpoints at 32 and 64 hold
    HF's conv and SSM states after exactly 32 and 64 tokens."""
    directory, hf = tiny
    prompt = random_prompts([70], seed=4)[0]
    eng = load_engine(directory, max_num_batched_tokens=5)
    engine_greedy(eng, [prompt], 1)
    s = mamba_spec(eng)
    cached, keys = eng.kv.alloc.specs[s].cached, eng.kv.block_keys(prompt)
    name = eng.kv.layout.specs[s].name
    for pos in (EVERY, 2 * EVERY):
        page = cached[keys[pos // eng.kv.T - 1]]
        with torch.inference_mode():
            cache = hf(torch.tensor([prompt[:pos]]), use_cache=True).past_key_values
        for index, layer in enumerate((0, 2)):  # the Mamba layers
            conv, ssm = eng.runner.pool.state(name, index)
            hf_layer = cache.layers[layer]
            torch.testing.assert_close(conv[page], hf_layer.conv_states[0][0, :, 1:])
            torch.testing.assert_close(ssm[page], hf_layer.recurrent_states[0][0],
                                       rtol=1e-4, atol=1e-5)


def test_prefix_hit_restores_a_checkpoint(tiny) -> None:
    directory, hf = tiny
    first, tail = random_prompts([75, 20], seed=5)
    second = first[:70] + tail
    eng = load_engine(directory, max_num_batched_tokens=16)
    assert engine_greedy(eng, [first], NEW, ids=["a"]) == [reference(hf, first)]
    eng.add_request("b", {"prompt_token_ids": second}, GREEDY)
    attn, restored, outs = eng.runner.attn, [], []
    prepare = attn.prepare

    def spy(seqs):  # the reads of a checkpoint rather than of the live state
        positions = prepare(seqs)
        restored.extend(p.source for plan in attn.state_plans.values() for p in plan
                        if p.source is not None and p.source != p.writes[-1][1][-1])
        return positions
    attn.prepare = spy
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.finished]
    (out,) = outs
    # 68 tokens share full blocks, but Mamba states exist only at checkpoints: 64.
    assert out.num_cached_tokens == 2 * EVERY
    assert len(restored) == 1
    assert out.outputs[0].token_ids == reference(hf, second)
    assert_nothing_held(eng)


def test_a_next_turn_hits_the_previous_sequence_end(tiny) -> None:
    """Once a conversation has continued, a next turn sends the whole previous sequence
    back and hits every full block of it (the tail's state), not just the checkpoint
    grid below; its greedy tokens still equal HF's."""
    directory, hf = tiny
    first, message, again = random_prompts([40, 9, 7], seed=11)
    eng = load_engine(directory, max_num_batched_tokens=16)

    def turn(name: str, prompt: list[int]):
        eng.add_request(name, {"prompt_token_ids": prompt}, GREEDY)
        outs = []
        while eng.has_unfinished():
            outs += [o for o in eng.step() if o.finished]
        (out,) = outs
        assert out.outputs[0].token_ids == reference(hf, prompt)
        return out

    answer = turn("0", first).outputs[0].token_ids
    second = first + list(answer) + message  # 65 tokens
    out = turn("1", second)
    # Turn 0 ran before any conversation was seen: the grid only (its end is 55).
    assert out.num_cached_tokens == EVERY
    third = second + list(out.outputs[0].token_ids) + again
    # Turn 1 computed 65 + 15 tokens: its tail holds the state at 80; the grid, at 64.
    assert turn("2", third).num_cached_tokens == 80
    assert_nothing_held(eng)


def test_preemption_matches_hf(tiny) -> None:
    directory, hf = tiny
    prompts = random_prompts([40, 66, 75, 50, 60], seed=3)
    large = load_engine(directory).kv.layout.large_page_bytes
    # A large page is one Mamba state (padded by 1.3% to ten 4-token attention pages):
    # room for a few requests' live states and ~200 tokens of attention KV.
    eng = load_engine(directory, max_num_batched_tokens=32, kv_memory=16 * large)
    assert engine_greedy(eng, prompts, 40) == [reference(hf, p, 40) for p in prompts]
    assert eng.scheduler.num_preemptions > 0
    assert_nothing_held(eng)


def test_memory_is_one_live_state_per_request_plus_checkpoints(tiny) -> None:
    directory = tiny[0]
    eng = load_engine(directory, max_num_batched_tokens=24)
    s = mamba_spec(eng)
    page = eng.kv.layout.page_bytes[s]
    state = eng.kv.layout.specs[s].page_bytes(eng.kv.T)  # the page pads it: waste
    prompts = random_prompts([70, 45, 20], seed=6)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    while eng.has_unfinished():
        eng.step()
        stats = eng.kv.stats().specs[s]
        running = len(eng.scheduler.running)
        # Between steps every snapshot is taken: a running request holds its live state
        # (no tail: these requests continue no conversation).
        assert (stats.used, stats.ideal) == (running * page, running * state)
    # What stays is the checkpoints as cache: 32 and 64 of the first request (70 + 16
    # tokens), 32 of the second (45 + 16) and of the third (20 + 16, taken while decoding).
    assert len(eng.kv.alloc.specs[s].cached) == 4
    assert_nothing_held(eng)


def test_without_prefix_caching_checkpoints_go_once_taken(tiny) -> None:
    directory, hf = tiny
    eng = load_engine(directory, max_num_batched_tokens=24, enable_prefix_caching=False)
    s = mamba_spec(eng)
    page = eng.kv.layout.page_bytes[s]
    prompt = random_prompts([100], seed=8)[0]
    eng.add_request("0", {"prompt_token_ids": prompt}, GREEDY)
    out = []
    while eng.has_unfinished():
        out += [o for o in eng.step() if o.finished]
        assert eng.kv.stats().specs[s].used <= page * (1 + len(eng.scheduler.running))
    assert list(out[0].outputs[0].token_ids) == reference(hf, prompt)
    assert_nothing_held(eng)


def test_a_failed_step_puts_live_states_back(tiny) -> None:
    """DistAttention reruns a step whose creditor was lost: the states it updated in
    place go back to what they were."""
    eng = load_engine(tiny[0])
    eng.add_request("a", {"prompt_token_ids": random_prompts([20])[0]}, GREEDY)
    eng.step()  # the prompt: the request now decodes from its live state
    (req,) = eng.scheduler.running
    attn, s = eng.runner.attn, mamba_spec(eng)
    assert eng.kv.allocate_slots("a", 1)
    attn.prepare([eng.runner._seq_step(Scheduled(req, req.num_computed, 1))])
    live = eng.kv.block_tables("a")[eng.kv.layout.specs[s].name][0]
    pages = eng.runner.pool.pages(s)
    before = pages[live].clone()
    undo = attn.save_states()
    pages[live] = 7
    undo()
    assert torch.equal(pages[live], before)


def test_vtensor_backend_refuses_state_layers(tiny) -> None:
    with pytest.raises(ValueError, match="Mamba layers; use kv_backend 'paged'"):
        load_engine(tiny[0], kv_backend="vtensor")


def test_engine_config_needs_nothing_new(tiny) -> None:
    """The checkpoint interval comes from the model: no engine knob names it."""
    assert not any("checkpoint" in f for f in EngineConfig.__dataclass_fields__)
