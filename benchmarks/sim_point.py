"""One simulator point: a policy's prefix hit rate and TTFT on one trace.

    python benchmarks/sim_point.py jenga arxiv-qa:articles=32,rate=4,order=shuffled
    python benchmarks/sim_point.py uniform sharegpt-chat:sessions=400,rate=2 \
        --max-model-len 16384 --gpu-utilization 0.4

The hit rate is prompt tokens served from the prefix cache at each request's
first admission over all prompt tokens, as `prefix_hits.py` counts it (which
adds the bounds and both policies per row); TTFT mean and p99 in seconds.
"""

from __future__ import annotations

import argparse

from kvserve.sim.gpus import get_gpu
from kvserve.sim.metrics import summary
from kvserve.sim.models import get_model
from kvserve.sim.simulator import SimConfig, Simulator
from kvserve.sim.traces import load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policy")
    ap.add_argument("trace")
    ap.add_argument("--model", default="gemma-3-12b")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--gpu-utilization", type=float, default=0.9)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = ap.parse_args()
    model, trace = get_model(args.model), load_trace(args.trace)
    cfg = SimConfig(model, get_gpu(args.gpu), policy=args.policy,
                    fp8_weights=args.gpu in model.fp8_gpus, max_model_len=args.max_model_len,
                    gpu_utilization=args.gpu_utilization, mem_every=1 << 30,
                    max_num_batched_tokens=args.max_num_batched_tokens)
    res = Simulator(cfg).run(trace)
    hit = sum(r.cached_tokens for r in res.requests) / sum(r.prompt_len for r in trace)
    s = summary(res)
    print(f"{args.policy} {args.trace} {args.model}: hit {hit:.1%}, "
          f"TTFT mean {s['mean_ttft_s']:.2f} s, p99 {s['p99_ttft_s']:.2f} s")


if __name__ == "__main__":
    main()
