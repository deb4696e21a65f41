"""A kvserve cluster on a local Ray runtime: tiny seeded instances as actors.

One prefill + one decode instance serve every disaggregated design (the design
is the front end's choice), two colocated instances the rest; instance actors
are started once per module.
"""

import asyncio
import dataclasses
import time

import httpx
import openai
import pytest
from cluster_helpers import tiny_engine
from server_harness import serving

from kvserve.cluster.cli import add_admin_routes
from kvserve.cluster.disagg import DESIGNS, design
from kvserve.cluster.frontend import Cluster, InstanceSpec
from kvserve.cluster.global_scheduler import GlobalScheduler
from kvserve.cluster.metrics import ClusterCollector
from kvserve.cluster.prompt_tree import block_hashes
from kvserve.engine.request import InvalidRequest, SamplingParams
from kvserve.server.app import serve_app
from kvserve.server.engine_loop import Submission
from kvserve.server.metrics import ServerMetrics

pytestmark = pytest.mark.slow


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def prompt_of(seed, n=46):
    return [2] + [(seed * 31 + 7 * i) % 250 + 3 for i in range(n - 1)]


def reference(prompt, n, text=False):
    """One in-process instance's greedy output ids (or text) for prompt."""
    e = tiny_engine()
    e.add_request("ref", prompt if text else {"prompt_token_ids": prompt}, greedy(n))
    while e.has_unfinished():
        for out in e.step():
            last = out
    return last.outputs[0].text if text else last.outputs[0].token_ids


def make(ray_runtime, design_name, roles):
    c = Cluster(GlobalScheduler("prompt-tree"), design_name, heartbeat_timeout_s=5)
    c.launch([InstanceSpec(f"{r[0]}{i}", r, tiny_engine, 1) for i, r in enumerate(roles)])
    return c


@pytest.fixture(scope="module")
def pd(ray_runtime):
    c = make(ray_runtime, "pd-caching-3", ["prefill", "decode"])
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def colo(ray_runtime):
    c = make(ray_runtime, "colocated", ["colocated", "colocated"])
    yield c
    c.shutdown()


async def collect(c, prompt, n, rid="r", on_output=None):
    group = await c.add([Submission(rid, prompt, None, greedy(n))], time.monotonic())
    outs = []
    async for _, out in group.outputs():
        outs.append(out)
        if on_output is not None:
            await on_output(out)
    await c.drain()
    return outs


def finish(c, prompt, n, rid="r"):
    return asyncio.run(collect(c, prompt, n, rid))[-1]


def stats(c):
    return {name: snap.kv for name, (_, snap) in asyncio.run(c.snapshot()).items()}


@pytest.mark.parametrize("name", sorted(DESIGNS))
def test_every_design_gives_one_instances_greedy_tokens(pd, colo, name):
    c = colo if name == "colocated" else pd
    c.design = design(name)
    prompt = prompt_of(len(name))
    out = finish(c, prompt, 12, f"eq-{name}")
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == reference(prompt, 12)
    assert all(s.used == 0 for s in stats(c).values())  # nothing held after the request
    if name == "pd-basic":  # caches nothing on either side
        assert all(s.evictable == 0 for s in stats(c).values())


def test_a_second_turn_hits_the_kv_decode_returned_to_prefill(pd):
    pd.design = design("pd-caching-3")
    turn1 = prompt_of(50)
    out1 = finish(pd, turn1, 12, "t1")
    turn2 = turn1 + out1.outputs[0].token_ids + [40, 41, 42, 43, 44]
    out2 = finish(pd, turn2, 4, "t2")
    # every full block of turn 1 (prompt and answer) was a hit at the prefill instance
    assert out2.num_cached_tokens == (len(turn1) + 12 - 1) // 4 * 4
    assert out2.outputs[0].token_ids == reference(turn2, 4)


def test_without_the_return_a_second_turn_hits_only_its_prompt(pd):
    pd.design = design("pd-caching-2")
    turn1 = prompt_of(51)
    out1 = finish(pd, turn1, 12, "u1")
    out2 = finish(pd, turn1 + out1.outputs[0].token_ids + [40, 41], 4, "u2")
    assert out2.num_cached_tokens == len(turn1) // 4 * 4


