"""The HTTP server: a FastAPI app over one AsyncLLMEngine, and `serve(args)` for `tessera serve`.

The engine steps on a thread apart from the event loop (in `tessera serve`, the
main thread, with uvicorn on its own thread), so the event loop here only parses,
streams and waits: a slow client never stalls decoding, and a
long step never stalls HTTP.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health (503 once the engine loop has died), GET /metrics (Prometheus),
and GET /v1/engine/stats, a JSON view of the scheduler's SchedulerStats plus
the number of HTTP requests in flight, for operators and tests that want to
see the KV cache drain.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.config import PROFILE_FIELDS, PROFILE_SETTINGS
from tessera.errors import TesseraError
from tessera.server.chat import create_chat_completion
from tessera.server.completions import create_completion
from tessera.server.errors import APIError, install_error_handlers, validation_error
from tessera.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from tessera.server.serving import CLIENT_CLOSED_REQUEST, LiveView, ServerMetrics, ServerState
from tessera.server.ui import install_ui

if TYPE_CHECKING:
    from tessera.engine.async_engine import AsyncLLMEngine

RequestModel = TypeVar("RequestModel", bound=BaseModel)

logger = logging.getLogger("tessera.server")
access_logger = logging.getLogger("tessera.server.access")

# Seconds open requests (e.g. long streams) may still run after Ctrl-C before they are ended with a 503.
GRACEFUL_SHUTDOWN_SECONDS = 5
# Largest request body read: a 4k-token prompt as text or ids is well under 1 MiB, a long chat
# history a few MiB; past this a client gets a 413 before the server buffers the rest.
MAX_REQUEST_BODY_BYTES = 16 * 2**20


class AccessLog:
    """One info line per HTTP request, written when its response has been sent (or abandoned):
    client, method, path, status, duration, and for generation requests the id and token counts."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: Optional[int] = None
        request_state: dict[str, Any] = scope.setdefault("state", {})
        server: Optional[ServerState] = getattr(scope["app"].state, "tessera", None) if "app" in scope else None

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        generating = scope["method"] == "POST" and scope["path"].startswith("/v1/")
        if server is not None and generating:
            server.active_requests += 1
        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            if server is not None and generating:
                server.active_requests -= 1
            client = scope.get("client")
            line = (f'{client[0] if client else "-"} "{scope["method"]} {scope["path"]}" '
                    f"{status if status is not None else 500} {(time.perf_counter() - start) * 1000:.1f}ms")
            if "request_id" in request_state:
                line += f" id={request_state['request_id']}"
            usage = request_state.get("usage")
            if usage is not None:
                line += f" prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}"
            if "outcome" in request_state:
                line += f" ({request_state['outcome']})"
            access_logger.info(line)


def _state(request: Request) -> ServerState:
    return request.app.state.tessera


async def _guarded(request: Request, handler: Awaitable[Response]) -> Response:
    """Every failure inside a handler becomes an OpenAI-style error response; the server stays up."""
    try:
        return await handler
    except APIError as exc:
        return exc.response()
    except Exception as exc:
        return _state(request).error(exc).response()


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The request body for /docs, since it is not a FastAPI parameter (see _add_request_schemas)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _add_request_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _parse_then(request: Request, model: type[RequestModel],
                      handler: Callable[[RequestModel, Request], Awaitable[Response]]) -> Response:
    if _state(request).draining:
        raise APIError(503, "The server is shutting down and takes no new requests.", type="server_error",
                       code="server_shutting_down", headers={"Retry-After": "5"})
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BODY_BYTES:
        raise _body_too_large()
    try:
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > MAX_REQUEST_BODY_BYTES:
                raise _body_too_large()
            parts.append(part)
        raw = b"".join(parts)
    except ClientDisconnect:
        request.state.outcome = "client disconnected while sending the body"
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    return await handler(body, request)


def _body_too_large() -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of {MAX_REQUEST_BODY_BYTES // 2**20} "
                         "MiB.", code="request_too_large")


