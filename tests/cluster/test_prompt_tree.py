"""Global prompt trees: exact entries from KV events, learnt ones with a TTL."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cluster.prompt_tree import PromptTree, block_hashes


def test_match_counts_each_instances_leading_blocks():
    t = PromptTree(ttl=10)
    a = block_hashes(list(range(40)), 4)  # 10 blocks
    b = block_hashes(list(range(20)) + [99] * 20, 4)  # shares 5 blocks with a
    t.stored("x", a)
    t.learn("y", b, now=0)
    assert t.match(a, now=1) == {"x": 10, "y": 5}
    assert t.match(b, now=1) == {"x": 5, "y": 10}
    assert t.match(block_hashes([7] * 8, 4), now=1) == {}


def test_learnt_entries_expire_event_entries_do_not():
    t = PromptTree(ttl=10)
    h = block_hashes(list(range(16)), 4)
    t.stored("x", h)
    t.learn("y", h, now=0)
    assert t.match(h, now=9.9) == {"x": 4, "y": 4}
    assert t.match(h, now=10) == {"x": 4}
    assert t.expire(now=10) == 4 and t.match(h, now=0) == {"x": 4}


def test_a_removed_middle_block_cuts_the_prefix_and_drop_forgets_an_instance():
    t = PromptTree()
    h = block_hashes(list(range(32)), 4)
    t.stored("x", h)
    t.stored("y", h)
    t.removed("x", [h[3]])
    assert t.match(h, now=0) == {"x": 3, "y": 8}
    t.drop("y")
    assert t.match(h, now=0) == {"x": 3}
    t.drop("x")
    assert len(t) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.sampled_from(["store", "remove", "drop"]),
                          st.integers(0, 3), st.integers(1, 6)), max_size=30),
       st.integers(0, 3), st.integers(1, 6))
def test_match_equals_a_brute_force_model(ops, probe, length):
    """Over random events, match() is: the longest run of leading blocks each instance holds."""
    prompts = [block_hashes([p] * 4 * 6, 4) for p in range(4)]
    t, held = PromptTree(), {i: set() for i in "abc"}
    for inst, op, p, n in ops:
        hs = prompts[p][:n]
        if op == "store":
            t.stored(inst, hs)
            held[inst] |= set(hs)
        elif op == "remove":
            t.removed(inst, hs[-1:])
            held[inst] -= set(hs[-1:])
        else:
            t.drop(inst)
            held[inst] = set()
    want = {}
    for inst, blocks in held.items():
        k = 0
        while k < length and prompts[probe][k] in blocks:
            k += 1
        if k:
            want[inst] = k
    assert t.match(prompts[probe][:length], now=0) == want
