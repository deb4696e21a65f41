"""Prefix-hit granularity on Mamba hybrids: Mamba checkpoints every 512 tokens vs vLLM's
attention block inflated to the Mamba state (issue 14).

    python benchmarks/mamba_granularity.py main              # both policies, both models
    python benchmarks/mamba_granularity.py sweep --rates 1   # checkpoint interval G

One multi-turn ShareGPT trace (`sharegpt-chat`, every turn's prompt is the whole
conversation so far) replays through the real memory core and scheduler, on an
H100, per row:

- `kvserve 512`: jenga's layout, Mamba states checkpointed every 512 tokens, hits at
  multiples of 512 (attention pages of 16 tokens; Bamba's natural LCM is refused,
  so its state page is padded by 0.38% to a multiple of a 32-token attention page);
- `kvserve B`: the same layout, checkpoints every B tokens (vLLM's block, rounded
  up to kvserve's attention page): the granularity alone changes;
- `vLLM align B`: the `vllm_align` policy: attention block B = 16 x cdiv(one layer's
  state, 16 x one layer's KV per token), state pages padded to it, layers grouped as
  vLLM groups them, one state per step at a block end; hits at multiples of B;
- `kvserve B, B pages`: kvserve's core on vLLM's page geometry (B-token attention
  pages, the state page padded up to whole attention pages, checkpoints every B):
  what is left of the difference once the geometry is the same.

`sweep` replays the trace with kvserve's layout and checkpoints every G tokens, G
across vLLM's observed block sizes (400-4224). Bounds: the hit rate of an infinite
pool at the row's granularity (kvserve.sim.bounds.infinite_pool with blocks of G),
and Belady's offline eviction in the row's pool (bounds.belady).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from kvserve.memory import LayerKind
from kvserve.memory.baselines import vllm_block_size
from kvserve.sim.bounds import belady, hit_bytes, infinite_pool
from kvserve.sim.gpus import get_gpu
from kvserve.sim.metrics import summary
from kvserve.sim.models import Model, get_model
from kvserve.sim.simulator import SimConfig, Simulator
from kvserve.sim.traces import load_trace

MODELS = ("jamba-1.5-mini", "bamba-9b")
# Attention page (tokens) of kvserve's layout per model: the smallest at which
# jenga's LCM large page is accepted (Bamba's only with its state page padded).
KVSERVE_T = {"jamba-1.5-mini": 16, "bamba-9b": 32}
SWEEP = (64, 128, 256, 512, 1024, 2112, 4224)


@dataclass
class Row:
    label: str
    policy: str
    tokens_per_page: int
    checkpoint: int  # Mamba checkpoint interval (vllm_align: its block, set by the policy)
    pad_to_tokens: int = 0  # pad the state page to a multiple of this many tokens' KV


def attention_bytes_per_token(model: Model) -> int:
    return sum(s.num_layers * s.bytes_per_token for s in model.kv_specs()
               if s.kind is not LayerKind.MAMBA)


def needs_padding(model: Model, T: int) -> bool:
    from kvserve.memory import make_layout

    try:
        make_layout(model.kv_specs(), T)
    except ValueError:
        return True
    return False


def kvserve_row(model: Model, checkpoint: int, label: str) -> Row:
    T = KVSERVE_T[model.name]
    return Row(label, "jenga", T, checkpoint, T if needs_padding(model, T) else 0)


def run_row(model: Model, row: Row, trace, args: argparse.Namespace) -> dict:
    cfg = SimConfig(model, get_gpu(args.gpu), policy=row.policy,
                    tokens_per_page=row.tokens_per_page, max_model_len=args.max_model_len,
                    fp8_weights=args.gpu in model.fp8_gpus,  # the Jenga paper's Table 1
                    gpu_utilization=args.gpu_utilization, mem_every=0,
                    mamba_checkpoint=row.checkpoint,
                    state_page_multiple=row.pad_to_tokens * attention_bytes_per_token(model))
    t0 = time.perf_counter()
    sim = Simulator(cfg)
    res = sim.run(trace)
    seen = res.realized(trace)  # conversations' turns in the order this run gave them
    s = summary(res)
    m = next(i for i, sp in enumerate(sim.kv.layout.specs) if sp.kind is LayerKind.MAMBA)
    grain = sim.kv.layout.specs[m].checkpoint_every
    state = sum(sp.page_bytes(1) for sp in model.kv_specs() if sp.kind is LayerKind.MAMBA)
    return {
        "model": model.name, "row": row.label, "policy": row.policy, "block": grain,
        "attn_page_tokens": sim.kv.T, "pool_gb": sim.kv.pool_bytes / 1e9,
        "page_bytes": list(sim.kv.layout.page_bytes),
        "padding": sim.kv.layout.page_bytes[m] / state - 1,  # of the state page
        "hit": s["hit_rate"], "mean_ttft_ms": s["mean_ttft_s"] * 1e3,
        "p99_ttft_ms": s["p99_ttft_s"] * 1e3, "finished": s["finished"],
        "preemptions": s["preemptions"],
        "infinite": infinite_pool(seen, grain),
        "belady": belady(seen, sim.kv.pool_bytes, hit_bytes(sim.kv), grain),
        "wall_s": time.perf_counter() - t0,
    }


def rows_for(model: Model, args: argparse.Namespace) -> list[Row]:
    B = vllm_block_size(model.kv_specs())
    if args.mode == "sweep":
        return [kvserve_row(model, g, f"kvserve {g}") for g in args.grains]
    # Checkpoints must fall on attention pages: B rounded up to kvserve's page.
    T = KVSERVE_T[model.name]
    near = -(-B // T) * T
    return [kvserve_row(model, 512, "kvserve 512"), kvserve_row(model, near, f"kvserve {near}"),
            Row(f"vLLM align {B}", "vllm_align", 16, B),
            # kvserve's core on vLLM's page geometry: B-token attention pages, the state
            # page padded to whole attention pages, checkpoints every B (every block end).
            Row(f"kvserve {B}, B pages", "jenga", B, B, B)]


def print_row(r: dict, header: bool) -> None:
    if header:
        print(f"{'model':<16}{'rate':>5} {'row':<22}{'block':>6}{'pool GB':>8}{'st.pad':>7}"
              f"{'hit':>8}{'inf':>8}{'belady':>8}{'ttft ms':>9}{'p99 ms':>8}{'wall s':>7}")
    print(f"{r['model']:<16}{r['rate']:>5g} {r['row']:<22}{r['block']:>6}{r['pool_gb']:>8.1f}"
          f"{r['padding']:>7.1%}{r['hit']:>8.1%}{r['infinite']:>8.1%}{r['belady']:>8.1%}"
          f"{r['mean_ttft_ms']:>9.1f}{r['p99_ttft_ms']:>8.1f}{r['wall_s']:>7.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["main", "sweep"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0],
                    help="sessions per second")
    ap.add_argument("--sessions", type=int, default=400)
    ap.add_argument("--think", type=float, default=20.0)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--gpu-utilization", type=float, default=0.9)
    ap.add_argument("--grains", type=int, nargs="+", default=list(SWEEP))
    ap.add_argument("--json", help="append one JSON object per row to this file")
    args = ap.parse_args()
    header = True
    for rate in args.rates:
        trace = load_trace(f"sharegpt-chat:sessions={args.sessions},rate={rate},"
                           f"think={args.think}")
        for name in args.models:
            model = get_model(name)
            for row in rows_for(model, args):
                r = {"rate": rate, **run_row(model, row, trace, args)}
                print_row(r, header)
                header = False
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
