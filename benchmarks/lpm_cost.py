"""What sorting the queue by cached prefix costs a scheduler step (Scheduler._order_waiting).

    python benchmarks/lpm_cost.py

Gemma 3 12B's layout on a simulated H100 (8 full and 40 sliding-window
layers), 64 cached documents of 2048 tokens, 16 or 128 waiting requests of
2050 tokens, half of them on a cached document; the mean of 20 sorts after
the first (which hashes the prompts).
"""

import time

from kvserve.engine.request import Request, SamplingParams
from kvserve.sim.gpus import get_gpu
from kvserve.sim.models import get_model
from kvserve.sim.simulator import SimConfig, Simulator

m = get_model("gemma-3-12b")
sim = Simulator(SimConfig(m, get_gpu("h100"), policy="jenga", fp8_weights=True, mem_every=1 << 30))
kv, sched = sim.kv, sim.sched
# cache 64 documents of 2048 tokens
for d in range(64):
    toks = [10**9 + d] + list(range(1, 2048))
    kv.begin_step(); kv.add_request(f"d{d}", toks); kv.lookup(f"d{d}")
    assert kv.allocate_slots(f"d{d}", len(toks)); kv.advance(f"d{d}", len(toks)); kv.finish(f"d{d}")
for n in (16, 128):
    sched.waiting.clear()
    for i in range(n):
        d = i % 128  # half hit a cached document, half miss
        toks = [10**9 + d] + list(range(1, 2048)) + [7, i]
        sched.add(Request(f"q{n}-{i}", None, toks, SamplingParams(), 0.0))
    sched._order_waiting()  # first call hashes
    t = time.perf_counter(); k = 20
    for _ in range(k):
        sched._order_waiting()
    print(f"{n} waiting, 2050-token prompts: {(time.perf_counter() - t) / k * 1e3:.2f} ms a step")
