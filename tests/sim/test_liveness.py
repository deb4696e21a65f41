"""Liveness of the scheduler and memory core together, over random traces.

The wait rules (a loop miss waits for room, a request waits for the prefix a
running one computes, held windows, chunk caps) reorder and delay requests;
none may stall the engine, drop a request that fits the pool alone, or leave a
page behind. Hypothesis draws small traces of shared documents, repeated
questions and conversations' turns, on a sliding-window model and a Mamba
hybrid, a chunked-local-attention model and a cross-attention vision model
(questions that show images), in pools from barely one request to
several, with and without a host tier; the simulator runs the
engine's own Scheduler and KVCacheManager on them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sim_helpers import chat_session, small_config

from kvserve.sim.simulator import Simulator
from kvserve.sim.traces import UNIQUE_BASE, Image, TraceRequest

sys.path.insert(0, str(Path(__file__).parents[1] / "memory"))
from invariants import check_invariants  # noqa: E402

STEPS = 50_000  # far more than any drawn trace takes: past it, a livelock
MODELS = {"gemma-3-12b": 16384, "jamba-1.5-mini": 16384, "llama-4-scout": 16384,
          "llama-3.2-11b-vision": 16384}

question = st.tuples(
    st.integers(0, 3),              # the document it asks about
    st.integers(1, 9000),           # how much of it it shares
    st.integers(1, 400),            # its own tokens
    st.integers(1, 120),            # answer tokens
    st.floats(0.0, 1.0),            # gap before it arrives (s)
    st.sampled_from([None, 0, 1, 2]),  # an image it shows (of three), on the vision model
)
conversation = st.lists(st.tuples(st.integers(1, 1500), st.integers(1, 120),
                                  st.floats(0.0, 5.0)), min_size=1, max_size=4)


def trace_of(questions, conversations, vision: bool = False) -> list[TraceRequest]:
    out, t = [], 0.0
    for i, (doc, share, own, answer, gap, image) in enumerate(questions):
        t += gap
        images = () if image is None or not vision else (Image(f"img{image}", 0,
                                                                 1601 * (image + 1)),)
        out.append(TraceRequest(f"q{i}", t, answer, share + own, prefix_id=f"d{doc}",
                                prefix_len=share, images=images))
    for c, turns in enumerate(conversations):
        out += chat_session(f"c{c}", 0.3 * c, turns, UNIQUE_BASE + 10 * c)
    return sorted(out, key=lambda r: r.arrival)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A 9K-token question alone in a 1.25 GiB pool that fitted only without the window its
# prefill kept at a marked branch point (KVCacheManager.go_lean).
@example(model="gemma-3-12b", policy="jenga", kv_mib=1282, budget=None, host_mib=0,
         questions=[(0, 603, 129, 47, 0.17, None), (3, 3267, 68, 58, 0.45, None),
                    (2, 8291, 35, 115, 0.0, None), (2, 8845, 118, 10, 0.3, None),
                    (3, 712, 98, 79, 0.0, None), (3, 7686, 261, 58, 0.93, None),
                    (1, 204, 297, 12, 0.0, None), (0, 688, 362, 15, 0.0, None),
                    (2, 125, 326, 53, 0.72, None), (3, 1651, 244, 89, 0.94, None),
                    (2, 2, 54, 100, 0.22, None), (1, 1839, 222, 21, 0.0, None)],
         conversations=[[(208, 120, 2.89)]])
# A conversation's third turn alone in 48 large pages: its hit's pages split them so that
# the sliding layers found none whole (Scheduler._admit_waiting drops the cache).
@example(model="gemma-3-12b", policy="jenga", kv_mib=244, budget=None, host_mib=0,
         questions=[(3, 2135, 167, 117, 0.88, None), (2, 202, 43, 21, 0.02, None)],
         conversations=[[(18, 44, 4.5), (52, 12, 4.0), (469, 42, 3.67)]])
@given(model=st.sampled_from(sorted(MODELS)), policy=st.sampled_from(["jenga", "uniform"]),
       kv_mib=st.integers(100, 1500), budget=st.sampled_from([None, 2048]),
       host_mib=st.sampled_from([0, 0, 400]),
       questions=st.lists(question, max_size=12),
       conversations=st.lists(conversation, max_size=3))
def test_every_request_that_fits_alone_finishes_and_no_page_is_left(
        model, policy, kv_mib, budget, questions, conversations, host_mib) -> None:
    trace = trace_of(questions, conversations, vision=model == "llama-3.2-11b-vision")
    images = {tr.id: tr.image_inputs() for tr in trace}
    cfg = small_config(model, policy, kv_mib=kv_mib, max_model_len=MODELS[model],
                       max_num_batched_tokens=budget, host_bytes=host_mib << 20)
    steps = iter(range(STEPS))

    def on_step(kv, sched, batch) -> None:
        check_invariants(kv)
        assert next(steps, None) is not None, "no end: " + str(
            [(r.request_id, r.num_computed, len(r.token_ids)) for r in sched.running])

    sim = Simulator(cfg, on_step=on_step)
    res = sim.run(trace)  # a stall raises: "the scheduler returned an empty batch"
    assert len(res.requests) == len(trace)
    kv = sim.kv
    for rec in res.requests:
        # Arrival's checks turn a request away (too long, or its prompt larger than the
        # pool alone); once admitted, only a sequence outgrowing the pool alone may be
        # stopped: the wait rules must let every other one finish.
        if rec.rejected is not None and "could not be scheduled" in rec.rejected:
            assert not kv.fits_alone(rec.prompt_len + rec.output_len, cfg.batched_tokens,
                                     images[rec.id]), rec
        assert (rec.rejected is None) == (rec.finish is not None)
    assert not kv.reqs and not sim.busy
    check_invariants(kv)
    st_ = kv.stats()
    assert sum(s.used for s in st_.specs) == 0, "a finished trace left pages in use"
