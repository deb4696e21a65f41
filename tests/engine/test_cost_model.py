"""MemServe's cost model exec(x, y): fitting, its shape on a real profile, Eq. 1 and 2, the
roofline version and persistence. Behaviour only: no test depends on how fast this CPU is."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_gemma import ByteTokenizer, tiny_gemma

from kvserve.engine.cost_model import (
    ATTN_FULL,
    ATTN_SLIDING,
    LINEAR,
    OTHER,
    AttentionOp,
    CostModel,
    LinearOp,
    Sample,
    profile_engine,
)
from kvserve.engine.engine import EngineConfig, LLMEngine
from kvserve.sim.cost import Chunk
from kvserve.sim.cost import CostModel as StepCostModel
from kvserve.sim.gpus import get_gpu
from kvserve.sim.models import get_model

WINDOW = 256
GRID = [(x, y) for x in (64, 200, 512, 1000, 2048, 3000) for y in (0.0, 0.2, 0.5, 0.75, 0.95)]


def truth(linear=(2e-5, 1e-3), full=(3e-9, 2e-7, 1e-6, 5e-4), sliding=(2e-9, 1e-7, 2e-6, 1e-4),
          other=(5e-6, 2e-3)) -> CostModel:
    """A known exec(x, y): the polynomial the synthetic samples come from."""
    return CostModel([LinearOp(LINEAR, list(linear)), AttentionOp(ATTN_FULL, list(full)),
                      AttentionOp(ATTN_SLIDING, list(sliding), window=WINDOW),
                      LinearOp(OTHER, list(other))])


def synthetic(model: CostModel, noise: float = 0.0, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for x, y in GRID:
        ops = {op.name: op.predict(x, y) * (1 + rng.gauss(0, noise)) for op in model.ops}
        samples.append(Sample(x, y, sum(ops.values()), ops))
    return samples


def close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


# ------------------------------------------------------------------ fitting


positive = st.floats(0.1, 10.0)


@settings(max_examples=25, deadline=None)
@given(st.tuples(positive, positive), st.tuples(positive, positive, positive, positive),
       st.tuples(positive, positive, positive, positive))
def test_fit_recovers_exact_polynomials(lin, full, sliding) -> None:
    known = truth((lin[0] * 1e-5, lin[1] * 1e-3),
                  tuple(c * s for c, s in zip(full, (1e-9, 1e-7, 1e-6, 1e-4))),
                  tuple(c * s for c, s in zip(sliding, (1e-9, 1e-7, 1e-6, 1e-4))))
    fitted = CostModel.fit(synthetic(known), window=WINDOW)
    want = known.coefficients()
    for name, terms in fitted.coefficients().items():
        for term, value in terms.items():
            assert close(value, want[name][term], 1e-6), (name, term)


def test_fit_recovers_coefficients_under_noise() -> None:
    known = truth()
    fitted = CostModel.fit(synthetic(known, noise=0.02, seed=3), window=WINDOW)
    got, want = fitted.coefficients(), known.coefficients()
    # The terms that carry most of the time come back within 10%; all of exec within 3%.
    for name, term in [(LINEAR, "n"), (ATTN_FULL, "n*x"), (ATTN_SLIDING, "n*x"), (OTHER, "n")]:
        assert close(got[name][term], want[name][term], 0.10), (name, term)
    for x, y in GRID:
        assert close(fitted.exec(x, y), known.exec(x, y), 0.03)


def test_fit_keeps_coefficients_non_negative() -> None:
    # An operator whose time falls with n (noise, in a real profile): plain least squares
    # would give a negative slope; the best non-negative fit is a constant, the mean.
    samples = [Sample(x, 0.0, 1.0, {LINEAR: 0.5 - x * 1e-4}) for x in (10, 100, 1000)]
    op = CostModel.fit(samples).ops[0]
    assert op.coef[0] == 0.0 and close(op.coef[1], 0.5 - 370 * 1e-4, 1e-9)


def test_sliding_attention_stops_growing_with_the_cached_prefix() -> None:
    op = AttentionOp(ATTN_SLIDING, [1e-9, 1e-7, 1e-6, 1e-4], window=WINDOW)
    full = AttentionOp(ATTN_FULL, list(op.coef))
    # 100 new tokens behind a 1000- or a 5000-token cached prefix: the window hides the rest.
    assert op.predict(1100, 1000 / 1100) == pytest.approx(op.predict(5100, 5000 / 5100))
    assert full.predict(5100, 5000 / 5100) > full.predict(1100, 1000 / 1100)


# ------------------------------------------------------------------ a real profile


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    cfg = EngineConfig(kv_memory=8 << 20, tokens_per_page=4, max_num_batched_tokens=64)
    return LLMEngine(tiny_gemma(), ByteTokenizer(), cfg)


@pytest.fixture(scope="module")
def profile(engine: LLMEngine) -> list[Sample]:
    # One thread: on a busy 2-core machine every parallel op of this tiny model can wait a
    # time slice for a descheduled thread (0.1 s of profile became 10 s); the behaviour
    # tested is the same.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return profile_engine(engine, lengths=(16, 48, 96, 192), ratios=(0.0, 0.5, 0.875),
                              repeats=2)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_cost(engine: LLMEngine, profile: list[Sample]) -> CostModel:
    return CostModel.fit(profile, window=engine.config.sliding_window)


def test_profile_times_every_operator_and_hits_the_prefix(profile: list[Sample]) -> None:
    # 4 lengths x 3 ratios, plus the prefix run of each ratio > 0.
    assert len(profile) == 4 * 3 + 4 * 2
    for s in profile:
        assert set(s.ops) == {LINEAR, ATTN_FULL, ATTN_SLIDING, "lm_head", OTHER}
        assert all(t >= 0 for t in s.ops.values()) and s.seconds > 0
        assert sum(s.ops.values()) == pytest.approx(s.seconds)
    hits = {(s.x, round(s.y, 3)) for s in profile}
    # Cached prefixes are whole 4-token pages, short of the whole prompt: (16, 0.875) hits
    # 12 of 16, and the y recorded is the hit the engine reported.
    assert {(192, 0.5), (192, 0.875), (48, 0.5), (16, 0.75), (16, 0.0)} <= hits


def test_profiling_leaves_the_engine_as_it_was(engine: LLMEngine, profile) -> None:
    assert "execute" not in vars(engine.runner)
    assert "compute_logits" not in vars(engine.model)
    assert engine.scheduler.budget == 64
    for mod in engine.model.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks
    assert not engine.has_unfinished()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4000), st.integers(1, 4000), st.floats(0.0, 0.99), st.floats(0.0, 0.99))
def test_exec_is_monotone_on_a_real_profile(tiny_cost: CostModel, x1, x2, y1, y2) -> None:
    (xa, xb), (ya, yb) = sorted((x1, x2)), sorted((y1, y2))
    assert tiny_cost.exec(xa, ya) <= tiny_cost.exec(xb, ya)
    assert tiny_cost.exec(xa, yb) <= tiny_cost.exec(xa, ya)
    assert tiny_cost.exec(xa, ya) > 0


def test_exec_grows_with_the_prompt_on_a_real_profile(tiny_cost: CostModel) -> None:
    assert tiny_cost.exec(4000, 0.0) > tiny_cost.exec(16, 0.0)


# ------------------------------------------------------------------ Eq. 1 and Eq. 2


def test_worth_loading_follows_bandwidth() -> None:
    cost = truth()
    x, have, other = 2000, 0.1, 0.9
    nbytes = 0.8 * x * 18 * 2 * 256 * 2  # the extra tokens' K and V
    assert cost.worth_loading(x, have, other, nbytes, bandwidth=1e15)
    assert not cost.worth_loading(x, have, other, nbytes, bandwidth=1e3)
    # Nothing saved, something to move: recompute.
    assert not cost.worth_loading(x, 0.5, 0.5, nbytes, bandwidth=1e15)


@settings(max_examples=50, deadline=None)
@given(st.integers(16, 8000), st.floats(0.0, 0.9), st.floats(0.0, 0.09),
       st.floats(1e3, 1e12), st.floats(1.0, 100.0))
def test_worth_loading_is_eq_2(x, have, more, bandwidth, faster) -> None:
    cost, other, nbytes = truth(), have + more, 1e6
    saved = cost.exec(x, have) - cost.exec(x, other)
    assert cost.worth_loading(x, have, other, nbytes, bandwidth) == (nbytes / bandwidth <= saved)
    if cost.worth_loading(x, have, other, nbytes, bandwidth):  # a faster link loads too
        assert cost.worth_loading(x, have, other, nbytes, bandwidth * faster)


def test_queue_time_sums_the_pending_prefills() -> None:
    cost = truth()
    pending = [(100, 0.0), (2000, 0.5), (700, 0.9)]
    assert cost.queue_time(pending) == pytest.approx(sum(cost.exec(x, y) for x, y in pending))
    assert cost.queue_time([]) == 0.0


# ------------------------------------------------------------------ roofline


@pytest.mark.parametrize("model,gpu", [("gemma-3-12b", "h100"), ("llama-3.1-8b", "l4"),
                                       ("ministral-8b", "l4")])
def test_from_roofline_is_the_simulators_prefill_step(model: str, gpu: str) -> None:
    cost = CostModel.from_roofline(model, gpu)
    sim = StepCostModel(get_model(model), get_gpu(gpu))
    for x, cached in [(1, 0), (512, 0), (4096, 2048), (40_000, 39_000), (100, 99)]:
        want = sim.step([Chunk(cached, x - cached, sampled=True)]).seconds
        assert cost.exec(x, cached / x) == pytest.approx(want, rel=1e-12)
    assert cost.exec(4096, 0.0) > cost.exec(4096, 0.9) > 0


def test_from_roofline_passes_fp8_and_tp() -> None:
    base = CostModel.from_roofline("llama-3.1-70b", "h100")
    fast = CostModel.from_roofline("llama-3.1-70b", "h100", fp8_weights=True, tp=4)
    sim = StepCostModel(get_model("llama-3.1-70b"), get_gpu("h100"), fp8_weights=True, tp=4)
    assert fast.exec(8000, 0.25) == pytest.approx(sim.step([Chunk(2000, 6000, True)]).seconds)
    assert fast.exec(8000, 0.25) < base.exec(8000, 0.25)


# ------------------------------------------------------------------ persistence


def test_save_load_round_trip(tmp_path, tiny_cost: CostModel) -> None:
    models = [tiny_cost, truth(), CostModel.from_roofline("gemma-3-4b", "l4", tp=2)]
    for i, cost in enumerate(models):
        cost.info["cpu"] = "test"
        path = tmp_path / f"cost{i}.json"
        cost.save(path)
        back = CostModel.load(path)
        assert back.to_dict() == cost.to_dict()
        for x, y in GRID:
            assert back.exec(x, y) == cost.exec(x, y)
