"""vTensor over a memfd: chunk bookkeeping, prefix sharing, memory given back, and safety.

The kernel is the referee: /proc/self/maps says how many VMAs a range really
takes and what backs a live view, and the memfd's allocated blocks say how
much memory the pool really holds.
"""

import gc
import itertools
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.physical.vtensor import (
    UNMAPPED,
    ChunkPool,
    CpuBackend,
    MappingLimitError,
    OutOfPhysicalMemory,
    VTensorPool,
    chunk_bytes_for,
)

C = 16 * 1024  # chunk: 4 pages
BPT = 1024  # bytes per token: 16 tokens per chunk
TPC = C // BPT
_names = itertools.count()


def make_pool(num_chunks=16, slots=8, max_mappings=1000, clock=None, ahead=0):
    backend = CpuBackend(C, num_chunks, max_mappings, name=f"vt-test-{os.getpid()}-{next(_names)}")
    kw = {} if clock is None else {"clock": clock}
    return VTensorPool(BPT, slots * TPC, chunks=ChunkPool(backend), ahead_chunks=ahead, **kw)


_MAPS_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+ *(.*)$", re.M)


def vmas():
    """(lo, hi, perms, path) of every mapping of this process."""
    with open("/proc/self/maps") as f:
        text = f.read()
    return [(int(lo, 16), int(hi, 16), perms, path)
            for lo, hi, perms, path in _MAPS_LINE.findall(text)]


def vmas_in(lo, hi, maps=None):
    return [m for m in (maps or vmas()) if m[0] < hi and m[1] > lo]


def memfd_vmas(pool):
    tag = f"/memfd:{pool.backend.name} "
    return sum(1 for m in vmas() if (m[3] + " ").startswith(tag))


def all_vtensors(pool):
    return [*pool.active.values(), *pool.cached, *pool.zombies]


def check_vmas(pool, maps=None):
    """The pool's VMA count is the kernel's, range by range."""
    maps = maps or vmas()
    for vt in all_vtensors(pool):
        assert len(vmas_in(vt.addr, vt.addr + vt.nbytes, maps)) == vt.vmas()
    assert pool.backend.mappings == sum(vt.vmas() for vt in all_vtensors(pool))


def check_refs(pool):
    """Every reference is a mapping slot or a tree node; free means unreferenced."""
    want = [0] * pool.backend.num_chunks
    for vt in all_vtensors(pool):
        for c in vt.mapped_chunks():
            want[c] += 1
        assert all(c == UNMAPPED for c in vt.chunks[:vt.head])
    for node in pool.tree.nodes.values():
        want[node.chunk] += 1
    assert pool.chunks.ref == want
    assert pool.chunks.free == {c for c, r in enumerate(want) if r == 0}
    assert pool.chunks.dirty <= pool.chunks.free


def write_tokens(pool, req, tokens, lo, hi):
    """Play the model: token t's KV slot starts with its token id."""
    view = pool.view(req, torch.int32)
    view[lo:hi, 0] = torch.tensor(tokens[lo:hi], dtype=torch.int32)


def read_tokens(pool, req, hi):
    return pool.view(req, torch.int32)[:hi, 0].tolist()


def visible(tokens, hi, head_tokens):
    """What a view shows of tokens[:hi] once the first `head_tokens` were unmapped: zeros."""
    return [0] * min(hi, head_tokens) + list(tokens[head_tokens:hi])


def chunk_tokens(pool, chunk):
    """Token ids a chunk holds, read from the memfd itself (no mapping involved)."""
    raw = os.pread(pool.backend.fd, C, chunk * C)
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).view(TPC, -1)[:, 0].tolist()


# ------------------------------------------------------------------ examples


def test_chunk_sizes_are_validated():
    assert chunk_bytes_for(1024) == 2 << 20
    assert chunk_bytes_for(18 * 1024) % (18 * 1024) == 0 and chunk_bytes_for(18 * 1024) % 4096 == 0
    with pytest.raises(ValueError, match="multiple"):
        CpuBackend(C + 100, 4, 10)
    with pytest.raises(ValueError, match="whole tokens"):
        VTensorPool(3000, 100, chunks=ChunkPool(CpuBackend(C, 4, 10)))


