"""Hypothesis state machine over random interleavings of every spec kind.

Requests arrive over shared prefixes, and as next turns of finished
conversations (the Mamba spec's tails serve those). Pages carry fake
content: the token ids (and image signature) written into each slot, so a
reported prefix hit can be checked against the request's own tokens, and a
stale cache entry would show up as wrong content.
"""

import copy
import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from invariants import check_invariants, check_state_peak

from kvserve.memory import NO_PAGE, ImageInput, KVCacheManager, KVSpec, LayerKind
from kvserve.memory.baselines import policy_layout

T = 8
SPECS = [
    KVSpec("full", LayerKind.FULL, 2, 64),
    KVSpec("draft", LayerKind.FULL, 1, 32),
    KVSpec("swa", LayerKind.SLIDING, 3, 32, window=20),
    KVSpec("chunked", LayerKind.CHUNKED, 1, 64, chunk=32),
    KVSpec("mamba", LayerKind.MAMBA, 1, 1536, checkpoint_every=24),
    KVSpec("cross", LayerKind.CROSS, 2, 48),
    KVSpec("vision", LayerKind.VISION, 1, 16),
]
KIND = {i: s.kind for i, s in enumerate(SPECS)}
BASES = [[(7 * i + j) % 23 + 1 for j in range(90)] for i in range(3)]
IMAGES = ["img-a", "img-b"]


def snapshot(mgr: KVCacheManager):
    a = mgr.alloc
    specs = [
        (list(sp.ref), bytes(sp.state), list(sp.hash), dict(sp.cached),
         sorted(sp.holes), sp.n_idle_empty,
         sp.n_used, sp.n_evictable, sp.n_empty, sp.n_unused_large, sp.n_large)
        for sp in a.specs
    ]
    reqs = {k: (copy.deepcopy(r.tables), r.num_alloc, copy.deepcopy(r.pending))
            for k, r in mgr.reqs.items()}
    return specs, list(a.owner), list(a.used), list(a.emask), sorted(sum(a.free_large, [])), reqs


