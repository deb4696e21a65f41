"""Where a trace's prefix hits come from: the cache, or requests that overlapped.

    python benchmarks/hit_sources.py arxiv-qa:articles=64,rate=4,order=round_robin
    python benchmarks/hit_sources.py sharegpt-chat:sessions=200,rate=2 \
        --max-model-len 16384 --gpu-utilization 0.4

Runs uniform and jenga on one trace (`prefix_hits.simulate`) and sorts every
request by what the previous request with the same `prefix_id` (the same
article, the same conversation) was doing when it arrived:

- first: there was none;
- queued or prefilling: it had no first token yet, so a hit on its prefix
  comes from the two having waited together (the scheduler starts the second
  once the first has computed the prefix), not from the cache keeping it;
- decoding: its prompt was computed and still held by it;
- done: it had finished, so a hit is KV the cache kept after it left.

For each kind: requests, how many hit more than half their prompt, and the
hit tokens as a share of all prompt tokens (the kinds add up to the hit rate).

`--losses`: also, each time a shared prefix stops being servable (the cache can
no longer serve half of it in every layer type), what was happening to the
requests on it (one still running; within LOST_SOON steps of one finishing;
later) and what went (the full-attention pages with the window, or the window
alone), and how many admissions the loop rule took for loop members
(`ReusePoints.reuse_key`).
"""

from __future__ import annotations

import argparse
from collections import Counter

from prefix_hits import add_sim_arguments, simulate

from kvserve.memory.spec import LayerKind
from kvserve.sim.simulator import RequestRecord
from kvserve.sim.traces import TraceRequest, load_trace

KINDS = ("first", "queued or prefilling", "decoding", "done")


def kind(prev: RequestRecord | None, arrival: float) -> str:
    if prev is None:
        return "first"
    if prev.first_token is None or prev.first_token > arrival:
        return "queued or prefilling"
    if prev.finish is None or prev.finish > arrival:
        return "decoding"
    return "done"


def sources(trace: list[TraceRequest],
            records: dict[str, RequestRecord]) -> dict[str, list[float]]:
    """kind -> [requests, hits, hit tokens over all prompt tokens]."""
    out: dict[str, list[float]] = {k: [0, 0, 0.0] for k in KINDS}
    last: dict[str, str] = {}
    total = sum(t.prompt_len for t in trace)
    for t in sorted(trace, key=lambda t: records[t.id].arrival):  # as the run saw them
        prev, rec = records[last[t.prefix_id]] if t.prefix_id in last else None, records[t.id]
        row, hit = out[kind(prev, rec.arrival)], rec.cached_tokens
        row[0] += 1
        row[1] += hit > t.prompt_len // 2
        row[2] += hit / total
        last[t.prefix_id] = t.id
    return out


LOST_SOON = 2  # steps after a request on the prefix finished


class Losses:
    """`Simulator.on_step` hook: how shared prefixes stop being servable."""

    def __init__(self, trace: list[TraceRequest]) -> None:
        self.trace = {t.id: t for t in trace}
        self.prefixes: dict[str, tuple[list[int], list[int]]] = {}  # id -> tokens, hashes
        self.servable: dict[str, bool] = {}
        self.running: dict[str, str] = {}  # request -> prefix id
        self.finished: dict[str, int] = {}  # prefix id -> step a request on it left
        self.admitted: set[str] = set()
        self.loop = Counter()  # loop member or not, per first admission
        self.lost = Counter()
        self.step = 0

    def __call__(self, kv, sched, batch) -> None:
        self.step += 1
        now = {r.request_id: self.trace[r.request_id].prefix_id for r in sched.running}
        for rid, pid in self.running.items():
            if rid not in now:
                self.finished[pid] = self.step
        self.running = now
        for s in batch:
            t = self.trace[s.request.request_id]
            if t.id not in self.admitted and t.id in kv.reqs:
                self.admitted.add(t.id)
                self.loop[kv.reqs[t.id].loop] += 1
            if t.prefix_id and t.prefix_id not in self.prefixes:
                self.prefixes[t.prefix_id] = (list(s.request.prompt_token_ids[:t.prefix_len]), [])
        for pid, (tokens, hashes) in self.prefixes.items():
            ok = kv.cached_prefix(tokens, hashes) > len(tokens) // 2
            if self.servable.get(pid) and not ok:
                self.lost[self._when(pid), self._what(kv, hashes, len(tokens))] += 1
            self.servable[pid] = ok

    def _when(self, pid: str) -> str:
        if pid in self.running.values():
            return "a request on it running"
        done = self.finished.get(pid)
        if done is not None and self.step - done <= LOST_SOON:
            return f"within {LOST_SOON} steps of one finishing"
        return "later"

    @staticmethod
    def _what(kv, hashes: list[int], n: int) -> str:
        half = (n // 2) // kv.T
        for m in kv.managers:
            if m.spec.kind is LayerKind.FULL:
                cached = kv.alloc.specs[m.s].cached
                if not all(h in cached for h in hashes[:half]):
                    return "full attention and window"
        return "window only"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--losses", action="store_true", help="how shared prefixes left")
    add_sim_arguments(ap)
    args = ap.parse_args()
    trace = load_trace(args.trace)
    rows: dict[str, dict[str, list[float]]] = {}
    for policy in ("uniform", "jenga"):
        hook = Losses(trace) if args.losses else None
        _, res, hit = simulate(trace, policy, args, hook)
        rows[policy] = sources(trace, {r.id: r for r in res.requests})
        print(f"{policy}: hit {hit:.1%}")
        if hook is not None:
            print(f"  loop members at first admission: {hook.loop[True]} of "
                  f"{sum(hook.loop.values())}")
            for (when, what), n in hook.lost.most_common():
                print(f"  prefix lost {n}x: {when}; {what}")
    print(f"\n| previous request at arrival | {' | '.join(rows)} |")
    print(f"|---|{'---|' * len(rows)}")
    for k in KINDS:
        cells = [f"{int(r[k][0])} requests, {int(r[k][1])} hit, {r[k][2]:.1%}"
                 for r in rows.values()]
        print(f"| {k} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
