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
"""

from __future__ import annotations

import argparse

from prefix_hits import add_sim_arguments, simulate

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    add_sim_arguments(ap)
    args = ap.parse_args()
    trace = load_trace(args.trace)
    rows: dict[str, dict[str, list[float]]] = {}
    for policy in ("uniform", "jenga"):
        _, res, hit = simulate(trace, policy, args)
        rows[policy] = sources(trace, {r.id: r for r in res.requests})
        print(f"{policy}: hit {hit:.1%}")
    print(f"\n| previous request at arrival | {' | '.join(rows)} |")
    print(f"|---|{'---|' * len(rows)}")
    for k in KINDS:
        cells = [f"{int(r[k][0])} requests, {int(r[k][1])} hit, {r[k][2]:.1%}"
                 for r in rows.values()]
        print(f"| {k} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
