"""MemServe's global scheduler (§6): which instance serves a request.

Policies (Table 6):
  least-load   the instance with the fewest requests in flight;
  session      a session's requests stay on one instance (intra-session reuse);
  prompt-tree  Eq. 1: the instance minimising queue time + exec(x, y_p), where y_p is
               the share of the prompt its prompt tree says it caches (inter-session
               reuse too), among instances within `imbalance` requests of the least
               loaded one (a stale tree must not pile load on one instance).

The prompt trees (one per role) learn from events the instances report in their
heartbeats (exact) and from the requests routed through (approximate, with a
TTL). exec(x, y) is the §5.3 cost model when a profile is given; otherwise
uncached prompt tokens at `prefill_tokens_per_s`. The same model decides
whether a prefix another instance holds is worth pulling to the chosen one
(Eq. 2: its bytes at the measured transfer bandwidth against the prefill time
saved).
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvserve.cluster.instance import ROLES, Heartbeat, InstanceInfo
from kvserve.cluster.prompt_tree import PromptTree, block_hashes
from kvserve.engine.cost_model import CostModel

POLICIES = ("least-load", "session", "prompt-tree")


@dataclass
class Member:
    """One live instance as the front end sees it."""

    info: InstanceInfo
    handle: object  # the Ray actor
    pending: dict[str, tuple[int, float]] = field(default_factory=dict)  # rid -> (x, y)
    running: int = 0  # as of the last heartbeat
    waiting: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    lent_out_bytes: int = 0  # DistAttention: KV its requests lent to others so far
    # KV transfers started from / to it that have not landed: the queue on its NIC
    sending: int = 0
    receiving: int = 0
    held_for_others: dict[str, int] = field(default_factory=dict)  # request -> blocks

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def load(self) -> int:
        return len(self.pending)


@dataclass
class Pull:
    """Move the KV of a longer cached prefix from `source` before running the request."""

    source: Member
    blocks: int  # the source's cached blocks of the prompt


class GlobalScheduler:
    def __init__(self, policy: str = "prompt-tree", *, ttl: float = 120.0,
                 events: bool = True, imbalance: int = 4, cost: CostModel | None = None,
                 prefill_tokens_per_s: float = 1000.0, bandwidth: float = 1e9,
                 transfer_latency_s: float = 0.005) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
        self.policy, self.events, self.imbalance, self.cost = policy, events, imbalance, cost
        self.prefill_tokens_per_s, self.bandwidth = prefill_tokens_per_s, bandwidth
        self.transfer_latency_s = transfer_latency_s
        self.members: dict[str, Member] = {}
        self.trees = {role: PromptTree(ttl) for role in ROLES}
        self._sessions: dict[tuple[str, str], str] = {}

    # ----------------------------------------------------------- membership

    def add(self, member: Member) -> None:
        self.members[member.name] = member

    def remove(self, name: str) -> Member | None:
        """Forget a dead or departed instance: its tree entries and sessions go too."""
        member = self.members.pop(name, None)
        if member is not None:
            self.trees[member.info.role].drop(name)
            self._sessions = {k: v for k, v in self._sessions.items() if v != name}
        return member

    def of_role(self, role: str) -> list[Member]:
        return sorted((m for m in self.members.values() if m.info.role == role),
                      key=lambda m: m.name)

    # --------------------------------------------------------------- routing

    def choose(self, role: str, hashes: Sequence[Hashable], num_tokens: int, now: float,
               session: str | None = None) -> tuple[Member, int]:
        """The instance of `role` for a prompt of num_tokens with these block hashes, and
        how many of its blocks that instance's tree says it caches."""
        members = self.of_role(role)
        if not members:
            raise LookupError(f"no live {role} instance")
        cached = self.trees[role].match(hashes, now)
        if self.policy == "least-load":
            best = min(members, key=lambda m: (m.load, m.name))
        elif self.policy == "session":
            best = self._by_session(role, members, session)
        else:
            best = self._by_cost(members, cached, num_tokens)
        return best, cached.get(best.name, 0)

    def _by_session(self, role: str, members: list[Member], session: str | None) -> Member:
        if session is None:
            return min(members, key=lambda m: (m.load, m.name))
        name = self._sessions.get((role, session))
        if name in self.members:
            return self.members[name]
        # a new session: spread by its id, so sessions land evenly whatever their timing
        pick = members[zlib.crc32(session.encode()) % len(members)]
        self._sessions[(role, session)] = pick.name
        return pick

    def _by_cost(self, members: list[Member], cached: dict[str, int], x: int) -> Member:
        least = min(m.load for m in members)
        fair = [m for m in members if m.load <= least + self.imbalance]
        block = members[0].info.block

        def eq1(m: Member) -> tuple[float, int, str]:
            # Eq. 1, plus the KV already queued into its NIC: what is sent to it (a
            # prompt to decode, a pull) waits behind that
            y = min(cached.get(m.name, 0) * block / x, 1.0) if x else 0.0
            nic = m.receiving / self.bandwidth
            return (self.queue_time(m) + self.exec(x, y) + nic, m.load, m.name)
        return min(fair, key=eq1)

    def plan_pull(self, role: str, chosen: Member, hashes: Sequence[Hashable],
                  num_tokens: int, now: float) -> Pull | None:
        """A live instance of `role` caching more of the prompt than `chosen`, when moving
        the difference beats recomputing it (Eq. 2); None otherwise."""
        cached = self.trees[role].match(hashes, now)
        have = cached.get(chosen.name, 0)
        best = max(((n, name) for name, n in cached.items() if name in self.members),
                    default=(0, ""))
        if best[0] <= have:
            return None
        source = self.members[best[1]]
        block, x = chosen.info.block, max(num_tokens, 1)
        gain = self.exec(x, have * block / x) - self.exec(x, min(best[0] * block / x, 1.0))
        nbytes = (best[0] - have) * block * source.info.kv_bytes_per_token
        # The pull waits behind the transfers already queued on either NIC: priced at the
        # link's bandwidth alone, pulls piled up on busy NICs (docs/benchmarks.md, the
        # cluster simulator on 200 Gb/s NICs).
        queued = max(source.sending, chosen.receiving)
        if (queued + nbytes) / self.bandwidth + self.transfer_latency_s >= gain:
            return None
        return Pull(source, best[0])

    def exec(self, x: float, y: float) -> float:
        """Predicted prefill seconds of an x-token prompt, fraction y cached."""
        if self.cost is not None:
            return self.cost.exec(x, y)
        return x * (1.0 - y) / self.prefill_tokens_per_s

    def queue_time(self, m: Member) -> float:
        return sum(self.exec(x, y) for x, y in m.pending.values())

    # ---------------------------------------------------------- bookkeeping

    def started(self, m: Member, rid: str, x: int, cached_blocks: int) -> None:
        y = min(cached_blocks * m.info.block / x, 1.0) if x else 0.0
        m.pending[rid] = (x, y)

    def done(self, m: Member, rid: str) -> None:
        m.pending.pop(rid, None)

    @staticmethod
    def transfer(src: Member, dst: Member, nbytes: int) -> None:
        """A KV transfer of nbytes from src to dst starts (negative: it landed)."""
        src.sending += nbytes
        dst.receiving += nbytes

    def learn(self, m: Member, tokens: Sequence[int], now: float) -> None:
        """Approximate mode: m served these tokens, so it caches them for a while."""
        self.trees[m.info.role].learn(m.name, block_hashes(tokens, m.info.block), now)

    def heartbeat(self, hb: Heartbeat) -> None:
        m = self.members.get(hb.name)
        if m is None:
            return
        m.running, m.waiting = hb.running, hb.waiting
        m.sent_bytes, m.received_bytes = hb.sent_bytes, hb.received_bytes
        m.lent_out_bytes, m.held_for_others = hb.lent_out_bytes, hb.lent
        if not self.events:
            return
        tree = self.trees[m.info.role]
        for keys in hb.stored.values():
            tree.stored(m.name, keys)
        tree.removed(m.name, hb.gone)
