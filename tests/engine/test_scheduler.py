"""Admission order when the memory core asks a request to wait."""

from kvserve.engine.request import Request, SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.memory import KVCacheManager, KVSpec, LayerKind

T = 4
FULL = KVSpec("full", LayerKind.FULL, 1, 8)


def _request(rid: str, n: int) -> Request:
    return Request(rid, None, [hash((rid, i)) % 1000 for i in range(n)], SamplingParams(), 0.0)


def _scheduler(defer: set[str]) -> Scheduler:
    kv = KVCacheManager([FULL], T * 8 * 64, tokens_per_page=T)
    asked = kv.can_start
    kv.can_start = lambda rid, n: rid not in defer and asked(rid, n)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)


def test_a_waiting_request_lets_the_ones_behind_it_go_first():
    sched = _scheduler(defer={"a"})
    for rid in "abc":
        sched.add(_request(rid, 8))
    batch, failed = sched.schedule()
    assert [s.request.request_id for s in batch] == ["b", "c"] and not failed
    assert [r.request_id for r in sched.waiting] == ["a"]
    assert "a" not in sched.kv.reqs  # its lookup was taken back: it holds nothing
    assert [r.seq for r in [*sched.running, *sched.waiting]] == [1, 2, 0]


def test_the_last_request_in_the_queue_starts_anyway():
    sched = _scheduler(defer={"a"})
    sched.add(_request("a", 8))
    batch, _ = sched.schedule()  # nothing behind it: waiting would idle the engine
    assert [s.request.request_id for s in batch] == ["a"]


def _shared(rid: str, doc: list[int], n: int) -> Request:
    tail = [hash((rid, i)) % 1000 for i in range(n)]
    return Request(rid, None, doc + tail, SamplingParams(), 0.0)


def test_a_request_waits_for_the_prefix_a_running_one_computes():
    kv = KVCacheManager([FULL], T * 8 * 64, tokens_per_page=T)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16)
    doc = list(range(40))  # a prefill of three 16-token steps
    sched.add(_shared("a", doc, 3))
    sched.add(_shared("b", doc, 5))  # last in the queue, yet it waits: "a" is not idle
    steps = []
    for _ in range(5):
        batch, _ = sched.schedule()
        sched.commit(batch)
        steps.append(batch)
        if any(s.request.request_id == "b" for s in batch):
            break
    assert [[s.request.request_id for s in b] for b in steps] == [["a"], ["a"], ["a", "b"]]
    # "b" started once what was left of the document was less than half its prompt
    assert steps[-1][1].request.num_cached_tokens == 32


def test_only_a_prefix_that_is_most_of_the_prompt_is_waited_for():
    kv = KVCacheManager([FULL], T * 8 * 64, tokens_per_page=T)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256)
    doc = list(range(16))
    sched.add(_shared("a", doc, 3))
    sched.add(_shared("b", doc, 40))  # shares 16 of 56 tokens: computing it costs little
    batch, _ = sched.schedule()
    assert [s.request.request_id for s in batch] == ["a", "b"]


def test_a_loop_miss_prefills_in_the_memory_cores_chunks():
    swa = KVSpec("swa", LayerKind.SLIDING, 1, 8, window=8)  # smaller steps lower its peak
    kv = KVCacheManager([FULL, swa], T * 8 * 128, tokens_per_page=T)
    kv.MISS_CHUNK = 12
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    looked_up = kv.lookup

    def lookup(rid):  # "a" is a loop member that lost its prefix (reuse_key's verdict)
        hit = looked_up(rid)
        kv.reqs[rid].loop = rid == "a"
        return hit

    kv.lookup = lookup
    sched.add(_request("a", 60))
    sizes = []
    for _ in range(5):
        batch, _ = sched.schedule()
        sched.commit(batch)
        sizes.append([s.num_tokens for s in batch])
    # Within a 64-token budget. 24 tokens at once after 36 would hold the window
    # before them and peak above 12 at a time; the last 12 are one chunk anyway.
    assert sizes == [[12]] * 5
    kv.abort("a")
    sched.running.clear()
    sched.add(_request("b", 30))
    batch, _ = sched.schedule()
    assert [s.num_tokens for s in batch] == [30]


def _loop_misses(kv: KVCacheManager, rids: set[str]) -> None:
    """Make these requests loop members that lost their prefix (reuse_key's verdict)."""
    looked_up = kv.lookup

    def lookup(rid):
        hit = looked_up(rid)
        kv.reqs[rid].loop = rid in rids
        return hit

    kv.lookup = lookup


def test_can_start_judges_a_loop_miss_by_its_whole_step_not_its_chunk():
    swa = KVSpec("swa", LayerKind.SLIDING, 1, 8, window=8)
    kv = KVCacheManager([FULL, swa], T * 8 * 128, tokens_per_page=T)
    kv.MISS_CHUNK = 12
    _loop_misses(kv, {"a"})
    asked, can_start = [], kv.can_start
    kv.can_start = lambda rid, n: asked.append((rid, n)) or can_start(rid, n)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    sched.add(_request("a", 60))
    sched.add(_request("b", 8))
    batch, _ = sched.schedule()
    assert asked[0] == ("a", 60)  # the step it would take, were no chunk limit there
    assert [s.num_tokens for s in batch] == [12, 8]


