"""Prometheus metrics on the server's own registry (never the process-global one).

Latency histograms are observed by the engine thread as requests progress.
Everything read from the engine (queue lengths, KV bytes per layer type,
cumulative token counters, vTensor memory) comes from one `EngineSnapshot` taken per scrape in
the engine thread: `kv.stats()` walks every page, so it runs once per scrape
and never concurrently with a step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.memory.manager import Stats

# vLLM's buckets, so dashboards built for it read these the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

@dataclass
class EngineSnapshot:
    """What /metrics reads from the engine, taken between two steps."""

    running: int
    waiting: int
    kv: Stats
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    vtensor: dict[str, int] | None = None  # VirtualAttention.stats(); None: paged backend
    kv_physical_bytes: int | None = None  # memory the paged pool holds; None: vtensor


UNASSIGNED = "unassigned"  # layer_type label of free large pages no layer type holds yet


class EngineCollector(Collector):
    """Turns the latest EngineSnapshot into metric families at scrape time."""

    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:
            return
        yield _gauge("kvserve_num_requests_running", "Requests in the running batch", s.running)
        yield _gauge("kvserve_num_requests_waiting", "Requests queued for admission", s.waiting)
        yield from _kv_families(s)
        yield from _vtensor_families(s)
        yield from _host_families(s)
        yield _counter("kvserve_prefix_cache_queried_tokens",
                       "Prompt tokens looked up in the prefix cache", s.kv.queried_tokens)
        yield _counter("kvserve_prefix_cache_hit_tokens",
                       "Prompt tokens served from the prefix cache", s.kv.hit_tokens)
        yield _counter("kvserve_num_preemptions", "Requests preempted for KV space",
                       s.preemptions)
        yield _counter("kvserve_prompt_tokens", "Prompt tokens of accepted requests",
                       s.prompt_tokens)
        yield _counter("kvserve_generation_tokens", "Tokens generated", s.generation_tokens)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _kv_families(s: EngineSnapshot) -> Iterator[Metric]:
    label = ["layer_type"]
    used = GaugeMetricFamily("kvserve_kv_used_bytes",
                             "KV bytes in pages held by requests", labels=label)
    evictable = GaugeMetricFamily("kvserve_kv_evictable_bytes",
                                  "KV bytes of cached pages no request holds", labels=label)
    free = GaugeMetricFamily(
        "kvserve_kv_free_bytes",
        f"Free KV bytes: empty small pages inside a layer type's large pages, "
        f"or free large pages (layer_type={UNASSIGNED!r})", labels=label)
    waste = GaugeMetricFamily("kvserve_kv_wasted_bytes",
                              "Held KV bytes the live tokens do not need", labels=label)
    for spec in s.kv.specs:
        used.add_metric([spec.name], spec.used)
        evictable.add_metric([spec.name], spec.evictable)
        free.add_metric([spec.name], spec.empty)
        waste.add_metric([spec.name], spec.waste)
    free.add_metric([UNASSIGNED], s.kv.free)
    yield from (used, evictable, free, waste)
    yield _gauge("kvserve_kv_pool_bytes", "Size of the KV pool (a ceiling on a CPU: memory "
                 "is taken as pages are written)", s.kv.pool_bytes)
    if s.kv_physical_bytes is not None:
        yield _gauge("kvserve_kv_physical_bytes",
                     "Memory the paged KV pool holds now: pages written since they were last "
                     "given back; falls back after --kv-idle-release-s", s.kv_physical_bytes)
    usage = s.kv.used / s.kv.pool_bytes if s.kv.pool_bytes else 0.0
    yield _gauge("kvserve_kv_usage_ratio", "Fraction of the KV pool held by requests", usage)


VTENSOR_GAUGES = (
    ("reserved_bytes", "Virtual address space the vTensors reserve (no memory behind it)"),
    ("mapped_bytes", "Bytes of physical chunks mapped into vTensors; a prefix chunk shared "
                     "by n requests counts n times"),
    ("sliding_mapped_bytes", "The part of mapped_bytes in sliding-window layers: about "
                             "window + one chunk per request, what left the window is unmapped"),
    ("chunked_mapped_bytes", "The part of mapped_bytes in chunked-attention layers (Llama 4): "
                             "about the current attention chunk + one vTensor chunk per request"),
    ("referenced_bytes", "Bytes of physical chunks someone holds (a request, a cached "
                         "vTensor or a prefix-tree node), each chunk once"),
    ("physical_bytes", "Memory the vTensor pool really holds (the memfd's allocated blocks); "
                       "falls back after --kv-idle-release-s"),
    ("capacity_bytes", "The physical ceiling (--kv-memory): never more is allocated"),
)


def _vtensor_families(s: EngineSnapshot) -> Iterator[Metric]:
    """kvserve_vtensor_* gauges under --kv-backend vtensor; absent under the paged pool."""
    if s.vtensor is None:
        return
    for key, doc in VTENSOR_GAUGES:
        yield _gauge(f"kvserve_vtensor_{key}", doc, s.vtensor[key])
    yield _counter("kvserve_vtensor_recomputed_tokens",
                   "Prefix-cache hit tokens recomputed because the vTensor had given their "
                   "KV back (--kv-idle-release-s) or held a shorter prefix",
                   s.vtensor["recomputed_tokens"])


def _host_families(s: EngineSnapshot) -> Iterator[Metric]:
    """The host tier (--host-kv-memory): absent without one."""
    host = s.kv.host
    if host is None:
        return
    held = GaugeMetricFamily("kvserve_host_kv_bytes",
                             "Host-tier bytes holding cached KV pages", labels=["layer_type"])
    for name, nbytes in host.spec_bytes.items():
        held.add_metric([name], nbytes)
    yield held
    yield _gauge("kvserve_host_kv_pool_bytes", "Size of the host tier", host.pool_bytes)
    for way, pages, nbytes in (("out", host.pages_out, host.bytes_out),
                               ("in", host.pages_in, host.bytes_in)):
        where = "device to host" if way == "out" else "host to device"
        yield _counter(f"kvserve_kv_swap_{way}_pages", f"KV pages copied {where}", pages)
        yield _counter(f"kvserve_kv_swap_{way}_bytes", f"KV bytes copied {where}", nbytes)
    yield _counter("kvserve_prefix_cache_host_hit_tokens",
                   "Prompt tokens served from pages loaded back from the host tier",
                   host.hit_tokens)
    yield _counter("kvserve_host_kv_dropped_pages",
                   "Evicted pages the host tier had no room for", host.dropped)


class ServerMetrics:
    def __init__(self, engine: Collector | None = None) -> None:
        """`engine`: the collector of what a scrape reads from the engine(s), handed the
        snapshot by `render` (default: one engine's EngineCollector)."""
        self.registry = CollectorRegistry()
        self.engine = engine or EngineCollector()
        self.registry.register(self.engine)
        self.ttft = Histogram("kvserve_time_to_first_token_seconds",
                              "Arrival to first generated token", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.tpot = Histogram("kvserve_time_per_output_token_seconds",
                              "Mean time between output tokens, per request",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kvserve_e2e_request_latency_seconds",
                             "Arrival to last token", buckets=E2E_BUCKETS,
                             registry=self.registry)
        self.finished = Counter("kvserve_request_success", "Finished requests by reason",
                                ["finished_reason"], registry=self.registry)

    def request_finished(self, reason: str) -> None:
        self.finished.labels(finished_reason=reason).inc()

    def render(self, snapshot: object | None) -> bytes:
        """The exposition text; engine families are left out when no snapshot could be had."""
        self.engine.snapshot = snapshot
        try:
            return generate_latest(self.registry)
        finally:
            self.engine.snapshot = None
