"""`kvserve cluster serve`: N engine instances as Ray actors behind one OpenAI server.

    kvserve cluster serve --instances 2                  # colocated, prompt-tree routing
    kvserve cluster serve --instances 3 --kv-memory 64M  # prompts beyond one pool: DistAttention
    kvserve cluster serve --prefill 1 --decode 1         # pd-caching-3 by default
    kvserve cluster serve --prefill 1 --decode 1 --design pd-basic --policy least-load

Starts a local Ray runtime (or joins one: --address), one actor per instance,
each loading the model itself, and the FastAPI front end (the same routes,
streaming, errors as `kvserve serve`; /metrics per instance and in total;
POST /cluster/instances {"role": ...} adds an instance while serving).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from typing import Any

from kvserve.cluster.disagg import DESIGNS
from kvserve.cluster.global_scheduler import POLICIES
from kvserve.cluster.instance import ROLES
from kvserve.entrypoints.model_args import model_config

log = logging.getLogger("kvserve.cluster")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster_cmd", required=True)
    p = sub.add_parser("serve", help="serve a cluster of instances behind one OpenAI API")
    from kvserve.server.app import add_arguments as add_server_arguments

    add_server_arguments(p)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--instances", type=int, default=None,
                      help="colocated instances (default 2 when no --prefill/--decode)")
    size.add_argument("--prefill", type=int, default=None, help="prefill-only instances")
    p.add_argument("--decode", type=int, default=None, help="decode-only instances")
    p.add_argument("--design", choices=sorted(DESIGNS), default=None,
                   help="MemServe Table 4 design (default: colocated, or pd-caching-3 with "
                        "--prefill/--decode)")
    p.add_argument("--policy", choices=POLICIES, default="prompt-tree",
                   help="global scheduling policy (MemServe Table 6)")
    p.add_argument("--address", default=None,
                   help="join this Ray cluster instead of starting a local runtime")
    p.add_argument("--threads-per-instance", type=int, default=None,
                   help="torch threads of each instance (default: the cores over the "
                        "instances, at least 1)")
    p.add_argument("--prompt-tree-ttl", type=float, default=120.0,
                   help="seconds a prefix learnt from routing stays in the global prompt tree")
    p.add_argument("--no-dist-attention", action="store_true",
                   help="colocated instances: refuse prompts longer than one pool instead of "
                        "spreading their full-attention KV over the others (Infinite-LLM)")
    p.add_argument("--no-kv-events", action="store_true",
                   help="approximate prompt trees only (learnt from routing, with the TTL); "
                        "by default the instances' KV events keep them exact")


def layout(args: argparse.Namespace) -> tuple[str, list[tuple[str, str]]]:
    """The design and (name, role) of every instance the options ask for."""
    if args.prefill is not None or args.decode is not None:
        if not args.prefill or not args.decode:
            raise SystemExit("--prefill and --decode go together, each >= 1")
        design = args.design or "pd-caching-3"
        if not DESIGNS[design].disaggregated:
            raise SystemExit(f"--design {design} takes --instances, not --prefill/--decode")
        roles = [("prefill", args.prefill), ("decode", args.decode)]
    else:
        design = args.design or "colocated"
        if DESIGNS[design].disaggregated:
            raise SystemExit(f"--design {design} needs --prefill and --decode")
        n = args.instances if args.instances is not None else 2
        if n < 1:
            raise SystemExit("--instances must be >= 1")
        roles = [("colocated", n)]
    names = [(f"{role[0]}{i}", role) for role, n in roles for i in range(n)]
    return design, names


def main(args: argparse.Namespace) -> None:
    import ray
    import uvicorn

    from kvserve.cluster.frontend import Cluster, InstanceSpec
    from kvserve.cluster.global_scheduler import GlobalScheduler
    from kvserve.cluster.metrics import ClusterCollector
    from kvserve.engine.engine import LLMEngine
    from kvserve.server.app import serve_app, served_model_name
    from kvserve.server.metrics import ServerMetrics

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    design, names = layout(args)
    threads = args.threads_per_instance or max(1, (os.cpu_count() or 1) // len(names))
    build = functools.partial(LLMEngine.load, model_config(
        args, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching))
    ray.init(address=args.address, include_dashboard=False)
    # DistAttention spreads a request over colocated instances; a disaggregated request
    # moves its whole prompt's KV from P to D, which does not yet carry lent blocks.
    spread = not args.no_dist_attention and not DESIGNS[design].disaggregated
    cluster = Cluster(GlobalScheduler(args.policy, ttl=args.prompt_tree_ttl,
                                      events=not args.no_kv_events), design,
                      dist_attention=spread)
    try:
        cluster.launch([InstanceSpec(name, role, build, threads) for name, role in names])
        metrics = ServerMetrics(ClusterCollector(cluster))
        cluster.metrics = metrics
        app = serve_app(cluster, metrics, served_model_name(args))
        add_admin_routes(app, cluster, build, threads)
        log.info("cluster of %d instances (%s, %s routing) on http://%s:%d", len(names),
                 design, args.policy, args.host, args.port)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        cluster.shutdown()
        ray.shutdown()


def add_admin_routes(app: Any, cluster: Any, build: Any, threads: int) -> None:
    from fastapi import Body

    from kvserve.cluster.frontend import InstanceSpec
    from kvserve.server.errors import APIError

    @app.post("/cluster/instances")
    async def add_instance(role: str = Body(..., embed=True)) -> dict[str, Any]:
        if role not in ROLES:
            raise APIError(400, f"unknown role {role!r}; choose from {list(ROLES)}",
                           param="role")
        name = f"{role[0]}{len(cluster.scheduler.members) + len(cluster.lost)}"
        member = await cluster.add_instance(InstanceSpec(name, role, build, threads))
        return {"name": member.name, "role": role}

    @app.get("/cluster/instances")
    async def instances() -> dict[str, Any]:
        return {"data": [{"name": m.name, "role": m.info.role, "in_flight": m.load}
                         for m in cluster.scheduler.members.values()],
                "lost": list(cluster.lost)}