def test_decode_side_caching_sends_only_the_blocks_decode_lacks(pd):
    pd.design = design("pd-caching-2")
    prompt = prompt_of(52)
    asyncio.run(pd.beat())
    p, d = pd.scheduler.of_role("prefill")[0], pd.scheduler.of_role("decode")[0]
    finish(pd, prompt, 4, "v1")
    asyncio.run(pd.beat())
    first = d.received_bytes
    finish(pd, prompt + [9], 4, "v2")  # the same prompt blocks: decode holds them
    asyncio.run(pd.beat())
    assert first > 0 and d.received_bytes - first < first / 5
    assert p.sent_bytes == d.received_bytes


def test_kv_events_make_the_prefill_tree_exact(pd):
    pd.design = design("pd-caching-1")
    prompt = prompt_of(53)
    finish(pd, prompt, 2, "w1")
    asyncio.run(pd.beat())
    hashes = block_hashes(prompt, 4)
    assert pd.scheduler.trees["prefill"].match(hashes, time.monotonic()) == {"p0": len(hashes)}


def test_bad_input_is_refused_before_any_instance_is_touched(pd):
    for bad, match in (([], "empty"), ([5, 400], "unknown token"),
                       ([3] * 600, "at most")):
        with pytest.raises(InvalidRequest, match=match):
            asyncio.run(collect(pd, bad, 2, "bad"))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        asyncio.run(pd.add([Submission("x", [3, 4], None, SamplingParams(max_tokens=0))],
                           0.0))


def test_a_busy_holder_lends_its_prefix_to_the_instance_chosen(colo):
    """Prompt-tree routing with Eq. 2: the holder of the prefix is past the load guard,
    so another instance serves, after pulling the prefix (a hit, the same tokens)."""
    colo.design = design("colocated")
    prompt = prompt_of(90, n=120)
    finish(colo, prompt[:100], 2, "seed")
    asyncio.run(colo.beat())
    holder = colo.scheduler.trees["colocated"].match(
        block_hashes(prompt, 4), time.monotonic())
    assert len(holder) == 1
    busy = colo.scheduler.members[next(iter(holder))]
    busy.pending.update({f"b{i}": (1, 1.0) for i in range(9)})
    try:
        out = finish(colo, prompt, 6, "pulled")
    finally:
        busy.pending.clear()
    assert out.num_cached_tokens == 100
    assert out.outputs[0].token_ids == reference(prompt, 6)
    asyncio.run(colo.beat())
    other = [m for m in colo.scheduler.members.values() if m is not busy][0]
    assert other.received_bytes > 0 and busy.sent_bytes >= other.received_bytes


def test_killing_an_instance_mid_stream_loses_no_request(ray_runtime, colo):
    import ray

    colo.design = design("colocated")
    prompt = prompt_of(60)
    killed = []

    async def kill_once(out):
        if len(out.outputs[0].token_ids) == 5 and not killed:
            serving = [m for m in colo.scheduler.members.values() if m.pending]
            killed.append(serving[0].name)
            ray.kill(serving[0].handle)

    outs = asyncio.run(collect(colo, prompt, 40, "k", kill_once))
    assert killed and colo.lost == killed and killed[0] not in colo.scheduler.members
    final = outs[-1]
    assert final.outputs[0].token_ids == reference(prompt, 40)  # continued, recomputed
    assert sum(len(o.new_token_ids) for o in outs) == 40  # the stream repeated nothing
    assert [s.used for s in stats(colo).values()] == [0]
    # an instance added while serving takes requests
    new = asyncio.run(colo.add_instance(InstanceSpec("c9", "colocated", tiny_engine, 1)))
    new.pending["busy"] = (1, 0.0)
    try:
        for m in colo.scheduler.members.values():  # the survivor is busier: c9 is chosen
            if m is not new:
                m.pending.update({f"b{i}": (1000, 0.0) for i in range(9)})
        out = finish(colo, prompt_of(61), 6, "after")
        assert out.outputs[0].token_ids == reference(prompt_of(61), 6)
    finally:
        for m in colo.scheduler.members.values():
            m.pending.clear()


