"""MemServe's cost model exec(x, y) fitted on Gemma 3 270M, checked on held-out prefills.

    python benchmarks/cost_model.py
    python benchmarks/cost_model.py --threads 2 --save /tmp/cost.json --json

Profiles the real default model through the engine (kvserve.engine.cost_model.profile_engine:
per-operator times of prefills at the profile's (x, y)), fits one function per operator, then
prefills prompts of x tokens with a fraction y cached at (x, y) points the profile did not
run and compares the predicted step time with the measured one.

One thread by default: this machine's two cores are shared with other jobs, and with two
threads every parallel op waits a time slice whenever the other thread is descheduled
(a 256-token prefill measured 2.5 s with two threads, 0.74 s with one, at the same time).
With one thread the times are the engine thread's CPU time (`--clock cpu`): equal to wall
time on an idle core, and blind to the slices other processes take from it, which moved
single wall-clock runs by up to 1.5x here; `--clock wall` times the wall.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvserve.cpu_features import cpu_name, summary
from kvserve.engine.cost_model import CostModel, profile_engine
from kvserve.engine.engine import EngineConfig, LLMEngine

PROFILE_LENGTHS = (128, 448, 896, 1792)
# y = 0 points come with these: each cached prefix is first prefilled alone (0.25x, 0.75x).
PROFILE_RATIOS = (0.25, 0.75)
HELD_OUT_LENGTHS = (256, 512, 1024, 2048)
HELD_OUT_RATIOS = (0.0, 0.5, 0.9)


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


def held_out(engine: LLMEngine, cost: CostModel, lengths, ratios, repeats: int,
             clock) -> list[dict]:
    rows = []
    for x in lengths:
        for y in ratios:
            s = profile_engine(engine, [x], [y], repeats=repeats, warmup=False, clock=clock)[-1]
            pred = cost.exec(s.x, s.y)
            ops = {op.name: (op.predict(s.x, s.y), s.ops.get(op.name, 0.0)) for op in cost.ops}
            rows.append({"x": s.x, "y": s.y, "measured_s": s.seconds, "predicted_s": pred,
                         "rel_error": pred / s.seconds - 1, "ops": ops})
            print(f"{s.x:>6} {s.y:>6.3f} {s.seconds:>10.3f} {pred:>10.3f} "
                  f"{pred / s.seconds - 1:>+8.1%}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default=None,
                    help="cpu: the thread's CPU time (default with one thread), wall: wall time")
    ap.add_argument("--lengths", type=ints, default=PROFILE_LENGTHS, help="profile x values")
    ap.add_argument("--ratios", type=floats, default=PROFILE_RATIOS, help="profile y values")
    ap.add_argument("--repeats", type=int, default=1, help="runs per point, fastest kept")
    ap.add_argument("--held-out-lengths", type=ints, default=HELD_OUT_LENGTHS)
    ap.add_argument("--held-out-ratios", type=floats, default=HELD_OUT_RATIOS)
    ap.add_argument("--save", help="write the fitted cost model here (JSON)")
    ap.add_argument("--json", action="store_true", help="print every result as JSON at the end")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times one thread: use it with --threads 1")
    wall = args.clock == "wall" or args.threads != 1
    clock = time.perf_counter if wall else time.thread_time
    print(f"CPU: {cpu_name()}; {summary()}", flush=True)
    t0 = time.perf_counter()
    engine = LLMEngine.load(EngineConfig(kv_memory=1 << 30))
    print(f"loaded Gemma 3 270M in {time.perf_counter() - t0:.1f} s: {engine.model.dtype}, "
          f"quantization {engine.model.quantization}", flush=True)

    t0 = time.perf_counter()
    samples = profile_engine(engine, args.lengths, args.ratios, repeats=args.repeats,
                             clock=clock)
    profile_s = time.perf_counter() - t0
    info = {"cpu": cpu_name(), "threads": args.threads, "clock": "wall" if wall else "cpu",
            "dtype": str(engine.model.dtype),
            "quantization": engine.model.quantization, "profile_s": profile_s}
    cost = CostModel.fit(samples, window=engine.config.sliding_window, info=info)
    print(f"profile: {len(samples)} prefills in {profile_s:.1f} s (wall), timed by "
          f"{info['clock']} clock", flush=True)
    for name, terms in cost.coefficients().items():
        print(f"  {name:<18}" + "  ".join(f"{t} {v:.4g}" for t, v in terms.items()))
    worst = max(samples, key=lambda s: abs(cost.exec(s.x, s.y) / s.seconds - 1))
    print(f"fit residuals on the profile: max |rel| "
          f"{abs(cost.exec(worst.x, worst.y) / worst.seconds - 1):.1%} at "
          f"({worst.x}, {worst.y:.3f})", flush=True)
    if args.save:
        cost.save(args.save)

    print(f"{'x':>6} {'y':>6} {'measured':>10} {'predicted':>10} {'rel err':>8}", flush=True)
    t0 = time.perf_counter()
    rows = held_out(engine, cost, args.held_out_lengths, args.held_out_ratios, args.repeats,
                    clock)
    errs = [abs(r["rel_error"]) for r in rows]
    print(f"held out: {len(rows)} points in {time.perf_counter() - t0:.1f} s; mean |rel| "
          f"{sum(errs) / len(errs):.1%}, max {max(errs):.1%}", flush=True)
    if args.json:
        print(json.dumps({"info": info, "model": cost.to_dict(), "held_out": rows,
                          "profile": [vars(s) for s in samples]}, indent=1))


if __name__ == "__main__":
    main()
