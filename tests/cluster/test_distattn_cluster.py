"""Infinite-LLM on a local Ray cluster: three tiny instances with small pools serve a
prompt none of them holds alone, and survive a creditor dying mid-request."""

import asyncio

import pytest
from cluster_helpers import tiny_engine
from test_cluster import collect, greedy, stats

from kvserve.cluster.frontend import Cluster, InstanceSpec
from kvserve.cluster.global_scheduler import GlobalScheduler
from kvserve.engine.request import InvalidRequest

pytestmark = pytest.mark.slow

POOL = 160 << 10  # 80 pages of 2 KiB; a creditor lends at most 40 of them
LONG = [2] + [(7 * i + i * i) % 250 + 3 for i in range(299)]  # 300 tokens: 75 blocks + window


def small_engine():
    return tiny_engine(kv_memory=POOL)


def reference(prompt, n):
    e = tiny_engine()
    e.add_request("ref", {"prompt_token_ids": prompt}, greedy(n))
    while e.has_unfinished():
        for out in e.step():
            last = out
    return last.outputs[0].token_ids


@pytest.fixture(scope="module")
def trio(ray_runtime):
    c = Cluster(GlobalScheduler("least-load"), "colocated", heartbeat_timeout_s=5,
                dist_attention=True)
    c.launch([InstanceSpec(f"c{i}", "colocated", small_engine, 1) for i in range(3)])
    yield c
    c.shutdown()


def beats(c):
    async def poll():
        return await c._poll_all(lambda m: m.handle.poll.remote())
    return {hb.name: hb for hb in asyncio.run(poll())}


def test_one_pool_refuses_what_the_cluster_serves(ray_runtime, trio):
    alone = Cluster(GlobalScheduler("least-load"), "colocated")
    alone.launch([InstanceSpec("solo", "colocated", small_engine, 1)])
    try:
        with pytest.raises(InvalidRequest, match="more KV memory"):
            asyncio.run(collect(alone, LONG, 4, "solo"))
    finally:
        alone.shutdown()
    assert trio.max_prompt > len(LONG) > alone.max_prompt
    seen = {}

    async def look(out):  # mid-request: the gManager's placement map from heartbeats
        if len(out.outputs[0].token_ids) == 2:
            await trio.beat()
            seen.update(placement=trio.gmanager.placement("long"),
                        debtor=trio.gmanager.debtor("long"),
                        serving=[m.name for m in trio.scheduler.members.values() if m.pending])
    out = asyncio.run(collect(trio, LONG, 12, "long", look))[-1]
    # Its KV sat on its own instance (the debtor) and at least one other.
    assert seen["debtor"] == seen["serving"][0] and len(seen["placement"]) >= 2
    assert sum(seen["placement"].values()) >= len(LONG) // 4 - 1
    assert out.outputs[0].token_ids == reference(LONG, 12)
    asyncio.run(trio.beat())  # the gManager hears that the request left
    hbs = beats(trio)
    assert sum(hb.lent_out_bytes for hb in hbs.values()) > 0  # its KV was spread
    # Every shard was dropped, every page is free again, on every instance; the
    # placement map, fed those heartbeats, agrees.
    assert all(hb.lent == {} for hb in hbs.values())
    assert trio.gmanager.placement("long") == {} and trio.gmanager.debtor("long") is None
    assert all(s.used == 0 for s in stats(trio).values())


def test_a_creditor_dying_mid_request_loses_nothing(ray_runtime, trio):
    import ray

    killed = []

    async def kill_creditor(out):
        if len(out.outputs[0].token_ids) == 3 and not killed:
            hbs = await trio._poll_all(lambda m: m.handle.poll.remote())
            creditor = next(hb.name for hb in hbs if hb.lent)
            killed.append(creditor)
            ray.kill(trio.scheduler.members[creditor].handle)

    outs = asyncio.run(collect(trio, LONG, 10, "k", kill_creditor))
    assert killed and killed[0] in trio.lost
    assert outs[-1].outputs[0].token_ids == reference(LONG, 10)  # recomputed, lent again
    assert sum(len(o.new_token_ids) for o in outs) == 10  # the stream repeated nothing
    hbs = beats(trio)
    assert all(hb.lent == {} for hb in hbs.values())
    assert all(s.used == 0 for s in stats(trio).values())


def test_the_openai_endpoints_serve_a_prompt_beyond_one_pool(trio):
    import httpx
    import openai
    from server_harness import serving

    from kvserve.cluster.metrics import ClusterCollector
    from kvserve.server.app import serve_app
    from kvserve.server.metrics import ServerMetrics

    metrics = ServerMetrics(ClusterCollector(trio))
    trio.metrics = metrics
    try:
        with serving(serve_app(trio, metrics, "tiny")) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            stream = client.completions.create(model="tiny", prompt=LONG, max_tokens=8,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            text = "".join(c.choices[0].text for c in stream if c.choices)
            e = tiny_engine()
            e.add_request("ref", {"prompt_token_ids": LONG}, greedy(8))
            while e.has_unfinished():
                for out in e.step():
                    want = out.outputs[0].text
            assert text == want
            asyncio.run(trio.beat())  # the heartbeat carries what was lent
            body = httpx.get(f"{url}/metrics").text
            lent = [line for line in body.splitlines()
                    if line.startswith("kvserve_distattn_lent_bytes_total{")]
            assert len(lent) == len(trio.scheduler.members)
            assert sum(float(line.split()[-1]) for line in lent) > 0
            # Beyond what the cluster holds (and within the context length): refused.
            assert trio.max_prompt + 1 < 511
            too_long = httpx.post(f"{url}/v1/completions", json={
                "prompt": (LONG * 2)[:trio.max_prompt + 1], "max_tokens": 2})
            assert too_long.status_code == 400 and "KV memory" in too_long.text
    finally:
        trio.metrics = None
