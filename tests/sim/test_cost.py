"""The roofline cost model: monotone in batch and context, exact attention counts, budgets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.memory import LayerKind
from kvserve.sim.cost import Chunk, CostModel, attended_pairs, kv_budget, window_start
from kvserve.sim.gpus import get_gpu
from kvserve.sim.models import Group, get_model

MODELS = ["llama-3.1-8b", "ministral-8b", "gemma-3-12b", "llama-3.2-11b-vision",
          "jamba-1.5-mini", "llama-4-scout"]


def _cost(name: str, gpu: str = "h100") -> CostModel:
    return CostModel(get_model(name), get_gpu(gpu))


def _non_decreasing(xs: list[float]) -> bool:
    return all(a <= b for a, b in zip(xs, xs[1:]))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("gpu", ["h100", "l4"])
def test_monotone_in_decode_batch(name: str, gpu: str) -> None:
    cm = _cost(name, gpu)
    times = [cm.step([Chunk(4000, 1, True, image_tokens=64)] * b).seconds for b in range(1, 65)]
    assert _non_decreasing(times)
    assert times[-1] > times[0]


@pytest.mark.parametrize("name", MODELS)
def test_monotone_in_context(name: str) -> None:
    cm = _cost(name)
    chunked = any(g.kind is LayerKind.CHUNKED for g in cm.model.groups)
    # Chunked local attention restarts at every 8192-token boundary, so there
    # the cost grows with the position inside a chunk and from chunk to chunk.
    positions = range(0, 8192, 97) if chunked else range(0, 200_000, 997)
    times = [cm.step([Chunk(c, 1, True)] * 8).seconds for c in positions]
    assert _non_decreasing(times)
    assert times[-1] > times[0]
    if chunked:
        same_offset = [cm.step([Chunk(k * 8192 + 100, 1, True)] * 8).seconds for k in range(20)]
        assert _non_decreasing(same_offset) and same_offset[-1] > same_offset[0]


@pytest.mark.parametrize("name", MODELS)
def test_monotone_in_prefill_tokens(name: str) -> None:
    cm = _cost(name)
    times = [cm.step([Chunk(0, n, True)]).seconds for n in range(1, 70_000, 1499)]
    assert _non_decreasing(times)
    assert times[-1] > 10 * times[0]  # long prefills are compute bound


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    cm = _cost("llama-3.1-8b")
    assert cm.step([Chunk(1000, 1, True)]).memory_bound
    assert not cm.step([Chunk(0, 8192, True)]).memory_bound


def test_decode_reads_the_weights_once() -> None:
    m, gpu = get_model("llama-3.1-8b"), get_gpu("h100")
    one = CostModel(m, gpu).step([Chunk(0, 1, True)])
    # One token at position 0: the weights (bar the embedding table) plus one token of KV.
    expected = (m.params - m.vocab * m.hidden) * 2 + 32 * m.kv_bytes_per_token()
    assert one.bytes == pytest.approx(expected, rel=1e-6)
    assert one.seconds == pytest.approx(expected / gpu.hbm_bandwidth, rel=1e-6)


def _brute_pairs(g: Group, start: int, n: int) -> int:
    return sum(p + 1 - window_start(g, p) for p in range(start, start + n))


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from([LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED]),
       size=st.integers(1, 64), start=st.integers(0, 300), n=st.integers(1, 300))
def test_attended_pairs_closed_form(kind: LayerKind, size: int, start: int, n: int) -> None:
    g = Group("g", kind, 1, window=size if kind is LayerKind.SLIDING else 0,
              chunk=size if kind is LayerKind.CHUNKED else 0)
    assert attended_pairs(g, start, n) == _brute_pairs(g, start, n)


def test_budget_and_oom() -> None:
    h100 = get_gpu("h100")
    ok = kv_budget(get_model("ministral-8b"), h100, fp8_weights=False,
                   max_num_batched_tokens=131072, max_num_seqs=256)
    assert 30e9 < ok.kv < 60e9
    assert ok.usable == pytest.approx(81559 * 2**20 * 0.9)
    bf16 = kv_budget(get_model("llama-3.1-70b"), h100, fp8_weights=False,
                     max_num_batched_tokens=4096, max_num_seqs=256)
    assert bf16.kv < 0  # 141 GB of weights
    fp8 = kv_budget(get_model("llama-3.1-70b"), h100, fp8_weights=True,
                    max_num_batched_tokens=4096, max_num_seqs=256)
    assert fp8.kv > 0
    tp4 = kv_budget(get_model("llama-3.1-70b"), h100, fp8_weights=False,
                    max_num_batched_tokens=4096, max_num_seqs=256, tp=4)
    assert tp4.kv > 100e9
