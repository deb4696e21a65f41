"""`kvserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /tokenize, GET /health, GET /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve.entrypoints.model_args import add_model_arguments, model_config
from kvserve.server import protocol as p
from kvserve.server.engine_loop import EngineFailure, EngineLoop
from kvserve.server.errors import (
    APIError,
    error_response,
    error_responses,
    install_error_handlers,
)
from kvserve.server.metrics import EngineSnapshot, ServerMetrics
from kvserve.server.serving import ClientGone, OpenAIServing

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine

log = logging.getLogger("kvserve.server")

DEFAULT_MODEL_NAME = "gemma-3-270m"
SNAPSHOT_TIMEOUT_S = 30.0  # a scrape waits at most this long for the step in progress


def build_app(engine: LLMEngine, model_name: str = DEFAULT_MODEL_NAME) -> FastAPI:
    """The app around `engine`; its engine thread runs while the app's lifespan does."""
    metrics = ServerMetrics()
    return serve_app(EngineLoop(engine, metrics), metrics, model_name)


def serve_app(engine_loop: EngineLoop, metrics: ServerMetrics,
              model_name: str = DEFAULT_MODEL_NAME) -> FastAPI:
    """The OpenAI app over anything with EngineLoop's interface: one engine's loop, or a
    cluster's front end (cluster/frontend.py), which runs while the lifespan does."""
    serving = OpenAIServing(engine_loop, model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.stop()
            serving.close()

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.engine_loop, app.state.serving, app.state.metrics = engine_loop, serving, metrics
    install_error_handlers(app)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    _add_openai_routes(app, serving)
    _add_ops_routes(app, engine_loop, metrics)
    return app


def _add_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return serving.models()

    @app.get("/v1/models/{model:path}", responses=error_responses(404))
    async def model(model: str) -> dict[str, Any]:
        serving.check_model(model)
        return serving.model_card()

    @app.post("/v1/completions", responses=error_responses(400, 404, 503))
    async def completions(body: p.CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions", responses=error_responses(400, 404, 503))
    async def chat(body: p.ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    @app.post("/tokenize", responses=error_responses(400, 404))
    async def tokenize(body: p.TokenizeRequest) -> dict[str, Any]:
        return await serving.tokenize(body)


def _add_ops_routes(app: FastAPI, engine_loop: EngineLoop, metrics: ServerMetrics) -> None:
    @app.get("/health", responses=error_responses(503))
    async def health() -> Response:
        if not engine_loop.alive:
            return error_response(APIError(503, "the engine thread is not running"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response, responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}},
              "description": "Prometheus text exposition format"}})
    async def prometheus() -> Response:
        snapshot: EngineSnapshot | None = None
        try:
            snapshot = await asyncio.wait_for(engine_loop.snapshot(), SNAPSHOT_TIMEOUT_S)
        except (EngineFailure, asyncio.TimeoutError):
            log.warning("/metrics without engine figures: the engine did not answer")
        return Response(metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)


# ------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--served-model-name", default=None,
                        help="name clients use in 'model' (default: gemma-3-270m for the "
                             "default model, else the file or directory name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context length limit (default: the model's)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="disable automatic prefix caching")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return Path(args.model).name if args.model else DEFAULT_MODEL_NAME


def main(args: argparse.Namespace) -> None:
    import uvicorn

    from kvserve.engine.engine import LLMEngine

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLMEngine.load(model_config(
        args, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching))
    name = served_model_name(args)
    log.info("serving %s (%s, weights %s, max_model_len %d, KV pool %.0f MiB) on "
             "http://%s:%d", name, str(engine.model.dtype).removeprefix("torch."),
             engine.model.quantization, engine.max_model_len, engine.kv.pool_bytes / 2**20,
             args.host, args.port)
    uvicorn.run(build_app(engine, name), host=args.host, port=args.port,
                log_level=args.log_level)
