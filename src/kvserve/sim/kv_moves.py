"""transfer_with_insert between simulated instances, through the real cluster's code.

The sending side is `cluster.transfer.plan_export`, what `export_kv` sends: the
longest cached prefix of the tokens and, per spec, only the pages a hit needs
(every block for full attention, the last window for a sliding window), less the
blocks the receiver already holds. The receiving side is
`cluster.transfer.insert_blocks`, `import_kv`'s bookkeeping: allocate pages,
insert them under the block keys, free them into the evictable cache; no room
means nothing is inserted and the tokens get recomputed. Only the bytes are
missing here: a simulated pool has none, so a payload carries its size, each
page at the memory core's page size of its spec (what `KVPayload.nbytes` counts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvserve.cluster.transfer import insert_blocks, plan_export
from kvserve.memory import KVCacheManager
from kvserve.physical.mempool import MemPool


class IndexPool(MemPool):
    """A MemPool over a simulated memory core: its index and allocator, no page bytes."""

    def __init__(self, kv: KVCacheManager) -> None:
        if kv.host is not None:
            raise ValueError("the cluster simulator has no host tier")
        super().__init__(kv, device=None)  # type: ignore[arg-type]

    def flush(self) -> int:
        # No tier copies without a host tier; and a simulator counts copies in its steps.
        return 0


@dataclass
class SimPayload:
    tokens: list[int]  # the prefix the blocks belong to
    blocks: dict[str, list[int]] = field(default_factory=dict)  # spec -> block indices
    nbytes: int = 0

    @property
    def num_pages(self) -> int:
        return sum(len(b) for b in self.blocks.values())


def export(pool: IndexPool, tokens: list[int],
           have: Mapping[str, set[int]] | None = None) -> SimPayload:
    """What the sender's export_kv would send the receiver holding `have`."""
    prefix, picks = plan_export(pool, tokens, have)
    layout = pool.kv.layout
    out = SimPayload(prefix)
    for name, pairs in picks.items():
        out.blocks[name] = [b for b, _ in pairs]
        out.nbytes += len(pairs) * layout.page_bytes[layout.index(name)]
    return out


def import_(pool: IndexPool, payload: SimPayload) -> int:
    """Insert the payload's pages into the receiver's prefix cache; the pages inserted."""
    return insert_blocks(pool, payload.tokens, payload.blocks)