def test_the_openai_client_streams_from_the_cluster_and_metrics_label_instances(pd):
    pd.design = design("pd-caching-3")
    metrics = ServerMetrics(ClusterCollector(pd))
    pd.metrics = metrics
    app = serve_app(pd, metrics, "tiny")
    add_admin_routes(app, pd, tiny_engine, 1)
    with serving(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        text = "the quick brown fox jumps over the lazy dog"
        stream = client.completions.create(model="tiny", prompt=text, max_tokens=10,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [c.choices[0].text for c in stream if c.choices]
        assert len(chunks) > 1 and "".join(chunks) == reference(text, 10, text=True)
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": [3, 999], "max_tokens": 2})
        assert bad.status_code == 400 and "unknown token" in bad.text
        body = httpx.get(f"{url}/metrics").text
        assert 'kvserve_num_requests_running{instance="p0",role="prefill"}' in body
        assert "kvserve_cluster_prefix_cache_queried_tokens_total" in body
        assert 'kvserve_kv_transfer_bytes_total{direction="received",instance="d1"}' in body
        assert "kvserve_time_to_first_token_seconds_count" in body
        assert httpx.get(f"{url}/health").status_code == 200
        listed = httpx.get(f"{url}/cluster/instances").json()["data"]
        assert {(i["name"], i["role"]) for i in listed} == {("p0", "prefill"), ("d1", "decode")}
        refused = httpx.post(f"{url}/cluster/instances", json={"role": "bogus"})
        assert refused.status_code == 400 and "unknown role" in refused.text
    pd.metrics = None


def test_a_client_that_leaves_mid_stream_frees_its_pages(pd):
    pd.design = design("pd-caching-3")

    async def leave():
        group = await pd.add([Submission("gone", prompt_of(70), None, greedy(400))],
                             time.monotonic())
        async for _, out in group.outputs():
            if len(out.outputs[0].token_ids) >= 3:
                break  # closes the group: aborts the request
        await pd.drain()
    asyncio.run(leave())
    deadline = time.monotonic() + 10
    while any(s.used for s in stats(pd).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(s.used == 0 for s in stats(pd).values())


def test_designs_are_named_and_roles_checked(ray_runtime):
    with pytest.raises(ValueError, match="unknown design"):
        design("pd-caching-9")
    c = Cluster(GlobalScheduler(), "pd-basic")
    with pytest.raises(ValueError, match="needs instances of roles"):
        c.launch([InstanceSpec("x", "colocated", tiny_engine)])
    assert dataclasses.asdict(DESIGNS["pd-caching-3"])["return_to_prefill"]


def test_an_idle_instance_that_dies_is_found_by_the_heartbeat(ray_runtime, colo):
    import ray

    m = asyncio.run(colo.add_instance(InstanceSpec("c8", "colocated", tiny_engine, 1)))
    prompt = prompt_of(80)
    colo.scheduler.learn(m, prompt, time.monotonic())
    hashes = block_hashes(prompt, 4)
    assert "c8" in colo.scheduler.trees["colocated"].match(hashes, time.monotonic())
    ray.kill(m.handle)
    asyncio.run(colo.beat())
    assert "c8" in colo.lost and "c8" not in colo.scheduler.members
    assert "c8" not in colo.scheduler.trees["colocated"].match(hashes, time.monotonic())
    assert finish(colo, prompt, 3, "still").finished  # the others serve on


def test_a_decode_instance_dying_mid_stream_hands_over_to_another(ray_runtime, pd):
    import ray

    pd.design = design("pd-caching-3")
    asyncio.run(pd.add_instance(InstanceSpec("d2", "decode", tiny_engine, 1)))
    prompt = prompt_of(95)
    killed = []

    async def kill_decode(out):
        if len(out.outputs[0].token_ids) == 6 and not killed:
            decoding = [m for m in pd.scheduler.of_role("decode") if m.pending]
            killed.append(decoding[0].name)
            ray.kill(decoding[0].handle)

    outs = asyncio.run(collect(pd, prompt, 30, "pk", kill_decode))
    assert killed and killed[0] in pd.lost and len(pd.scheduler.of_role("decode")) == 1
    assert outs[-1].outputs[0].token_ids == reference(prompt, 30)
    assert sum(len(o.new_token_ids) for o in outs) == 30
    assert all(s.used == 0 for s in stats(pd).values())