def test_alloc_takes_the_chunks_after_then_the_lowest_run_then_the_lowest_ones():
    chunks = ChunkPool(CpuBackend(C, 12, 100, name=f"vt-test-{os.getpid()}-{next(_names)}"))
    chunks.alloc(12)
    chunks.decref([1, 2, 4, 5, 6, 9, 10, 11])
    assert chunks.alloc(2, after=3) == [4, 5]  # where the caller's last chunk left off
    assert chunks.alloc(3) == [9, 10, 11]  # 1 2 and 6 are lower, but no run of 3
    assert chunks.alloc(3, after=0) == [1, 2, 6]  # 1 2 follow 0; then the lowest free
    chunks.decref([0, 3, 8])
    assert chunks.alloc(2) == [0, 3]  # no run of 2 left: the lowest ones
    assert chunks.free == {8} and chunks.ref == [1] * 8 + [0] + [1] * 3
    chunks.backend.close()


def test_growing_request_is_one_contiguous_tensor_and_one_vma():
    pool = make_pool()
    pool.create("a")
    tokens = list(range(1000, 1000 + 5 * TPC))
    for n in range(1, len(tokens) + 1, 7):
        pool.extend("a", n)
        write_tokens(pool, "a", tokens, n - 1, n)
    pool.extend("a", len(tokens))
    write_tokens(pool, "a", tokens, 0, len(tokens))
    vt = pool.active["a"]
    assert vt.chunks == [0, 1, 2, 3, 4]  # consecutive, so the kernel merged them
    assert vt.vmas() == 2  # the chunk run + the PROT_NONE rest of the reservation
    check_vmas(pool)
    assert memfd_vmas(pool) == 1
    assert read_tokens(pool, "a", len(tokens)) == tokens
    pool.close()


def test_release_is_lazy_and_a_follow_up_turn_reuses_the_mapping():
    pool = make_pool()
    turn1 = list(range(2 * TPC + 3))
    pool.create("t1")
    pool.extend("t1", len(turn1))
    write_tokens(pool, "t1", turn1, 0, len(turn1))
    pool.record("t1", turn1)
    vt = pool.active["t1"]
    chunks = list(vt.chunks)
    pool.release("t1")
    assert pool.stats().mapped_bytes == len(chunks) * C  # still mapped
    calls = []
    real_map = pool.backend.map
    pool.backend.map = lambda *a: (calls.append(a), real_map(*a))[1]
    turn2 = turn1 + list(range(500, 520))
    assert pool.create("t2", turn2) == 2 * TPC
    assert pool.active["t2"] is vt and vt.chunks == chunks and calls == []  # nothing mapped
    pool.extend("t2", len(turn2))
    write_tokens(pool, "t2", turn2, 2 * TPC, len(turn2))
    assert read_tokens(pool, "t2", len(turn2)) == turn2
    check_refs(pool)
    check_vmas(pool)
    pool.close()


def test_memory_pressure_reclaims_the_prefix_tree_leaves_first():
    pool = make_pool(num_chunks=6)
    a = list(range(4 * TPC))
    pool.create("a")
    pool.extend("a", len(a))
    write_tokens(pool, "a", a, 0, len(a))
    pool.record("a", a)
    pool.release("a")
    pool.create("b")
    pool.extend("b", 4 * TPC)  # needs the cached vTensor's chunks and 2 of the tree's
    assert len(pool.tree) == 2  # the two blocks nearest the root stay
    assert pool.create("c", a) == 2 * TPC
    assert read_tokens(pool, "c", 2 * TPC) == a[: 2 * TPC]
    check_refs(pool)
    check_vmas(pool)
    pool.close()


def test_map_ahead_is_a_head_start_taken_back_first_when_memory_is_short():
    pool = make_pool(num_chunks=5)
    a = list(range(TPC + 3))
    pool.create("a")
    pool.extend("a", len(a))
    write_tokens(pool, "a", a, 0, len(a))
    pool.record("a", a)  # the tree holds a's first chunk too
    assert pool.map_ahead("a", 4 * TPC) == 2  # Extend ahead: 2 more chunks, free ones
    vt = pool.active["a"]
    assert len(vt.chunks) == 4 and vt.need == 2
    pool.create("c")
    pool.extend("c", TPC)
    pool.release("c")  # a cached vTensor: its chunk is reclaimable too, but costs a reuse
    before = pool.backend.map_calls
    pool.extend("a", len(a) + TPC)  # within the head start: nothing to map
    assert pool.backend.map_calls == before and vt.need == 3
    pool.create("b", max_tokens=16 * TPC)  # longer than c's range: c is not reused
    pool.extend("b", TPC)  # no free chunk: a's head start goes, not the cache nor the tree
    assert len(vt.chunks) == 3 and len(pool.cached) == 1 and len(pool.tree) == 1
    assert read_tokens(pool, "a", len(a)) == a
    check_refs(pool)
    check_vmas(pool)
    pool.close()


