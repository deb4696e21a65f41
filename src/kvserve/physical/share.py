"""One physical ceiling for the KV pools of several engines (models) in one process.

Each engine's paged pool is elastic on a CPU (`physical/pool.py`): its large
pages take memory only once written and give it back when punched. So pools
can share one ceiling: an engine holds the right to use some of its large
pages (*granted*), the rest are *lent* to the share (not in its allocator's
free list, punched), and the granted bytes of every member stay within the
ceiling. Memory moves between models as their load moves: before each step
an engine draws grants up to a watermark of free large pages (enough for one
step of its token budget), taking free pages back from other members first
if the ceiling is reached, and after each step it spills free pages beyond
the watermark. Another member's free pages go first, then its cached ones
(least recently used first, as its own pressure would evict them), so an
idle model's prefix cache does not hold memory a busy one needs.

Only pages no one holds move, and a member's allocator sees them as free
large pages coming and going, so every allocation path (and its tests)
stays as it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.memory.allocator import TwoLevelAllocator
from kvserve.physical.pool import KVPool


@dataclass(eq=False)
class Member:
    alloc: TwoLevelAllocator
    pool: KVPool
    watermark: int  # free large pages to keep before a step
    # Makes the copies evictions logged (to a host tier) before their pages are punched.
    flush: Callable[[], object] | None = None
    lent: list[int] = field(default_factory=list)  # large pages the member may not use now

    @property
    def page_bytes(self) -> int:
        return self.pool.layout.large_page_bytes

    def granted_bytes(self) -> int:
        return (self.alloc.num_large - len(self.lent)) * self.page_bytes


class KVShare:
    """A byte ceiling over the granted large pages of several elastic KV pools."""

    def __init__(self, ceiling_bytes: int) -> None:
        if ceiling_bytes <= 0:
            raise ValueError(f"a shared KV ceiling must be > 0 bytes, got {ceiling_bytes}")
        self.ceiling = ceiling_bytes
        self.members: list[Member] = []

    def join(self, alloc: TwoLevelAllocator, pool: KVPool, step_bytes: int,
             flush: Callable[[], object] | None = None) -> Member:
        """A new member, every page lent: it holds nothing until it draws.
        `step_bytes`: the KV one step may write (its watermark of free pages); `flush`:
        what makes the copies its evictions logged (MemPool.flush), if any."""
        if not pool.memory.elastic:
            raise ValueError("a shared KV ceiling needs elastic pools (a CPU with memfd)")
        if alloc.num_free_large() != alloc.num_large:
            raise ValueError("a pool joins a share before it holds anything")
        watermark = math.ceil(step_bytes / pool.layout.large_page_bytes) + len(alloc.specs)
        member = Member(alloc, pool, watermark, flush)
        member.lent = sorted(alloc.withdraw(alloc.num_large), reverse=True)
        self.members.append(member)
        return member

    def leave(self, member: Member) -> None:
        self.members.remove(member)

    def granted_bytes(self) -> int:
        return sum(m.granted_bytes() for m in self.members)

    def draw(self, member: Member) -> int:
        """Top member's free large pages up to its watermark; returns the pages granted."""
        want = min(member.watermark - member.alloc.num_free_large(), len(member.lent))
        if want <= 0:
            return 0
        need = want * member.page_bytes - (self.ceiling - self.granted_bytes())
        others = [m for m in self.members if m is not member]
        for evict in (False, True):  # free pages anywhere before anyone's cache
            for other in others:
                if need > 0:
                    need -= self._spill(other, math.ceil(need / other.page_bytes), evict)
        room = (self.ceiling - self.granted_bytes()) // member.page_bytes
        pages = [member.lent.pop() for _ in range(min(want, room))]
        member.alloc.deposit(pages)
        return len(pages)

    def settle(self, member: Member) -> int:
        """Lend back the member's free large pages beyond its watermark; returns the bytes."""
        return self._spill(member, member.alloc.num_free_large() - member.watermark)

    def _spill(self, member: Member, pages: int, evict: bool = False) -> int:
        """Take up to `pages` free large pages from member (punched), with `evict` after
        evicting its least recently used cached ones; returns the bytes."""
        if pages <= 0:
            return 0
        if evict and member.alloc.num_free_large() < pages:
            member.alloc.evict(pages - member.alloc.num_free_large())
            if member.flush is not None:
                member.flush()
        taken = member.alloc.withdraw(pages)
        member.pool.give_back(taken)
        member.lent += taken
        member.lent.sort(reverse=True)  # pop() grants the lowest: used pages stay together
        return len(taken) * member.page_bytes
