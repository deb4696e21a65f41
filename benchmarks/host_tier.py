"""Moving KV pages between the device pool and the host tier: aggregated vs per layer.

    python benchmarks/host_tier.py [--pages 1 16 256] [--repeats 20]

Gemma 3 270M's layout in float32 (3 full + 15 sliding layers, 1 KV head x 256,
16 tokens a page: 96 KiB full pages, 480 KiB sliding pages). A page of a spec
holds K and V of every layer of the spec (Jenga's page-layer partition), so
moving n pages is one gather and one scatter per spec (`copy_pages`,
MemServe's block aggregation, §5.2). The baseline moves what a per-layer
paged cache (vLLM's layout, MemServe's starting point) must: 2 x layers
blocks per page, one copy call each. Source pages are every other page (no
two consecutive: the worst case for `copy_pages`, which makes one memcpy of
each run). Reports microseconds per page and GB/s for each direction of
both, on this machine's CPU (device and host are both RAM here: what it
shows is the per-call overhead aggregation removes).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.cpu_features import summary
from kvserve.memory import KVSpec, LayerKind, make_layout
from kvserve.physical.host import HostPool, copy_pages
from kvserve.physical.pool import AttentionShape, KVPool

SHAPE = AttentionShape(1, 256, torch.float32)
SPECS = (KVSpec("full", LayerKind.FULL, 3, SHAPE.bytes_per_token()),
         KVSpec("sliding", LayerKind.SLIDING, 15, SHAPE.bytes_per_token(), window=512))


def per_layer_copy(src: KVPool, dst: KVPool, name: str, src_ids: list[int],
                   dst_ids: list[int]) -> None:
    """The unaggregated move: K and V of each layer of each page, one call each."""
    for j in range(len(src.views[name])):
        a, b = src.layer(name, j), dst.layer(name, j)
        for p, q in zip(src_ids, dst_ids):
            b[q, 0].copy_(a[p, 0])
            b[q, 1].copy_(a[p, 1])


def timed(fn, repeats: int) -> float:
    """The fastest of `repeats` runs: the one other jobs on the CPU disturbed least."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layout = make_layout(SPECS, 16)
    num_large = max(args.pages) * 2 // min(layout.pages_per_large) + 2
    shapes = {s.name: SHAPE for s in SPECS}
    device = KVPool(layout, num_large, shapes)
    device.buffer.random_(0, 255)
    host = HostPool(layout, num_large)
    host_as_pool = KVPool.__new__(KVPool)  # the host buffer seen per layer, for the baseline
    host_as_pool.__dict__.update(layout=layout, device=torch.device("cpu"), buffer=host.buffer,
                                 views={})
    for s, spec in enumerate(SPECS):
        host_as_pool.views[spec.name] = host_as_pool._spec_views(s, SHAPE, num_large)
    print(f"CPU: {summary()}; torch threads {torch.get_num_threads()}")
    print(f"{'spec':<8}{'pages':>6}{'page KiB':>9}{'way':>6}{'agg us/page':>13}"
          f"{'agg GB/s':>10}{'layer us/page':>15}{'layer GB/s':>12}{'speedup':>9}")
    for s, spec in enumerate(SPECS):
        pb = layout.page_bytes[s]
        for n in args.pages:
            ids = list(range(0, 2 * n, 2))  # every other page: a gather, not a slice
            dst = list(range(n))
            for way, a, b, pa, pb_ in (("out", device, host_as_pool, device.pages(s),
                                        host.pages(s)),
                                       ("in", host_as_pool, device, host.pages(s),
                                        device.pages(s))):
                agg = timed(lambda: copy_pages(pa, pb_, ids, dst), args.repeats)  # noqa: B023
                lay = timed(lambda: per_layer_copy(a, b, spec.name, ids, dst),  # noqa: B023
                            args.repeats)
                print(f"{spec.name:<8}{n:>6}{pb / 1024:>9.0f}{way:>6}{agg / n * 1e6:>13.1f}"
                      f"{n * pb / agg / 1e9:>10.2f}{lay / n * 1e6:>15.1f}"
                      f"{n * pb / lay / 1e9:>12.2f}{lay / agg:>9.1f}x")


if __name__ == "__main__":
    main()