def test_map_ahead_never_reclaims_nor_fails():
    pool = make_pool(num_chunks=4)
    pool.create("c")
    pool.extend("c", 2 * TPC)
    pool.release("c")  # cached: 2 chunks held
    pool.create("a", max_tokens=16 * TPC)  # longer than c's range: c is not reused
    pool.extend("a", TPC)
    assert len(pool.chunks.free) == 1
    assert pool.map_ahead("a", 4 * TPC) == 1  # only what is free: the cache stays
    assert len(pool.cached) == 1 and len(pool.active["a"].chunks) == 2
    assert pool.map_ahead("a", 100 * TPC) == 0  # nothing free, past the range: no error
    check_refs(pool)
    check_vmas(pool)
    pool.close()


def test_extend_past_its_own_head_start_keeps_it():
    """A request's own head start is not `_reclaim`ed from under its own extend."""
    pool = make_pool(num_chunks=4)
    pool.create("c")
    pool.extend("c", TPC)
    pool.release("c")  # cached: 1 chunk
    pool.create("a", max_tokens=16 * TPC)
    pool.extend("a", TPC)
    assert pool.map_ahead("a", 3 * TPC) == 2  # a: 3 chunks, needs 1; none free
    pool.extend("a", 4 * TPC)  # the cache goes; a's own head start is part of its need
    assert len(pool.active["a"].chunks) == 4 and pool.active["a"].need == 4
    with pytest.raises(OutOfPhysicalMemory):
        pool.extend("a", 5 * TPC)
    assert pool.active["a"].need == 4  # a failed extend leaves the need as it was
    check_refs(pool)
    check_vmas(pool)
    pool.close()


def test_idle_trim_keeps_recent_prefixes():
    now = [0.0]
    pool = make_pool(clock=lambda: now[0])
    old, new = list(range(2 * TPC)), list(range(500, 500 + 2 * TPC))
    for rid, tokens in (("old", old), ("new", new)):
        pool.create(rid)
        pool.extend(rid, len(tokens))
        write_tokens(pool, rid, tokens, 0, len(tokens))
        pool.record(rid, tokens)
        pool.release(rid)
        now[0] += 10.0
    pool.trim(idle_s=15.0)  # "old" was last used 20 s ago, "new" 10 s ago
    assert len(pool.tree) == 2 and len(pool.cached) == 1
    assert pool.create("again", new) == 2 * TPC and pool.create("lost", old) == 0
    check_refs(pool)
    check_vmas(pool)
    pool.close()


def test_mapping_limit_raises_before_the_budget_is_passed():
    pool = make_pool(num_chunks=16, max_mappings=4)
    pool.create("a")
    pool.extend("a", 2 * TPC)  # a: [0 1] + PROT_NONE = 2 VMAs
    pool.create("b")
    pool.extend("b", TPC)  # b: [2] + PROT_NONE = 2 VMAs
    assert pool.backend.mappings == 4
    pool.extend("a", 2 * TPC)  # no change
    before = (list(pool.chunks.ref), set(pool.chunks.free), pool.active["a"].chunks[:])
    with pytest.raises(MappingLimitError, match="budget of 4"):
        pool.extend("a", 3 * TPC)  # chunk 2 is b's: a's next run would be a third VMA
    with pytest.raises(MappingLimitError):
        pool.create("c")
    assert before == (list(pool.chunks.ref), set(pool.chunks.free), pool.active["a"].chunks)
    assert pool.backend.mappings == 4 and "c" not in pool.active
    check_vmas(pool)
    pool.extend("b", 3 * TPC)  # b's next chunks follow its last: still one run
    assert pool.active["b"].chunks == [2, 3, 4] and pool.backend.mappings == 4
    check_vmas(pool)
    pool.close()


def test_default_mapping_budget_leaves_room_for_the_process():
    backend = CpuBackend(C, 4)
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    assert 0 < backend.max_mappings < limit // 2 + 1
    backend.close()