def create_app(engine: AsyncLLMEngine, model_names: list[str], *, request_timeout: Optional[float] = None,
               metrics: Optional[ServerMetrics] = None, live: Optional[LiveView] = None, ui: bool = True) -> FastAPI:
    """The app for one engine; `model_names` are the names clients may ask for, the first is reported.
    `ui` adds the chat page (/) and the dashboard (/dashboard), which reads `live`."""
    if not model_names:
        raise ValueError("at least one served model name is needed")
    app = FastAPI(title="Tessera", summary="OpenAI-compatible LLM inference server",
                  docs_url="/docs", redoc_url=None)
    app.state.tessera = ServerState(engine=engine, model_names=list(model_names),
                                    request_timeout=request_timeout, metrics=metrics, live=live)
    install_error_handlers(app)
    app.add_middleware(AccessLog)

    # The bodies are parsed here rather than by FastAPI so that JSON is accepted whatever the
    # Content-Type (curl -d sends a form type) and every schema error is the same 400.
    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _guarded(request, _parse_then(request, CompletionRequest, create_completion))

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await _guarded(request, _parse_then(request, ChatCompletionRequest, create_chat_completion))

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        state = _state(request)
        root = state.engine.config.model
        max_len = state.engine.config.max_model_len
        return ModelList(data=[ModelCard(id=name, created=int(state.started), root=root, max_model_len=max_len)
                               for name in state.model_names])

    @app.get("/health")
    async def health(request: Request) -> Response:
        from tessera.engine.async_engine import EngineDeadError

        state = _state(request)
        if state.draining:
            return APIError(503, "The server is shutting down.", type="server_error",
                            code="server_shutting_down").response()
        try:
            state.engine.check_health()
        except EngineDeadError as exc:
            return state.error(exc).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        metrics = _state(request).metrics
        if metrics is None:
            return APIError(404, "Metrics are not enabled on this server.", code="metrics_disabled").response()
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/engine/stats")
    async def engine_stats(request: Request) -> Response:
        state = _state(request)
        engine = state.engine
        stats = engine.get_scheduler_stats()
        config = engine.config
        wait = engine.predicted_wait()
        return JSONResponse({"scheduler": dataclasses.asdict(stats),
                             "profile": {"name": config.profile, "overrides": list(config.profile_overrides),
                                         **{name: getattr(config, name) for name in PROFILE_FIELDS},
                                         "max_num_queued_requests": engine.max_num_queued_requests},
                             "step_cost_model": engine.cost_model_stats(),
                             "kv_cache": engine.kv_cache_info(),
                             "predicted_queue_wait_s": None if wait is None else round(wait, 4),
                             "server": {"active_requests": state.active_requests,
                                        "uptime_s": round(time.time() - state.started, 3)}})

    @app.get("/v1/engine/live")
    async def engine_live(request: Request, seconds: int = 120) -> Response:
        """The last `seconds` of per-second engine stats (at most the 300 kept) and the engine's
        settings: what the dashboard draws."""
        state = _state(request)
        if state.live is None:
            return APIError(404, "Live stats are not enabled on this server.", code="live_stats_disabled").response()
        if not 1 <= seconds <= 3600:
            raise APIError(400, "seconds must be between 1 and 3600.", param="seconds")
        snapshot = await asyncio.to_thread(state.live.snapshot, seconds)
        snapshot["model"] = state.model_name
        stats = state.engine.get_scheduler_stats()  # now, even when no step has run for a while
        snapshot["current"] = {"running": stats.num_running, "waiting": stats.num_waiting,
                               "swapped": stats.num_swapped, "kv_usage": round(stats.kv_cache_usage, 4),
                               "num_blocks_total": stats.num_blocks_total, "num_blocks_free": stats.num_blocks_free}
        return JSONResponse({"models": [snapshot], "settings": engine_settings(state.engine)})

    if ui:
        install_ui(app)
    _add_request_schemas(app, [CompletionRequest, ChatCompletionRequest])
    return app


