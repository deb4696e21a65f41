"""The gManager's placement map, creditor choice, Algorithm 1 and the perf model."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cluster.placement import (
    GManager,
    InstanceLoad,
    Move,
    PerfModel,
    RequestPlacementEntry,
)
from kvserve.sim.gpus import get_gpu
from kvserve.sim.models import get_model

INSTS = [f"i{k}" for k in range(5)]
REQS = [f"r{k}" for k in range(8)]
HOME = {r: INSTS[k % len(INSTS)] for k, r in enumerate(REQS)}  # each request's debtor
PERF = PerfModel(n_layers=32, fixed_s=1.4e-4, per_seq_s=1e-6, per_block_s=2e-8,
                 compute_per_seq_s=4.4e-7)

# one report: (instance, request, blocks); local when the instance is the request's home
reports = st.lists(st.tuples(st.sampled_from(INSTS), st.sampled_from(REQS),
                             st.integers(0, 1500)), max_size=60)
# batch, free blocks, waiting, blocks per waiting request: any, or a memory-pressed
# instance with a queue (a debtor candidate, so that plan() has work to do)
load_spec = st.one_of(
    st.tuples(st.integers(0, 100), st.integers(0, 2000),
              st.one_of(st.just(0), st.integers(1, 20)), st.integers(1, 100)),
    st.tuples(st.integers(0, 8), st.integers(0, 200), st.integers(1, 20), st.integers(1, 20)))
loads = st.fixed_dictionaries({i: load_spec for i in INSTS})


def _load(inst: str, spec: tuple[int, int, int, int], total: int = 2000) -> InstanceLoad:
    batch, free, waiting, per = spec
    return InstanceLoad(inst, batch, free, total, waiting, waiting * per)


def _replay(rs: list[tuple[str, str, int]], specs=None) -> GManager:
    """Heartbeats one report at a time, in the drawn order (any interleaving)."""
    g = GManager(PERF, beta_thres=64, util_thres=0.7)
    for inst, req, n in rs:
        spec = specs[inst] if specs else (1, 1000, 0, 1)
        g.heartbeat(_load(inst, spec), [RequestPlacementEntry(req, inst, n, HOME[req] == inst)])
    return g


def _brute(rs: list[tuple[str, str, int]]) -> dict[str, dict[str, int]]:
    last: dict[tuple[str, str], int] = {}
    for inst, req, n in rs:
        last[(req, inst)] = n
    out: dict[str, dict[str, int]] = {}
    for (req, inst), n in last.items():
        if n > 0:
            out.setdefault(req, {})[inst] = n
    return out


@given(reports)
def test_placement_map_is_the_replay_of_the_entries(rs):
    g = _replay(rs)
    want = _brute(rs)
    for req in REQS:
        assert g.placement(req) == want.get(req, {})
        home_has = want.get(req, {}).get(HOME[req], 0) > 0
        assert g.debtor(req) == (HOME[req] if home_has else None)


def test_batched_heartbeat_equals_one_at_a_time():
    entries = [RequestPlacementEntry("a", "x", 4, True), RequestPlacementEntry("b", "x", 2, False),
               RequestPlacementEntry("a", "x", 0, True)]
    g = GManager(PERF, 8, 0.5)
    g.heartbeat(InstanceLoad("x", 1, 10, 20), entries)
    assert g.placement("a") == {} and g.debtor("a") is None
    assert g.placement("b") == {"x": 2}


@given(reports, loads, st.sampled_from(INSTS), st.integers(1, 500))
def test_creditors_never_a_debtor_nor_itself_and_most_free_first(rs, specs, debtor, n):
    g = _replay(rs, specs)
    got = g.creditors(debtor, n)
    debtors = g.debtors()
    assert debtor not in got and not debtors & set(got)
    free = [g.load(i).free_blocks for i in got]
    assert free == sorted(free, reverse=True) and all(f > 0 for f in free)
    # every other instance that could lend is offered
    known = {i for i, _, _ in rs}
    assert set(got) == {i for i in known - debtors - {debtor} if g.load(i).free_blocks > 0}


@settings(max_examples=300)  # ~10% of draws give plan() moves to check
@given(reports, loads)
def test_plan_respects_free_blocks_and_roles(rs, specs):
    g = _replay(rs, specs)
    moves = g.plan()
    srcs, dsts = {m.src for m in moves}, {m.dst for m in moves}
    assert not srcs & dsts  # never debtor and creditor at once
    assert not dsts & g.debtors() and not srcs & g.creditor_set()
    into: dict[str, int] = {}
    taken: dict[tuple[str, str], int] = {}
    for m in moves:
        assert m.src != m.dst and m.num_blocks > 0
        assert g.debtor(m.req_id) == m.src  # a debtor moves its own requests
        into[m.dst] = into.get(m.dst, 0) + m.num_blocks
        taken[(m.req_id, m.src)] = taken.get((m.req_id, m.src), 0) + m.num_blocks
    for dst, n in into.items():
        assert n <= g.load(dst).free_blocks
    for (req, src), n in taken.items():
        assert n < g.placement(req)[src]  # the block being appended stays home


def test_plan_moves_a_long_request_off_a_full_debtor_with_a_queue():
    """Fig. 5(c): a long request fills A, B is nearly empty; lending lets A run its queue."""
    g = GManager(PERF, beta_thres=8, util_thres=0.6)
    g.heartbeat(InstanceLoad("A", 1, 0, 10_000, waiting=20, waiting_blocks=2_000),
                [RequestPlacementEntry("long", "A", 10_000, True)])
    g.heartbeat(InstanceLoad("B", 40, 9_000, 10_000),
                [RequestPlacementEntry("s", "B", 1_000, True)])
    moves = g.plan()
    assert len(moves) == 1 and moves[0].src == "A" and moves[0].dst == "B"
    # lends at most up to B's 60% utilization, and enough for the whole queue
    assert 2_000 <= moves[0].num_blocks <= 6_000 - 1_000
    # with nobody waiting on A there is nothing to gain: no move
    g.heartbeat(InstanceLoad("A", 1, 0, 10_000), [])
    assert g.plan() == []


def test_plan_never_picks_an_instance_that_lends_as_debtor():
    g = GManager(PERF, beta_thres=8, util_thres=0.9)
    g.heartbeat(InstanceLoad("A", 1, 0, 100, waiting=5, waiting_blocks=50),
                [RequestPlacementEntry("x", "A", 60, True)])
    g.heartbeat(InstanceLoad("B", 1, 10, 100, waiting=5, waiting_blocks=50),
                [RequestPlacementEntry("x", "B", 40, False)])  # B lends to A
    g.heartbeat(InstanceLoad("C", 30, 90, 100), [])
    assert all(m.src == "A" and m.dst == "C" for m in g.plan())
    assert g.plan() and g.creditors("A", 10) == ["C", "B"]


@given(st.floats(1e-5, 1e-3), st.floats(1e-7, 1e-5), st.floats(1e-9, 1e-7),
       st.sampled_from([16, 32, 48]))
def test_fit_recovers_known_coefficients(c0, c1, c2, n_layers):
    samples = [(b, k, n_layers * (c0 + c1 * b + c2 * k))
               for b in (1, 8, 64, 256) for k in (0, 1_000, 50_000)]
    p = PerfModel.fit(samples, n_layers)
    for want, got in ((c0, p.fixed_s), (c1, p.per_seq_s), (c2, p.per_block_s)):
        assert math.isclose(got, want, rel_tol=1e-6)
    assert math.isclose(p.tps(10, 100), 10 / (n_layers * (c0 + 10 * c1 + 100 * c2)),
                        rel_tol=1e-6)


def test_roofline_model_matches_the_hand_count():
    """Llama 3.1 8B on an H100: 16 GB of weights at 3.35 TB/s is ~4.8 ms per step; one
    block (16 tokens x 32 layers x 4 KiB) of attention is 2 MiB read, ~0.6 us."""
    p = PerfModel.from_roofline(get_model("llama-3.1-8b"), get_gpu("h100"))
    assert 4.0e-3 < p.step_time(1, 0) < 5.0e-3
    assert math.isclose(p.step_time(1, 1) - p.step_time(1, 0), 16 * 32 * 4096 / 3.35e12,
                        rel_tol=1e-6)
    # Gemma 3 12B: only its 8 full-attention layers' blocks grow with the context
    g = PerfModel.from_roofline(get_model("gemma-3-12b"), get_gpu("h100"))
    assert math.isclose(g.step_time(1, 1) - g.step_time(1, 0), 16 * 8 * 8192 / 3.35e12,
                        rel_tol=1e-6)
    assert g.per_seq_s > 0  # the 40 sliding layers' windows, read per request


@given(reports, st.sampled_from(INSTS))
def test_drop_instance_returns_exactly_the_affected_requests(rs, dead):
    g = _replay(rs)
    want = _brute(rs)
    hit = g.drop_instance(dead)
    assert hit == sorted(r for r, where in want.items() if dead in where)
    for req in REQS:
        left = {i: n for i, n in want.get(req, {}).items() if i != dead}
        assert g.placement(req) == left
    assert g.load(dead) is None and dead not in g.creditors("i0", 1)


@given(reports, loads)
def test_retrieve_only_brings_blocks_home_from_full_creditors(rs, specs):
    g = _replay(rs, specs)
    room: dict[str, int] = {}
    for m in g.retrieve():
        assert m.dst == g.debtor(m.req_id) != m.src and m.num_blocks > 0
        assert m.num_blocks <= g.placement(m.req_id)[m.src]
        assert g.load(m.src).util > (1 + g.util_thres) / 2  # the creditor needs it
        ld = g.load(m.dst)
        room[m.dst] = room.get(m.dst, 0) + m.num_blocks
        assert ld.total_blocks - ld.free_blocks + room[m.dst] <= g.util_thres * ld.total_blocks


def test_retrieve_takes_lent_blocks_back_when_the_creditor_fills():
    g = GManager(PERF, beta_thres=8, util_thres=0.6)
    g.heartbeat(InstanceLoad("A", 1, 500, 1_000), [RequestPlacementEntry("x", "A", 500, True)])
    g.heartbeat(InstanceLoad("B", 20, 300, 1_000), [RequestPlacementEntry("x", "B", 200, False)])
    assert g.retrieve() == []  # B at 70%: inside the band, it keeps lending
    g.heartbeat(InstanceLoad("B", 40, 50, 1_000), [])
    assert g.retrieve() == [Move("x", "B", "A", 100)]  # A may fill up to 60%
