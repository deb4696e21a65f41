"""Shared checks of the memory core's invariants."""

from collections import Counter

from kvserve.memory import NO_PAGE, KVCacheManager, LayerKind
from kvserve.memory.allocator import EMPTY, EVICTABLE, USED


def check_invariants(mgr: KVCacheManager, lent: int = 0) -> None:
    """No page owned twice, ref counts match holders, bytes conserved (`lent`: large
    pages lent to a shared ceiling, out of the allocator)."""
    alloc = mgr.alloc
    layout = mgr.layout
    held = sum(
        (sp.n_used + sp.n_evictable + sp.n_empty) * pb
        for sp, pb in zip(alloc.specs, layout.page_bytes)
    )
    free_large = alloc.num_free_large() + lent
    assert held + free_large * layout.large_page_bytes == mgr.pool_bytes
    # Requests computing their prompt: started (a first allocation), prompt not done.
    assert all(mgr.reqs.get(rid) is r and r.num_alloc > r.num_hit and
               r.num_computed < r.prompt_len for rid, r in mgr.computing.items())
    free = [lp for part in alloc.free_large for lp in part]
    assert len(free) == len(set(free)), "a large page is free twice"
    assert all(alloc.owner[lp] == -1 and alloc.emask[lp] == 0 for lp in free)
    for s, sp in enumerate(alloc.specs):
        holders = Counter()
        for r in mgr.reqs.values():
            holders.update(p for p in r.tables[s] if p >= 0)
            holders.update(r.held.get(s, ()))  # out of the window, held for a reuse point
            # Pending Mamba snapshots: grid checkpoints and the restore source hold a ref
            # each; the tail's boundaries (several in one step) share its table entry's.
            holders.update(pid for pos, pid in r.pending[s]
                           if _pending_is_page(mgr, s) and pid not in r.tables[s])
        owned = [lp for lp in range(alloc.num_large) if alloc.owner[lp] == s]
        assert len(owned) == sp.n_large
        counts = Counter()
        state = sp.state
        for lp in owned:
            used = 0
            for pid in range(lp * sp.k, lp * sp.k + sp.k):
                st = state[pid]
                counts[st] += 1
                assert sp.ref[pid] == holders.get(pid, 0), f"spec {s} page {pid} ref"
                assert (st == USED) == (sp.ref[pid] > 0)
                if st == EVICTABLE:
                    assert sp.hash[pid] is not None
                if st == EMPTY:
                    assert sp.hash[pid] is None
                assert (st == EMPTY) == bool(alloc.emask[lp] >> (pid - lp * sp.k) & 1)
                used += st == USED
            assert alloc.used[lp] == used
            assert (lp in sp.holes) == (alloc.emask[lp] != 0 and used > 0)
        assert counts[USED] == sp.n_used and counts[EVICTABLE] == sp.n_evictable
        assert counts[EMPTY] == sp.n_empty
        unused = [lp for lp in owned if alloc.used[lp] == 0]
        assert sp.n_unused_large == len(unused)
        assert sp.n_idle_empty == sum(alloc.emask[lp].bit_count() for lp in unused)
        assert set(sp.idle) == {lp for lp in unused if alloc.emask[lp]}
        for pid in holders:
            assert alloc.owner[pid // sp.k] == s, "a request holds a page of a foreign large page"
        for h, pid in sp.cached.items():
            assert sp.hash[pid] == h and state[pid] != EMPTY


def check_state_peak(mgr: KVCacheManager, chunk: int) -> None:
    """fits_alone and the wait rules count a request's Mamba pages by peak_pages: the
    live state, the tail, the checkpoints its prompt holds for reuse points and one past
    its prompt (with caching; without it, every grid point of a `chunk`-token step)."""
    for r in mgr.reqs.values():
        for m in mgr.managers:
            if m.spec.kind is not LayerKind.MAMBA:
                continue
            s = m.s
            mine = {p for p in r.tables[s] if p != NO_PAGE}
            mine |= {p for pos, p in r.pending[s] if pos > 0}
            mine |= set(r.held.get(s, ()))
            assert len(mine) <= m.peak_pages(len(r.tokens), chunk, ())


def _pending_is_page(mgr: KVCacheManager, s: int) -> bool:
    return mgr.layout.specs[s].kind is LayerKind.MAMBA
