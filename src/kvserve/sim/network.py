"""The modelled network between simulated instances: a NIC each, transfers queue on it.

Every instance has one full-duplex NIC of `bandwidth` bytes/s each way (200 Gb/s,
one ConnectX-7 port per H100, by default). A transfer of b bytes holds the sender's
egress and the receiver's ingress for b / bandwidth, first come first served, and
lands `latency` seconds after its last byte leaves (per-transfer set-up: the
request's metadata, one call per spec for MemServe's aggregated pages). So a
transfer waits for earlier transfers on either NIC: pd-caching-3's returns to a
prefill instance queue with the pulls into it, P-to-D prompts with each other at
a busy prefill instance. A transfer with no bytes (D already holds everything) is
only the metadata: it lands after `latency` and waits for nothing.

No link is shared beyond the two NICs (a non-blocking fabric) and a transfer
does not overlap a later one on the same NIC (no fair sharing): a simple queue,
the same for every design compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GBIT = 1e9 / 8  # bytes/s of one Gb/s


@dataclass(frozen=True)
class NetworkConfig:
    bandwidth: float = 200 * GBIT  # bytes/s per NIC, each direction
    latency: float = 1e-3  # seconds per transfer, beside its bytes


@dataclass(frozen=True)
class Transfer:
    kind: str  # "prompt" (P to D), "return" (D to P, pd-caching-3), "pull" (Eq. 2)
    src: str
    dst: str
    nbytes: int
    sent: float  # when it was handed to the network
    start: float  # when its first byte left (after the queue)
    landed: float


@dataclass
class Network:
    cfg: NetworkConfig = field(default_factory=NetworkConfig)
    transfers: list[Transfer] = field(default_factory=list)
    _egress: dict[str, float] = field(default_factory=dict)  # NIC -> when it is free
    _ingress: dict[str, float] = field(default_factory=dict)

    def send(self, kind: str, src: str, dst: str, nbytes: int, now: float) -> float:
        """Queue a transfer at `now`; returns when it lands at dst."""
        if nbytes <= 0:
            start = end = now
        else:
            start = max(now, self._egress.get(src, 0.0), self._ingress.get(dst, 0.0))
            end = start + nbytes / self.cfg.bandwidth
            self._egress[src] = self._ingress[dst] = end
        landed = end + self.cfg.latency
        self.transfers.append(Transfer(kind, src, dst, nbytes, now, start, landed))
        return landed

    def bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.transfers:
            out[t.kind] = out.get(t.kind, 0) + t.nbytes
        return out
