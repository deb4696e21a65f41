"""Where jenga's pool goes over a run: what can still hit, and what cannot.

    python benchmarks/pool_composition.py arxiv-qa:articles=64,rate=1,order=round_robin
    python benchmarks/pool_composition.py sharegpt-chat:sessions=200,rate=2 \
        --max-model-len 16384 --gpu-utilization 0.4

Every `--every` steps it sorts the pool's bytes (GB, averaged over the samples):

- used: pages running requests use (their held windows count as cache);
- free: large pages no spec owns;
- dead: cached pages with the key DEAD, evicted before any other;
- hits: cached pages that a hit at some point of a finished request's
  sequence needs, in any spec;
- other: the rest of the cached pages, which serve no such hit.

On traces whose requests share a document (`prefix_len`: arxiv-qa), the cached
pages that are part of a document's *trunk* (its full-attention pages and, in a
windowed spec, the window a hit at its end needs) are also counted: the rest of
"hits" and "other" is questions, answers and windows kept for other points.
"""

from __future__ import annotations

import argparse
from collections import Counter

from prefix_hits import add_sim_arguments, simulate

from kvserve.memory import KVCacheManager
from kvserve.memory.allocator import DEAD
from kvserve.memory.layer_types import RequestKV
from kvserve.memory.prefix_cache import extend_block_hashes
from kvserve.sim.traces import TokenSynth, TraceRequest, load_trace


class Finished:
    """Every finished request's computed block hashes (the manager's own registry,
    `CutPrefixes`, keeps only the latest ones): wraps `KVCacheManager.finish`."""

    def __init__(self) -> None:
        self.seqs: list[list] = []
        inner = KVCacheManager.finish

        def finish(kv: KVCacheManager, req_id: object) -> None:
            r = kv.reqs.get(req_id)
            inner(kv, req_id)
            if r is not None and r.num_computed > r.num_hit:
                self.seqs.append(r.hashes[:r.num_computed // kv.T])

        KVCacheManager.finish = finish

    def hit_pages(self, kv: KVCacheManager) -> list[set]:
        """Per spec, the block keys that a hit at some point of a finished sequence
        needs (every point where all specs serve a hit, not only the longest: a
        question's sequence ends past its document, whose end is where the next
        question hits); sequences that hit nowhere any more are forgotten."""
        out: list[set] = [set() for _ in kv.alloc.specs]
        alive = []
        for hashes in self.seqs:
            r = RequestKV(None, (), (), hashes=hashes)
            p = len(hashes)
            while p and (v := kv._longest_common_hit(r, p)):
                for m in kv.managers:
                    out[m.s].update(m.hit_keys(r, v))
                p = v - 1
            if p < len(hashes):
                alive.append(hashes)
        self.seqs = alive
        return out


def trunks(kv: KVCacheManager, trace: list[TraceRequest]) -> list[set]:
    """Per spec, the block keys of every shared document's trunk (module doc). A
    TokenSynth numbers documents as it meets them: in arrival order, as the run did."""
    synth, out, seen = TokenSynth(), [set() for _ in kv.alloc.specs], set()
    for tr in sorted(trace, key=lambda t: t.arrival):
        if tr.prefix_len and tr.prefix_id not in seen:
            seen.add(tr.prefix_id)
            hashes: list = []
            extend_block_hashes(hashes, synth.prompt_ids(tr)[:tr.prefix_len], kv.T)
            for m in kv.managers:
                out[m.s].update(m.hit_keys(RequestKV(None, (), (), hashes=hashes), len(hashes)))
    return out


def sample(kv: KVCacheManager, finished: Finished, trunk: list[set], acc: Counter) -> None:
    needed = finished.hit_pages(kv)
    for s, sp in enumerate(kv.alloc.specs):
        size = kv.layout.page_bytes[s]
        for h, p in sp.cached.items():
            if not sp.ref[p]:
                kind = "dead" if sp.last[p] == DEAD else "hits" if h in needed[s] else "other"
                acc[kind] += size
                acc["trunks"] += size if kind != "dead" and h in trunk[s] else 0
    st = kv.stats()
    acc["used"] += st.used
    acc["free"] += st.free
    acc["samples"] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--every", type=int, default=200, help="steps between samples")
    add_sim_arguments(ap)
    args = ap.parse_args()
    acc: Counter = Counter()
    finished = Finished()
    steps = [0]

    trace, trunk = load_trace(args.trace), []

    def on_step(kv: KVCacheManager, sched: object, batch: object) -> None:
        steps[0] += 1
        if not trunk:
            trunk.extend(trunks(kv, trace))
        if steps[0] % args.every == 0:
            sample(kv, finished, trunk, acc)

    sim, _, hit = simulate(trace, "jenga", args, on_step)
    n = max(1, acc.pop("samples"))
    kinds = ("used", "free", "dead", "hits", "other")
    parts = " ".join(f"{k} {acc[k] / n / 1e9:.2f}" for k in kinds)
    docs = f"; of hits and other, documents' trunks {acc['trunks'] / n / 1e9:.2f}"
    print(f"hit {hit:.1%}, pool {sim.kv.pool_bytes / 1e9:.1f} GB: {parts}"
          f"{docs if acc['trunks'] else ''}")


if __name__ == "__main__":
    main()