def _step(sched: Scheduler) -> list[str]:
    """One step; a request whose prompt completes samples a token."""
    batch, _ = sched.schedule()
    sched.commit(batch)
    for s in batch:
        if s.completes_prompt:
            s.request.token_ids.append(1)
    return [s.request.request_id for s in batch]


def test_a_loop_miss_last_in_the_queue_waits_while_another_prefills_only_without_room():
    swa = KVSpec("swa", LayerKind.SLIDING, 1, 8, window=8)
    for pages, expect in [(60, [["a"]] * 4 + [["a", "b"]]), (200, [["a", "b"]])]:
        kv = KVCacheManager([FULL, swa], T * 8 * pages, tokens_per_page=T)
        kv.MISS_CHUNK = 16  # "a" prefills 64 tokens in four steps
        _loop_misses(kv, {"a", "b"})
        sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
        sched.add(_request("a", 64))
        sched.add(_request("b", 64))
        # 60 pages: "a" holds 8, and the rest of both prompts peaks above the 52 left,
        # so "b" waits although nothing is behind it; 200: both fit side by side.
        steps = [_step(sched) for _ in expect]
        assert steps == expect


DOC = list(range(40))


def _cache_doc(sched: Scheduler) -> None:
    """A request that reads DOC runs to its first token and finishes: DOC is cached."""
    d = _shared("d", DOC, 3)
    sched.add(d)
    while d.num_computed < d.num_prompt:
        _step(sched)
    sched.finish(d)


def _queue(max_num_seqs: int, budget: int, cached: bool) -> Scheduler:
    """x and y (nothing cached) queued before q (the 40-token DOC and 5 more); with
    `cached`, DOC is cached first."""
    kv = KVCacheManager([FULL], T * 8 * 64, tokens_per_page=T)
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    if cached:
        _cache_doc(sched)
    for req in [_request("x", 12), _request("y", 12), _shared("q", DOC, 5)]:
        sched.add(req)
    return sched


def test_requests_whose_prefix_is_cached_go_first():
    sched = _queue(max_num_seqs=8, budget=16, cached=True)
    assert _step(sched) == ["q", "x"]  # q computes 5 tokens; "y" does not fit the step
    assert sched.running[0].num_cached_tokens == 40
    assert [r.request_id for r in sched.waiting] == ["y"]


def test_preempted_requests_first_and_arrival_order_where_nothing_is_cached():
    sched = _queue(max_num_seqs=2, budget=64, cached=True)
    back = _request("p", 8)
    back.admitted = True  # preempted: _preempt put it back first, and there it stays
    sched.waiting.appendleft(back)
    assert _step(sched) == ["p", "q"]
    sched = _queue(max_num_seqs=2, budget=64, cached=False)
    assert _step(sched) == ["x", "y"]


def test_a_request_that_more_than_lpm_max_others_passed_goes_by_arrival():
    kv = KVCacheManager([FULL], T * 8 * 64, tokens_per_page=T)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64)
    sched.LPM_MAX = 2
    _cache_doc(sched)
    sched.add(_request("x", 12))  # a miss, queued behind nothing
    started = []
    for i in range(4):  # a question on the cached document arrives at every step
        sched.add(_shared(f"q{i}", DOC, 5))
        started += _step(sched)
        sched.finish(sched.running[0])
    # Each question hit and went first, until three had started since x queued.
    assert started == ["q0", "q1", "q2", "x"]


def test_a_queued_prompt_is_hashed_once_however_long_it_waits(monkeypatch):
    """A waiting request is added to the memory core and taken back every step; its
    block hashes are the request's own, kept between steps, not computed again."""
    import kvserve.memory.manager as manager

    hashed, extend = [], manager.extend_block_hashes

    def counting(hashes: list[int], tokens, *args, **kwargs) -> None:
        n = len(hashes)
        extend(hashes, tokens, *args, **kwargs)
        hashed.append(len(hashes) - n)

    monkeypatch.setattr(manager, "extend_block_hashes", counting)
    kv = KVCacheManager([FULL], T * 8 * 64, tokens_per_page=T)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16)
    doc = list(range(40))
    a, b = _shared("a", doc, 3), _shared("b", doc, 5)
    sched.add(a)
    sched.add(b)  # waits two steps while "a" computes the document
    for _ in range(3):
        batch, _ = sched.schedule()
        sched.commit(batch)
    assert b.status.name == "RUNNING" and b.num_cached_tokens == 32
    assert kv.reqs["b"].hashes is b.block_hashes
    assert sum(hashed) == len(a.token_ids) // T + len(b.token_ids) // T  # each block once