def test_physical_memory_rises_with_use_and_falls_after_release_and_trim():
    now = [0.0]
    pool = make_pool(num_chunks=32, slots=16, clock=lambda: now[0])
    pool.create("a")
    seen = []
    for n in range(2 * TPC, 12 * TPC + 1, 2 * TPC):
        pool.extend("a", n)
        pool.view("a")[: n * BPT] = 1  # the model writes its KV
        seen.append(pool.stats().physical_bytes)
    assert seen == [n * BPT for n in range(2 * TPC, 12 * TPC + 1, 2 * TPC)]
    pool.release("a")
    now[0] = 10.0
    assert pool.trim(idle_s=30) == 0  # not idle long enough: kept for reuse
    assert pool.stats().physical_bytes == seen[-1]
    now[0] = 50.0
    assert pool.trim(idle_s=30) == 12 * C
    st_ = pool.stats()
    assert st_.physical_bytes == 0 and st_.mapped_bytes == 0 and st_.reserved_bytes == 0
    assert st_.mappings == 0 and memfd_vmas(pool) == 0
    pool.close()


def test_a_live_view_under_unmap_sees_a_placeholder_not_prot_none():
    pool = make_pool()
    pool.create("a")
    pool.extend("a", 3 * TPC)
    view = pool.view("a")
    view[:] = 9
    pool.release("a")
    pool.trim()  # frees the range; the view keeps it as a zombie of placeholders
    lo, hi = view.data_ptr(), view.data_ptr() + view.numel()
    backing = vmas_in(lo, hi)
    assert backing and all(m[2].startswith("rw-p") for m in backing)
    assert pool.stats().zombies == 1 and pool.chunks.free == set(range(16))
    check_vmas(pool)
    del view
    gc.collect()
    assert pool.stats().zombies == 0 and pool.backend.mappings == 0
    assert vmas_in(lo, hi) == [] or all(m[3] for m in vmas_in(lo, hi))  # ours is gone
    pool.close()


STALE_VIEW = """
import gc, torch
from kvserve.physical.vtensor import ChunkPool, CpuBackend, VTensorPool
pool = VTensorPool(1024, 256, chunks=ChunkPool(CpuBackend(16384, 8, 100)), ahead_chunks=0)
pool.create("a"); pool.extend("a", 40)
view = pool.view("a", torch.int32)
view[:] = 5
part = view[16:32]  # a derived view keeps it alive too
del view
pool.release("a"); pool.trim()
pool.create("b"); pool.extend("b", 48)  # the chunks go to b, and b writes them
pool.view("b")[:] = 7
assert int(part.abs().sum()) == 0, "stale read must see zeros, not b's KV"
part[:] = 3  # a stale write lands in a placeholder ...
assert int((pool.view("b") == 7).all()), "... never in b's chunks"
del part; gc.collect()
s = pool.stats()
assert s.zombies == 0 and s.active == 1, s
print("ok")
"""

HAZARD = """
import ctypes, mmap
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
addr = libc.mmap(None, 16384, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # PROT_NONE
print(ctypes.string_at(addr, 1))  # the process dies here
"""


def _run(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=120)


def test_touching_a_stale_view_does_not_crash():
    done = _run(STALE_VIEW)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_without_the_guard_a_stale_view_would_kill_the_process():
    done = _run(HAZARD)
    assert done.returncode == -11, (done.returncode, done.stderr)


def test_unmap_head_keeps_positions_and_drops_only_this_ranges_references():
    pool = make_pool(num_chunks=16)
    a = list(range(1, 6 * TPC + 1))
    pool.create("a")
    pool.extend("a", len(a))
    write_tokens(pool, "a", a, 0, len(a))
    pool.record("a", a[: 2 * TPC])  # the tree holds chunks 0 and 1
    vt = pool.active["a"]
    physical = pool.stats().physical_bytes
    assert vt.unmap_head(3) == 3 and vt.head == 3
    assert vt.chunks == [UNMAPPED] * 3 + [3, 4, 5] and vt.num_mapped == 3
    assert pool.chunks.ref[:6] == [1, 1, 0, 1, 1, 1]  # chunk 2: nobody's now
    assert pool.chunks.free >= {2} and pool.stats().mapped_bytes == 3 * C
    assert pool.stats().physical_bytes == physical  # unmapping gives nothing back ...
    assert pool.trim(idle_s=1e9) == C  # ... until the unreferenced chunk is punched
    assert pool.stats().physical_bytes == physical - C
    assert read_tokens(pool, "a", len(a)) == visible(a, len(a), 3 * TPC)  # zeros, no SIGSEGV
    assert chunk_tokens(pool, 0) == a[:TPC] and chunk_tokens(pool, 1) == a[TPC : 2 * TPC]
    assert vt.vmas() == 3  # head placeholder + one run + the PROT_NONE rest
    check_refs(pool)
    check_vmas(pool)
    assert vt.unmap_head(2) == 0 and vt.unmap_head(5) == 2 and vt.vmas() == 3
    pool.extend("a", 8 * TPC)  # the tail grows on, at its own positions
    write_tokens(pool, "a", a + [77] * 2 * TPC, 6 * TPC, 8 * TPC)
    assert read_tokens(pool, "a", 8 * TPC)[5 * TPC :] == a[5 * TPC :] + [77] * 2 * TPC
    check_refs(pool)
    check_vmas(pool)
    pool.close()


