"""The global scheduler's policies over fake members (no Ray, no engines)."""

import pytest

from kvserve.cluster.global_scheduler import GlobalScheduler, Member
from kvserve.cluster.instance import Heartbeat, InstanceInfo
from kvserve.cluster.prompt_tree import block_hashes

T = 4


def member(name, role="colocated", per_token=1000.0):
    return Member(InstanceInfo(name, role, T, 512, 300, "tiny", per_token, 500), None)


def sched(policy, n=3, **kw):
    s = GlobalScheduler(policy, **kw)
    for i in range(n):
        s.add(member(f"c{i}"))
    return s


def busy(s, name, k):
    for j in range(k):
        s.started(s.members[name], f"{name}-{j}", 100, 0)


def test_least_load_takes_the_fewest_in_flight():
    s = sched("least-load")
    busy(s, "c0", 2)
    busy(s, "c1", 1)
    assert s.choose("colocated", [], 10, 0)[0].name == "c2"
    busy(s, "c2", 3)
    assert s.choose("colocated", [], 10, 0)[0].name == "c1"


def test_sessions_stick_and_move_only_when_their_instance_goes():
    s = sched("session")
    first = {sid: s.choose("colocated", [], 10, 0, sid)[0].name for sid in "abcdefgh"}
    assert len(set(first.values())) > 1  # spread over the instances
    busy(s, first["a"], 5)
    assert s.choose("colocated", [], 10, 0, "a")[0].name == first["a"]  # load does not matter
    s.remove(first["a"])
    again = s.choose("colocated", [], 10, 0, "a")[0].name
    assert again != first["a"] and s.choose("colocated", [], 10, 0, "a")[0].name == again


def test_prompt_tree_takes_the_longest_cached_prefix_within_the_load_guard():
    s = sched("prompt-tree", imbalance=2)
    tokens = list(range(64))
    h = block_hashes(tokens, T)
    s.trees["colocated"].stored("c1", h[:10])
    s.trees["colocated"].stored("c2", h[:4])
    m, cached = s.choose("colocated", h, 64, 0)
    assert (m.name, cached) == ("c1", 10)
    busy(s, "c1", 3)  # 3 more in flight than the least loaded: past the guard
    m, cached = s.choose("colocated", h, 64, 0)
    assert (m.name, cached) == ("c2", 4)


def test_heartbeat_events_feed_the_tree_and_removal_clears_it():
    s = sched("prompt-tree")
    h = block_hashes(list(range(32)), T)
    s.heartbeat(Heartbeat("c0", 0, 0, stored={"device": h[:6], "host": h[6:]}))
    assert s.trees["colocated"].match(h, 0) == {"c0": 8}
    # a block gone from the device but kept in the host tier is still held
    s.heartbeat(Heartbeat("c0", 0, 0, removed={"device": h[:2]}, gone=[h[7]]))
    assert s.trees["colocated"].match(h, 0) == {"c0": 7}
    s.remove("c0")
    assert s.trees["colocated"].match(h, 0) == {}


def test_approximate_only_ignores_events_and_learns_with_a_ttl():
    s = sched("prompt-tree", events=False, ttl=5)
    tokens = list(range(32))
    s.heartbeat(Heartbeat("c0", 0, 0, stored={"device": block_hashes(tokens, T)}))
    assert s.trees["colocated"].match(block_hashes(tokens, T), 0) == {}
    s.learn(s.members["c1"], tokens, now=0)
    assert s.trees["colocated"].match(block_hashes(tokens, T), 4) == {"c1": 8}
    assert s.trees["colocated"].match(block_hashes(tokens, T), 5) == {}


@pytest.mark.parametrize("bandwidth, pulls", [(1e9, True), (1e3, False)])
def test_a_longer_prefix_elsewhere_is_pulled_only_when_moving_beats_recomputing(
        bandwidth, pulls):
    s = sched("prompt-tree", bandwidth=bandwidth, prefill_tokens_per_s=1000)
    tokens = list(range(400))
    h = block_hashes(tokens, T)
    s.trees["colocated"].stored("c0", h)
    busy(s, "c0", 9)  # the holder is too busy: another instance is chosen
    m, cached = s.choose("colocated", h, 400, 0)
    assert m.name != "c0" and cached == 0
    plan = s.plan_pull("colocated", m, h, 400, 0)
    # moving 100 blocks x 4 tokens x 1 kB: 0.4 ms at 1 GB/s (+5 ms) vs 0.4 s of prefill
    assert (plan is not None) == pulls
    if pulls:
        assert plan.source.name == "c0" and plan.blocks == 100


def test_unknown_policy_and_no_instance_are_clear_errors():
    with pytest.raises(ValueError, match="unknown policy"):
        GlobalScheduler("random")
    with pytest.raises(LookupError, match="no live decode instance"):
        sched("least-load").choose("decode", [], 1, 0)


def test_a_pull_waits_behind_the_transfers_queued_on_either_nic():
    s = sched("prompt-tree", bandwidth=1e9, prefill_tokens_per_s=1000)
    tokens = list(range(400))
    h = block_hashes(tokens, T)
    s.trees["colocated"].stored("c0", h)
    busy(s, "c0", 9)
    m, _ = s.choose("colocated", h, 400, 0)
    assert s.plan_pull("colocated", m, h, 400, 0) is not None  # idle NICs: it pays
    # 400 ms of recompute saved against a second of KV already queued out of c0
    s.transfer(s.members["c0"], m, int(1e9))
    assert s.plan_pull("colocated", m, h, 400, 0) is None
    s.transfer(s.members["c0"], m, -int(1e9))  # landed
    assert s.plan_pull("colocated", m, h, 400, 0) is not None


def test_an_instance_whose_nic_is_backed_up_is_chosen_last():
    s = sched("prompt-tree", bandwidth=1e9, prefill_tokens_per_s=1000)
    first, _ = s.choose("colocated", [], 100, 0)
    s.transfer(s.members["c2" if first.name != "c2" else "c1"], first, int(5e8))  # 0.5 s
    assert s.choose("colocated", [], 100, 0)[0].name != first.name
