"""What sorting the queue by cached prefix costs a scheduler step (Scheduler._order_waiting).

    python benchmarks/lpm_cost.py

Gemma 3 12B's layout on a simulated H100 (8 full and 40 sliding-window
layers), 64 cached documents of 2048 tokens, 16 or 128 waiting requests of
2050 tokens, half of them on a cached document; the mean of 20 sorts after
the first (which hashes the prompts).
"""

from __future__ import annotations

import time

from kvserve.engine.request import Request, SamplingParams
from kvserve.sim.gpus import get_gpu
from kvserve.sim.models import get_model
from kvserve.sim.simulator import SimConfig, Simulator

DOC = 2048


def doc(d: int) -> list[int]:
    return [10**9 + d] + list(range(1, DOC))


def main() -> None:
    model = get_model("gemma-3-12b")
    sim = Simulator(SimConfig(model, get_gpu("h100"), policy="jenga", fp8_weights=True,
                              mem_every=1 << 30))
    kv, sched = sim.kv, sim.sched
    for d in range(64):  # cache 64 documents
        rid, tokens = f"d{d}", doc(d)
        kv.begin_step()
        kv.add_request(rid, tokens)
        kv.lookup(rid)
        assert kv.allocate_slots(rid, len(tokens))
        kv.advance(rid, len(tokens))
        kv.finish(rid)
    for n in (16, 128):
        sched.waiting.clear()
        for i in range(n):  # documents 0..127: half cached
            sched.add(Request(f"q{n}-{i}", None, doc(i % 128) + [7, i], SamplingParams(), 0.0))
        sched._order_waiting()  # the first sort hashes the prompts
        t, k = time.perf_counter(), 20
        for _ in range(k):
            sched._order_waiting()
        ms = (time.perf_counter() - t) / k * 1e3
        print(f"{n} waiting, {DOC + 2}-token prompts: {ms:.2f} ms a step")


if __name__ == "__main__":
    main()