class MemoryCore(RuleBasedStateMachine):
    specs = SPECS

    @initialize(policy=st.sampled_from(["jenga", "jenga", "static", "max_page"]),
                large_pages=st.integers(8, 40), window_only=st.booleans(),
                tail=st.sampled_from([None, 16]), chats=st.booleans())
    def setup(self, policy, large_pages, window_only, tail, chats):
        probe = policy_layout(policy, SPECS, T)[0]
        self.begin(KVCacheManager(
            SPECS, probe.large_page_bytes * large_pages, tokens_per_page=T, policy=policy,
            window_only=window_only,
        ))
        self.window_only = window_only
        if tail is not None:  # a prompt end region shorter than the prompts: some of a
            self.mgr.reuse.PROMPT_TAIL = tail  # windowed spec's blocks serve no reuse point
        if chats:  # as after a conversation's next turn: answers' ends are kept from the start
            self.mgr.reuse.continued = 1

    def begin(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.window_only = False
        self.content = {}  # (spec, pid) -> {slot: identity}
        self.prompt_len = {}
        self.next_id = 0
        self.sequences = []  # finished requests' tokens and images: a next turn extends one

    # ------------------------------------------------------------ helpers

    def identity(self, r, pos):
        """What a text slot holds: the token and every image hashed into its chain."""
        end = (pos // T + 1) * T
        return (r.tokens[pos], tuple(im.content_hash for im in r.images if im.offset < end))

    def write(self, rid, lo, hi):
        """Play the model runner: fill the slots of positions [lo, hi). Under window_only
        a windowed spec may leave out keys no later step reads (before the window at hi);
        check_hit finds any hit that would need one."""
        r = self.mgr.reqs[rid]
        for s, spec in enumerate(self.specs):
            table = r.tables[s]
            if spec.kind in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED):
                read_later = self.mgr.managers[s].window_start(hi)
                for pos in range(lo, hi):
                    pid = table[pos // T]
                    if pid == NO_PAGE and self.window_only and pos < read_later:
                        continue
                    assert pid != NO_PAGE, f"{spec.name}: no page for position {pos}"
                    self.content.setdefault((s, pid), {})[pos % T] = self.identity(r, pos)
            elif spec.kind is LayerKind.MAMBA:
                for pos, pid in r.pending[s]:
                    if lo < pos <= hi:
                        self.content[(s, pid)] = tuple(self.identity(r, p) for p in range(pos))
            else:
                for i, _ in r.pending[s]:
                    im = r.images[i]
                    start = sum(-(-x.num_tokens // T) for x in r.images[:i])
                    for j in range(-(-im.num_tokens // T)):
                        self.content[(s, table[start + j])] = (im.content_hash, j)

    def check_hit(self, rid, hit):
        r = self.mgr.reqs[rid]
        for s, spec in enumerate(self.specs):
            table = r.tables[s]
            if spec.kind in (LayerKind.FULL, LayerKind.SLIDING, LayerKind.CHUNKED):
                first = self.mgr.managers[s].window_start(hit)
                for pos in range(first, hit):
                    got = self.content[(s, table[pos // T])].get(pos % T)
                    assert got == self.identity(r, pos), f"{spec.name} hit holds wrong KV"
            elif spec.kind is LayerKind.MAMBA and hit:
                # A grid checkpoint, or a finished turn's tail at its last full block.
                (pos, pid), = r.pending[s]
                assert pos == 0
                want = tuple(self.identity(r, p) for p in range(hit))
                assert self.content[(s, pid)] == want, "mamba checkpoint holds a wrong state"
            elif spec.kind in (LayerKind.CROSS, LayerKind.VISION):
                start = 0
                for im in r.images:
                    n = -(-im.num_tokens // T)
                    for j, pid in enumerate(table[start:start + n]):
                        if pid != NO_PAGE:
                            assert self.content[(s, pid)] == (im.content_hash, j)
                    start += n

    # -------------------------------------------------------------- rules

    @rule(base=st.integers(0, 2), keep=st.integers(0, 90),
          suffix=st.lists(st.integers(1, 5), max_size=30),
          image=st.one_of(st.none(), st.tuples(st.sampled_from(IMAGES), st.integers(0, 60),
                                               st.integers(3, 20))))
    def arrive(self, base, keep, suffix, image):
        tokens = BASES[base][:keep] + suffix
        if len(tokens) < 2:
            tokens += [9, 9]
        images = []
        if image is not None:
            h, off, n = image
            off = min(off, len(tokens) - 1)
            n = min(n, len(tokens) - off)
            images.append(ImageInput(h, off, n))
        self.start(tokens, images)

    @precondition(lambda self: self.sequences)
    @rule(pick=st.integers(0, 1 << 16), cut=st.integers(0, 3),
          suffix=st.lists(st.integers(1, 5), min_size=1, max_size=30))
    def next_turn(self, pick, cut, suffix):
        """A conversation goes on: a finished request's sequence (answer included, or a
        few tokens short of it, as a client's re-tokenized reply) with a new message."""
        seq, images = self.sequences[-1 - pick % len(self.sequences)]
        seq = seq[:len(seq) - cut]
        self.start(seq + suffix, [im for im in images if im.offset + im.num_tokens <= len(seq)])

    def start(self, tokens, images):
        rid = self.next_id
        self.next_id += 1
        self.mgr.add_request(rid, tokens, images)
        hit = self.mgr.lookup(rid)
        assert 0 <= hit < len(tokens) and hit % T == 0
        self.check_hit(rid, hit)
        self.prompt_len[rid] = len(tokens)

    @precondition(lambda self: self.mgr.reqs)
    @rule(pick=st.integers(0, 1 << 16), chunk=st.integers(1, 40), token=st.integers(1, 5))
    def step(self, pick, chunk, token):
        self.run(sorted(self.mgr.reqs)[pick % len(self.mgr.reqs)], chunk, token)

    @precondition(lambda self: self.mgr.reqs)
    @rule(pick=st.integers(0, 1 << 16), tokens=st.lists(st.integers(1, 5), min_size=2,
                                                        max_size=20))
    def answer(self, pick, tokens):
        """Decode steps of one request in a row (its prompt first, if need be): long
        answers take the tail's block boundaries that a next turn hits."""
        rid = sorted(self.mgr.reqs)[pick % len(self.mgr.reqs)]
        for token in tokens:
            if not self.run(rid, 40, token):
                return

    def run(self, rid, chunk, token):
        """One step of request rid: up to `chunk` prompt tokens, else one decoded token.
        False where it found no pages (and then nothing changed)."""
        mgr = self.mgr
        r = mgr.reqs[rid]
        mgr.begin_step()
        c = r.num_computed
        n = min(chunk, len(r.tokens) - c) if c < len(r.tokens) else 0
        if n == 0:  # decode: the last sampled token joins the sequence
            r.tokens.append(token)
            n = 1
        before = snapshot(mgr)
        if not mgr.allocate_slots(rid, n):
            assert snapshot(mgr) == before, "a failed allocation changed state"
            return False
        self.write(rid, c, c + n)
        mgr.advance(rid, n)
        return True

    @precondition(lambda self: self.mgr.reqs)
    @rule(pick=st.integers(0, 1 << 16))
    def go_lean(self, pick):
        """A request gives up what it keeps for its reuse points, for good (the
        scheduler's call for a request alone that is out of pages)."""
        rid = sorted(self.mgr.reqs)[pick % len(self.mgr.reqs)]
        lean = self.mgr.reqs[rid].lean
        assert self.mgr.go_lean(rid) == (not lean and self.mgr.reuse is not None)

    @precondition(lambda self: self.mgr.reqs)
    @rule(pick=st.integers(0, 1 << 16), abort=st.booleans())
    def finish(self, pick, abort):
        rid = sorted(self.mgr.reqs)[pick % len(self.mgr.reqs)]
        r = self.mgr.reqs[rid]
        if r.num_computed > r.prompt_len:
            self.sequences.append((list(r.tokens), list(r.images)))
        self.mgr.begin_step()
        (self.mgr.abort if abort else self.mgr.finish)(rid)
        assert rid not in self.mgr.reqs

    @rule(back=st.integers(0, 30))
    def idle(self, back):
        """Give back what idled `back` steps: cached large pages whose key is older go,
        the rest of the cache and every request's pages stay."""
        mgr, a = self.mgr, self.mgr.alloc
        before = mgr.now + 1 - back
        young = {(s, p) for s, sp in enumerate(a.specs) for p in range(len(sp.hash))
                 if sp.hash[p] is not None and (a.used[p // sp.k] or a.ltime[p // sp.k] >= before)}
        tables = {rid: copy.deepcopy(r.tables) for rid, r in mgr.reqs.items()}
        free = mgr.idle_pages(before)
        assert sorted(free) == sorted(sum(a.free_large, []))
        assert all(a.owner[lp] < 0 for lp in free)
        for lp, (s, u) in enumerate(zip(a.owner, a.used)):
            assert s < 0 or u or a.ltime[lp] >= before, "an idle large page stayed cached"
        kept = {(s, p) for s, sp in enumerate(a.specs) for p in range(len(sp.hash))
                if sp.hash[p] is not None}
        assert young <= kept, "a cached page used since `before` was evicted"
        assert {rid: r.tables for rid, r in mgr.reqs.items()} == tables

    # --------------------------------------------------------- invariants

    @invariant()
    def pages_are_consistent(self):
        check_invariants(self.mgr)

    @invariant()
    def windows_stay_bounded(self):
        for r in self.mgr.reqs.values():
            if r.num_alloc != r.num_computed:
                continue
            for s, spec in enumerate(self.specs):
                held = sum(1 for p in r.tables[s] if p != NO_PAGE)
                if spec.kind is LayerKind.SLIDING:
                    assert held <= math.ceil(spec.window / T) + 1
                if spec.kind is LayerKind.CHUNKED:
                    assert held <= spec.chunk // T + 1
                if spec.kind is LayerKind.MAMBA:
                    # the live state; and the tail once it passed a block past its prompt
                    assert held <= 1 + ((r.num_alloc // T) * T > r.prompt_len)

    @invariant()
    def a_lean_request_holds_nothing_for_reuse_points(self):
        for r in self.mgr.reqs.values():
            assert not (r.lean and any(r.held.values())), r.held

    @invariant()
    def state_pages_stay_within_the_peak(self):
        check_state_peak(self.mgr, 40)

    @invariant()
    def stats_add_up(self):
        st_ = self.mgr.stats()
        total = st_.free + sum(s.used + s.evictable + s.empty for s in st_.specs)
        assert total == self.mgr.pool_bytes
        assert st_.hit_tokens <= st_.queried_tokens


MemoryCore.TestCase.settings = settings(
    max_examples=120, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestMemoryCore = MemoryCore.TestCase