def engine_settings(engine: AsyncLLMEngine) -> dict[str, Any]:
    """The settings a reader of the dashboard wants beside the charts."""
    config = engine.config
    spec = config.speculative_config
    kv = engine.kv_cache_info()
    return {"model": config.model, "profile": config.profile, "quantization": config.quantization, "kv_cache_dtype": kv["dtype"], "kv_cache_tokens": kv["tokens"],
            "max_model_len": config.max_model_len, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens, "target_itl_ms": config.target_itl_ms,
            "enable_prefix_caching": config.enable_prefix_caching, "preemption_mode": config.preemption_mode,
            "speculative": None if spec is None or spec.method is None else spec.method,
            "attention_backend": config.attention_backend, "num_threads": config.num_threads,
            "max_num_queued_requests": engine.max_num_queued_requests}


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tessera").setLevel(level.upper())


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain: on SIGTERM or Ctrl-C (`drain()`), new requests get 503 while the
    running ones finish, for up to `shutdown_timeout` seconds; then uvicorn shuts down and the
    requests still running are ended with a 503 / final error event, not cut mid-write."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.drain_deadline: Optional[float] = None

    def drain(self) -> None:
        """Stop taking requests (thread-safe); a second call stops at once."""
        if self.drain_deadline is not None:
            self.should_exit = True
            return
        logger.info("draining: new requests get 503; %d running request(s) have up to %gs to finish",
                    len(self.state.generations), self.shutdown_timeout)
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.shutdown_timeout

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit and (
                not self.state.generations or time.monotonic() >= self.drain_deadline):
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        async def end_stragglers() -> None:
            await asyncio.sleep(0 if self.drain_deadline is not None else GRACEFUL_SHUTDOWN_SECONDS)
            if self.state.generations:
                logger.info("ending %d request(s) still running at shutdown", len(self.state.generations))
            self.state.shut_down()

        stragglers = asyncio.create_task(end_stragglers())
        try:
            await super().shutdown(sockets)
        finally:
            stragglers.cancel()


def _bind(host: str, port: int) -> socket.socket:
    """Claim the address before the model loads, so a port in use fails in a second, not after loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise TesseraError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                           "pick another --port or --host") from None
    return sock


def serve(args: argparse.Namespace) -> int:
    """Build the engine from the `tessera serve` flags and serve HTTP until interrupted."""
    from tessera.engine.args import config_from_args
    from tessera.engine.async_engine import AsyncLLMEngine
    from tessera.observability import StatsConsumer, build_stat_loggers

    level = getattr(args, "log_level", "info") or "info"
    _configure_logging(level)
    config = config_from_args(args, args.model)
    name = args.served_model_name or args.model
    loggers = build_stat_loggers(name, max_model_len=config.max_model_len,
                                 max_num_batched_tokens=config.max_num_batched_tokens,
                                 otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", None),
                                 log_stats=not getattr(args, "disable_log_stats", False))
    sock = _bind(args.host, args.port)
    consumer = StatsConsumer(loggers.all())  # metrics and traces are built on its thread, off the engine loop
    try:
        # The engine loop runs on this (main) thread and HTTP on its own thread: torch's
        # OpenMP threads run a step markedly faster when driven from the main thread.
        queue = args.max_num_queued_requests
        if queue is None:
            queue = PROFILE_SETTINGS[config.profile].max_num_queued_requests
        logger.info("queue: up to %d waiting requests (%s), then HTTP 429", queue,
                    "flag" if args.max_num_queued_requests is not None else f"profile {config.profile}")
        engine = AsyncLLMEngine(config, max_num_queued_requests=queue, stats_sink=consumer, start_thread=False,
                                step_timeout=args.engine_step_timeout or None,
                                max_queue_wait=args.max_queue_wait)
        engine.warm_up()
        if loggers.prometheus is not None:
            loggers.prometheus.watch_predicted_wait(engine.predicted_wait)
        try:
            app = create_app(engine, [name], request_timeout=args.request_timeout, metrics=loggers.prometheus,
                             live=loggers.live, ui=getattr(args, "ui", True))
            # uvicorn's own timeout is the backstop: it cancels whatever our shutdown left running.
            config = uvicorn.Config(app, log_level=level, access_log=False,
                                    timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS + 5)
            server = DrainingServer(config, app.state.tessera, args.shutdown_timeout)
            host = f"[{args.host}]" if ":" in args.host else args.host
            logger.info("serving %s as %r on http://%s:%d", engine.config.model, name, host, args.port)
            http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="tessera-http")

            def stop_serving(*_: object) -> None:
                server.drain()

            signal.signal(signal.SIGTERM, stop_serving)
            http.start()
            try:
                engine.run_until(lambda: not http.is_alive())
            except KeyboardInterrupt:  # drain: keep stepping in-flight requests while HTTP shuts down
                logger.info("shutting down")
                stop_serving()
                engine.run_until(lambda: not http.is_alive())
        finally:
            engine.shutdown()
    finally:
        consumer.stop()
        sock.close()
    return 0