def test_unmap_head_of_everything_then_map_and_reuse():
    pool = make_pool(num_chunks=8)
    pool.create("a")
    pool.extend("a", 3 * TPC)
    view = pool.view("a")  # a live view: the tail placeholder must join the head's
    vt = pool.active["a"]
    vt.unmap(2)
    assert vt.unmap_head(5) == 2 and vt.num_mapped == 0 and vt.head == 2
    check_vmas(pool)
    assert int(view.sum()) == 0  # the stale view reads the placeholder
    pool.extend("a", 4 * TPC)  # maps at slots 2 and 3: positions kept
    assert vt.chunks[2:] != [UNMAPPED, UNMAPPED] and vt.num_mapped == 2
    check_vmas(pool)
    vt.unmap_head(3)
    vt.unmap(1)  # below the head: nothing of it is left, the range starts over
    assert vt.head == 0 and vt.chunks == [] and vt.need == 0
    check_refs(pool)
    check_vmas(pool)
    pool.extend("a", 3 * TPC)
    vt.unmap_head(1)  # released with a head: a reuse cannot keep its chunks in place
    pool.release("a")
    del view
    assert pool.create("b") == 0 and pool.active["b"] is vt  # reused: starts over at slot 0
    assert vt.head == 0 and vt.chunks == []
    pool.extend("b", TPC)
    assert len(vt.chunks) == 1
    check_refs(pool)
    check_vmas(pool)
    pool.close()


# ------------------------------------------------------------------ state machine

BASES = [[(5 * i + j) % 29 + 1 for j in range(8 * TPC)] for i in range(3)]


