"""One simulator point: a policy's prefix hit rate and TTFT on one trace.

    python benchmarks/sim_point.py jenga arxiv-qa:articles=32,rate=4,order=shuffled
    python benchmarks/sim_point.py uniform sharegpt-chat:sessions=400,rate=2 \
        --max-model-len 16384 --gpu-utilization 0.4

The hit rate is prompt tokens served from the prefix cache at each request's
first admission over all prompt tokens: `prefix_hits.simulate`, whose rows add
the bounds and both policies; TTFT mean and p99 in seconds; when the last request
finished; how many requests waited at a step (most, mean over steps).
"""

from __future__ import annotations

import argparse

from prefix_hits import add_sim_arguments, simulate

from kvserve.sim.metrics import summary
from kvserve.sim.traces import load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policy")
    ap.add_argument("trace")
    add_sim_arguments(ap)
    args = ap.parse_args()
    _, res, hit = simulate(load_trace(args.trace), args.policy, args)
    s = summary(res)
    waiting = [step.waiting for step in res.steps]
    print(f"{args.policy} {args.trace} {args.model}: hit {hit:.1%}, "
          f"TTFT mean {s['mean_ttft_s']:.2f} s, p99 {s['p99_ttft_s']:.2f} s, "
          f"end {res.clock:.1f} s, queue max {max(waiting, default=0)} / "
          f"mean {sum(waiting) / max(1, len(waiting)):.1f}")


if __name__ == "__main__":
    main()
