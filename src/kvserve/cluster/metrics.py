"""/metrics of a cluster: every instance's engine families, labelled, and their totals.

Each live instance's EngineSnapshot goes through the single-engine collector;
its samples gain `instance` and `role` labels. Totals over the instances come as
`kvserve_cluster_*` families (sums of the same samples), so a sum() over the
labelled ones never counts anything twice. Latency histograms are the front
end's own: what clients saw, whatever instances served them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvserve.server.metrics import EngineCollector


class ClusterCollector(Collector):
    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.snapshot: dict[str, tuple[str, Any]] | None = None  # name -> (role, snapshot)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        totals: dict[str, Metric] = {}
        for name, (role, snap) in sorted((self.snapshot or {}).items()):
            one = EngineCollector()
            one.snapshot = snap
            for fam in one.collect():
                mine = families.setdefault(fam.name, Metric(fam.name, fam.documentation,
                                                            fam.type))
                total = totals.setdefault(fam.name, Metric(
                    "kvserve_cluster_" + fam.name.removeprefix("kvserve_"),
                    f"{fam.documentation} (sum over the instances)", fam.type))
                for smp in fam.samples:
                    mine.add_sample(smp.name, {**smp.labels, "instance": name, "role": role},
                                    smp.value)
                    _add_to(total, "kvserve_cluster_" + smp.name.removeprefix("kvserve_"),
                            smp.labels, smp.value)
        yield from families.values()
        yield from (t for t in totals.values() if not t.name.endswith("_ratio"))
        yield from self._own()

    def _own(self) -> Iterator[Metric]:
        members = list(self.cluster.scheduler.members.values())
        live = Metric("kvserve_cluster_instances", "Live instances", "gauge")
        for role in sorted({m.info.role for m in members}):
            live.add_sample("kvserve_cluster_instances", {"role": role},
                            sum(m.info.role == role for m in members))
        yield live
        moved = Metric("kvserve_kv_transfer_bytes", "KV bytes moved between instances",
                       "counter")
        for m in members:
            for way, n in (("sent", m.sent_bytes), ("received", m.received_bytes)):
                moved.add_sample("kvserve_kv_transfer_bytes_total",
                                 {"instance": m.name, "direction": way}, n)
        yield moved
        lent = Metric("kvserve_distattn_lent_bytes",
                      "KV bytes an instance's requests lent to other instances (DistAttention)",
                      "counter")
        held = Metric("kvserve_distattn_held_blocks",
                      "Full-attention KV blocks an instance holds for others' requests", "gauge")
        for m in members:
            lent.add_sample("kvserve_distattn_lent_bytes_total", {"instance": m.name},
                            m.lent_out_bytes)
            held.add_sample("kvserve_distattn_held_blocks", {"instance": m.name},
                            sum(m.held_for_others.values()))
        yield lent
        yield held
        lost = Metric("kvserve_cluster_instances_lost", "Instances removed after failing",
                      "counter")
        lost.add_sample("kvserve_cluster_instances_lost_total", {}, len(self.cluster.lost))
        yield lost


def _add_to(total: Metric, name: str, labels: dict[str, str], value: float) -> None:
    for i, smp in enumerate(total.samples):
        if smp.name == name and smp.labels == labels:
            total.samples[i] = smp._replace(value=smp.value + value)
            return
    total.add_sample(name, labels, value)