class VTensorBookkeeping(RuleBasedStateMachine):
    """Random interleavings of the scheduler operations, against the kernel's view."""

    @initialize(num_chunks=st.integers(4, 14), ahead=st.integers(0, 2))
    def setup(self, num_chunks, ahead):
        self.now = 0.0
        self.pool = make_pool(num_chunks=num_chunks, slots=8, clock=lambda: self.now, ahead=ahead)
        self.baseline = self.pool.backend.mappings
        self.reqs = {}  # rid -> [tokens, written, tokens unmapped at the head]
        self.held = []  # views kept past their request, as a careless engine might
        self.next_id = 0

    @precondition(lambda self: len(self.reqs) < 4)
    @rule(base=st.integers(0, 2), length=st.integers(1, 8 * TPC), fork=st.integers(0, 8 * TPC))
    def create(self, base, length, fork):
        tokens = list(BASES[base][:length])
        if fork < length:  # diverge from the shared base somewhere
            tokens[fork] = 100 + self.next_id
        rid = self.next_id
        self.next_id += 1
        matched = self.pool.create(rid, tokens)
        assert matched % TPC == 0 and matched <= length
        assert read_tokens(self.pool, rid, matched) == tokens[:matched]
        self.reqs[rid] = [tokens, matched, 0]

    def _snapshot(self):
        p = self.pool
        return (list(p.chunks.ref), set(p.chunks.free), p.backend.mappings,
                {r: list(vt.chunks) for r, vt in p.active.items()}, len(p.cached), len(p.tree))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 4 * TPC))
    def extend_and_write(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens, written, _ = self.reqs[rid]
        new = min(len(tokens), written + n)
        before = self._snapshot()
        try:
            self.pool.extend(rid, new)
        except OutOfPhysicalMemory:
            assert self._snapshot() == before
            return
        assert self.pool.mapped_tokens(rid) >= new
        write_tokens(self.pool, rid, tokens, written, new)
        self.reqs[rid][1] = new

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 4 * TPC))
    def extend_ahead(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        vt = self.pool.active[rid]
        need, free = vt.need, len(self.pool.chunks.free)
        got = self.pool.map_ahead(rid, self.reqs[rid][1] + n)
        assert 0 <= got <= free and vt.need == need  # a head start: not needed yet

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def record(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens, written, head = self.reqs[rid]
        got = self.pool.record(rid, tokens[:written])
        assert got % TPC == 0 and got <= written
        if head == 0:  # nothing unmapped: every whole chunk written is recorded
            assert got == written // TPC * TPC

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), hold=st.booleans())
    def release(self, data, hold):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens, written, head = self.reqs.pop(rid)
        assert read_tokens(self.pool, rid, written) == visible(tokens, written, head)
        if hold:
            self.held.append(self.pool.view(rid))
        self.pool.release(rid)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def unmap_head(self, data):
        """A sliding layer drops what left its window (or, at the edge, all it has)."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        vt, p = self.pool.active[rid], self.pool
        upto = data.draw(st.integers(0, len(vt.chunks)))
        ref, physical = list(p.chunks.ref), p.stats().physical_bytes
        gone = vt.chunks[vt.head:upto]
        assert vt.unmap_head(upto) == len(gone)
        for c in set(gone):
            assert p.chunks.ref[c] == ref[c] - gone.count(c)
            assert (c in p.chunks.free) == (p.chunks.ref[c] == 0)  # freed only when unreferenced
        assert p.stats().physical_bytes == physical  # memory goes only when punched
        tokens, written, head = self.reqs[rid]
        head = max(head, vt.head * TPC)
        # Tokens before the head are gone: writing resumes past them, like a sliding layer.
        self.reqs[rid] = [tokens, min(len(tokens), max(written, head)), head]
        assert read_tokens(p, rid, written) == visible(tokens, written, head)

    @rule(dt=st.sampled_from([0.0, 1.0, 5.0]), idle=st.sampled_from([0.0, 3.0, 100.0]))
    def trim(self, dt, idle):
        self.now += dt
        self.pool.trim(idle_s=idle)
        assert self.pool.chunks.dirty == set()
        s = self.pool.stats()
        assert s.physical_bytes <= s.referenced_bytes  # every unreferenced chunk was punched

    @precondition(lambda self: self.held)
    @rule()
    def drop_held_views(self):
        self.held.clear()  # reference counting frees them: no gc.collect() needed

    @invariant()
    def refs_match_holders(self):
        check_refs(self.pool)

    @invariant()
    def written_tokens_are_needed(self):
        for rid, (_, written, _) in self.reqs.items():
            vt = self.pool.active[rid]
            assert written <= vt.need * TPC and vt.need <= len(vt.chunks)

    @invariant()
    def kernel_agrees(self):
        """The VMA count is the kernel's, and every live view is backed: never PROT_NONE."""
        maps = vmas()
        check_vmas(self.pool, maps)
        for v in self.held:
            if v.numel() == 0:
                continue
            lo = v.data_ptr()
            backing = vmas_in(lo, lo + v.numel(), maps)
            assert backing and backing[0][0] <= lo and backing[-1][1] >= lo + v.numel()
            assert all(a[1] == b[0] for a, b in zip(backing, backing[1:]))  # no holes
            assert all(m[2].startswith("rw") for m in backing)

    @invariant()
    def views_show_the_reference(self):
        """Each request's view: zeros over the head, its tokens where written."""
        for rid, (tokens, written, head) in self.reqs.items():
            assert read_tokens(self.pool, rid, written) == visible(tokens, written, head)

    @invariant()
    def mappings_stay_bounded(self):
        """A range costs its chunk runs plus at most three: head, tail placeholder, PROT_NONE."""
        for vt in all_vtensors(self.pool):
            assert vt.vmas() <= len(vt._starts) + 3

    @invariant()
    def tree_chunks_hold_their_tokens(self):
        for node in self.pool.tree.nodes.values():
            assert tuple(chunk_tokens(self.pool, node.chunk)) == node.key[1]

    def teardown(self):
        pool = self.pool
        for rid in list(self.reqs):
            pool.release(rid)
        self.held.clear()
        pool.trim()
        s = pool.stats()
        assert s.mappings == self.baseline == 0 and memfd_vmas(pool) == 0
        assert s.physical_bytes == 0 and s.reserved_bytes == 0 and s.referenced_bytes == 0
        assert pool.chunks.free == set(range(pool.backend.num_chunks))
        pool.close()


TestVTensorBookkeeping = VTensorBookkeeping.TestCase
TestVTensorBookkeeping.settings = settings(
    max_examples=30, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
