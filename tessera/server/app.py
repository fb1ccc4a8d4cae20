"""The HTTP server: a FastAPI app over the served models, and `serve(spec)` for `tessera serve`.

The engine steps on a thread apart from the event loop (in `tessera serve`, the
main thread, with uvicorn on its own thread), so the event loop here only parses,
streams and waits: a slow client never stalls decoding, and a
long step never stalls HTTP.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (and GET,
DELETE, POST .../cancel of a stored response), POST /v1/messages (Anthropic's, and
/v1/messages/count_tokens), GET /v1/models,
GET /health (503 once the engine loop has died), GET /metrics (Prometheus),
and GET /v1/engine/stats, a JSON view of the scheduler's SchedulerStats plus
the number of HTTP requests in flight, for operators and tests that want to
see the KV cache drain. POST /tokenize and /detokenize (vLLM's, tokenize.py)
and Ollama's /api/* (ollama.py) are registered in one block of create_app.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, TypeVar, cast

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.config import PROFILE_FIELDS, PROFILE_SETTINGS
from tessera.errors import TesseraError
from tessera.server.auth import (CLIENT_REQUEST_ID, AccessControl, AccessSettings, describe_access, is_loopback,
                                 request_key)
from tessera.server.chat import create_chat_completion
from tessera.server.completions import create_completion
from tessera.server.embeddings import add_embedding_routes
from tessera.server.errors import APIError, install_error_handlers, validation_error
from tessera.server.messages import anthropic_errors, count_tokens, create_message
from tessera.server.ollama import OLLAMA_REQUESTS, install_ollama_api
from tessera.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from tessera.server.protocol_anthropic import CountTokensRequest, MessagesRequest
from tessera.server.protocol_responses import ResponsesRequest
from tessera.server.responses import (
    DEFAULT_MAX_STORED_RESPONSES, ResponseStore, cancel_response, create_response, delete_response, get_response,
)
from tessera.server.router import ModelRouter, ServedModel
from tessera.server.serving import (
    CLIENT_CLOSED_REQUEST, HTTPRequestSink, LiveView, RejectionSink, ServerMetrics, ServerState,
)
from tessera.server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from tessera.server.transport import TransportSettings, install_cors, uvicorn_config
from tessera.server.ui import install_ui

if TYPE_CHECKING:
    from tessera.config import EngineConfig
    from tessera.engine.frontend.async_engine import AsyncLLMEngine, CoreFactory, ServingEngine
    from tessera.engine.frontend.ray_core import RayPlacement
    from tessera.live_stats import LiveStats
    from tessera.metrics import MetricFamilies, PrometheusStatLogger
    from tessera.observability import StatLoggers, StatsConsumer
    from tessera.server.config import RaySettings, ServingSpec
    from tessera.server.traffic import TrafficRecorder
    from tessera.slo import SLOSpec

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
        request_state["received_at"] = time.time()  # the arrival --record-traffic writes
        server: Optional[ServerState] = getattr(scope["app"].state, "tessera", None) if "app" in scope else None

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        generating = scope["method"] == "POST" and scope["path"].startswith(("/v1/", "/api/"))
        if server is not None and generating:
            server.active_requests += 1
        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            if server is not None and generating:
                server.active_requests -= 1
            elapsed = time.perf_counter() - start
            route = getattr(scope.get("route"), "path", None)  # the matched route's template
            if server is not None and route is not None and isinstance(server.metrics, HTTPRequestSink):
                server.metrics.record_http_request(route, scope["method"], status if status is not None else 500,
                                                   elapsed)
            client = scope.get("client")
            line = (f'{client[0] if client else "-"} "{scope["method"]} {scope["path"]}" '
                    f"{status if status is not None else 500} {elapsed * 1000:.1f}ms")
            if "request_id" in request_state:
                line += f" id={request_state['request_id']}"
            if CLIENT_REQUEST_ID in request_state:
                line += f" req={request_state[CLIENT_REQUEST_ID]}"
            grant = request_key(scope)
            if grant is not None:
                line += f" key={grant[0].name}"
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


def create_app(engine: Optional[AsyncLLMEngine] = None, model_names: Optional[list[str]] = None, *,
               router: Optional[ModelRouter] = None, request_timeout: Optional[float] = None,
               metrics: Optional[ServerMetrics] = None, live: Optional[LiveView] = None, ui: bool = True,
               max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES, access: Optional[AccessSettings] = None,
               beyond_loopback: bool = False, transport: Optional[TransportSettings] = None,
               families: Optional[MetricFamilies] = None, recorder: Optional[TrafficRecorder] = None,
               slo: Optional[SLOSpec] = None) -> FastAPI:
    """The app over one engine (`model_names`: the names clients may use, the first reported;
    `metrics`/`live` its loggers) or over a `router` of several models. `ui` adds the chat page
    (/) and the dashboard (/dashboard); `max_stored_responses` bounds the Responses API's store.
    `access`: API keys and what stays open (the admin routes are off beyond loopback without an
    admin key); `transport`: the CORS origins; `families`: where the per-key metrics go;
    `recorder` writes every request to a traffic trace (--record-traffic); `slo` is checked
    against the live percentiles on /v1/engine/live."""
    if router is None:
        if engine is None or not model_names:
            raise ValueError("create_app needs an engine and at least one served model name, or a router")
        router = ModelRouter.single(engine, list(model_names), live)
        router.default.metrics = metrics if isinstance(metrics, RejectionSink) else None
    app = FastAPI(title="Tessera", summary="OpenAI-compatible LLM inference server",
                  docs_url="/docs", redoc_url=None)
    access = access or AccessSettings()
    app.state.tessera = ServerState(router=router, request_timeout=request_timeout, metrics=metrics,
                                    log_requests=access.log_requests, recorder=recorder)
    install_error_handlers(app)
    app.add_middleware(AccessControl, settings=access, beyond_loopback=beyond_loopback, families=families)
    app.add_middleware(AccessLog)
    install_cors(app, transport or TransportSettings())

    # The bodies are parsed here rather than by FastAPI so that JSON is accepted whatever the
    # Content-Type (curl -d sends a form type) and every schema error is the same 400.
    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _guarded(request, _parse_then(request, CompletionRequest, create_completion))

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await _guarded(request, _parse_then(request, ChatCompletionRequest, create_chat_completion))

    # The APIs agents speak: OpenAI's Responses (responses.py) and Anthropic's Messages (messages.py).
    app.state.responses = ResponseStore(max_stored_responses)

    @app.post("/v1/responses", openapi_extra=_json_body(ResponsesRequest))
    async def responses_create(request: Request) -> Response:
        return await _guarded(request, _parse_then(request, ResponsesRequest, create_response))

    @app.get("/v1/responses/{response_id}")
    async def responses_get(response_id: str, request: Request) -> Response:
        return await _guarded(request, get_response(response_id, request))

    @app.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str, request: Request) -> Response:
        return await _guarded(request, delete_response(response_id, request))

    @app.post("/v1/responses/{response_id}/cancel")
    async def responses_cancel(response_id: str, request: Request) -> Response:
        return await _guarded(request, cancel_response(response_id, request))

    @app.post("/v1/messages", openapi_extra=_json_body(MessagesRequest))
    async def messages_create(request: Request) -> Response:
        return await anthropic_errors(_guarded(request, _parse_then(request, MessagesRequest, create_message)))

    @app.post("/v1/messages/count_tokens", openapi_extra=_json_body(CountTokensRequest))
    async def messages_count_tokens(request: Request) -> Response:
        return await anthropic_errors(_guarded(request, _parse_then(request, CountTokensRequest, count_tokens)))
    # Embeddings (server/embeddings.py): /v1/embeddings, and Ollama's /api/embed and /api/embeddings.
    embedding_requests = add_embedding_routes(app, _guarded, _parse_then, _json_body)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        """Every name served (aliases included), loaded or not; `status` says which."""
        state = _state(request)
        grant = request_key(request.scope)
        cards = []
        for name, served in state.router.names():
            if grant is not None and not grant[0].allows_model(name, served.name):
                continue  # a key sees only the models it may use
            engine = served.engine
            cards.append(ModelCard(id=name, created=int(state.started), root=served.spec.model,
                                   max_model_len=engine.config.max_model_len if engine is not None else None,
                                   status=served.status))
        return ModelList(data=cards)

    @app.get("/health")
    async def health(request: Request, model: Optional[str] = None) -> Response:
        """200 while every loaded model can serve (or `model` can); 503 with the reasons otherwise.
        A model not loaded counts as healthy: it loads on its first request."""
        state = _state(request)
        if state.draining:
            return APIError(503, "The server is shutting down.", type="server_error",
                            code="server_shutting_down").response()
        chosen = [state.router.resolve(model)] if model is not None else state.router.models
        report, failing = {}, None
        for served in chosen:
            status = served.status
            if served.engine is not None:
                try:
                    served.engine.check_health()
                except Exception as exc:  # noqa: BLE001 - EngineDeadError and kin: this model is down
                    status, failing = f"unavailable: {exc}", failing or exc
            elif status == "failed":
                status, failing = f"failed: {served.error}", failing or RuntimeError(served.error)
            report[served.name] = status
        if failing is not None:
            err = APIError(503, f"{failing}", type="server_error", code="engine_unavailable")
            body = err.body()
            body["models"] = report
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok", "models": report})

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        metrics = _state(request).metrics
        if metrics is None:
            return APIError(404, "Metrics are not enabled on this server.", code="metrics_disabled").response()
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/engine/stats")
    async def engine_stats(request: Request, model: Optional[str] = None) -> Response:
        """The scheduler, profile, step-cost model and KV cache of one model (default: the first)."""
        state = _state(request)
        served = state.router.resolve(model)
        engine = served.engine
        if engine is None:
            raise APIError(503, f"Model {served.name!r} is {served.status}.", type="server_error",
                           code="model_unavailable")
        stats = engine.get_scheduler_stats()
        config = engine.config
        wait = engine.predicted_wait()
        return JSONResponse({"model": served.name,
                             "scheduler": dataclasses.asdict(stats),
                             "profile": {"name": config.profile, "overrides": list(config.profile_overrides),
                                         **{name: getattr(config, name) for name in PROFILE_FIELDS},
                                         "max_num_queued_requests": engine.max_num_queued_requests},
                             "step_cost_model": engine.cost_model_stats(),
                             "kv_cache": engine.kv_cache_info(),
                             "predicted_queue_wait_s": None if wait is None else round(wait, 4),
                             "engine_core": engine.core_info(),
                             "models": [m.describe() for m in state.router.models],
                             "server": {"active_requests": state.active_requests,
                                        "uptime_s": round(time.time() - state.started, 3)}})

    @app.post("/v1/engine/replicas")
    async def scale_replicas(request: Request) -> Response:
        """Scale a replicated model (`tessera serve --replicas N`) at run time: {"model": name,
        "replicas": n}. New replicas join rotation once loaded; removed ones drain first."""
        from tessera.deploy.replicas import ReplicaSet

        state = _state(request)
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "The body must be JSON: {\"model\": ..., \"replicas\": n}.") from None
        if not isinstance(body, dict):
            raise APIError(400, "The body must be a JSON object: {\"model\": ..., \"replicas\": n}.")
        n = body.get("replicas")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise APIError(400, "`replicas` must be an integer from 1 to 256.", param="replicas")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise APIError(400, "`model` must be a string.", param="model")
        served = state.router.resolve(model)
        engine = served.engine
        if not isinstance(engine, ReplicaSet):
            raise APIError(400, f"Model {served.name!r} is not served as replicas (start the server with "
                           "--replicas or --ray).", param="model", code="not_replicated")
        try:
            return JSONResponse({"model": served.name, **engine.scale(n)})
        except ValueError as exc:
            raise APIError(400, str(exc), param="replicas") from None

    @app.get("/v1/engine/live")
    async def engine_live(request: Request, seconds: int = 120) -> Response:
        """The last `seconds` of per-second stats of every loaded model (at most the 300 kept)
        and each one's settings: what the dashboard draws."""
        state = _state(request)
        if not 1 <= seconds <= 3600:
            raise APIError(400, "seconds must be between 1 and 3600.", param="seconds")
        snapshots = []
        for served in state.router.models:
            engine, live = served.engine, served.live
            if engine is None or live is None:
                continue
            snapshot = await asyncio.to_thread(live.snapshot, seconds)
            snapshot["model"] = served.name
            stats = engine.get_scheduler_stats()  # now, even when no step has run for a while
            snapshot["current"] = {"running": stats.num_running, "waiting": stats.num_waiting,
                                   "swapped": stats.num_swapped, "kv_usage": round(stats.kv_cache_usage, 4),
                                   "num_blocks_total": stats.num_blocks_total,
                                   "num_blocks_free": stats.num_blocks_free}
            snapshot["settings"] = engine_settings(engine)
            if slo is not None:  # does live traffic still fit the SLO the settings were tuned for?
                snapshot["slo"] = slo.check_live(snapshot["summary"])
            snapshots.append(snapshot)
        loaded = state.router.loaded()
        if loaded and all(m.live is None for m in loaded):
            return APIError(404, "Live stats are not enabled on this server.", code="live_stats_disabled").response()
        return JSONResponse({"models": snapshots,
                             "configured": [m.describe() for m in state.router.models]})

    # vLLM's tokenizer endpoints, and Ollama's API (its own error shape; "Ollama is running" at /
    # only where the chat page is not).
    @app.post("/tokenize", openapi_extra=_json_body(TokenizeRequest))
    async def tokenize_endpoint(request: Request) -> Response:
        return await _guarded(request, _parse_then(request, TokenizeRequest, tokenize))

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize_endpoint(request: Request) -> Response:
        return await _guarded(request, _parse_then(request, DetokenizeRequest, detokenize))

    install_ollama_api(app, _parse_then, _json_body, root=not ui)

    if ui:
        install_ui(app)
    _add_request_schemas(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest, MessagesRequest,
                               CountTokensRequest, TokenizeRequest, DetokenizeRequest, *OLLAMA_REQUESTS,
                               *embedding_requests])
    return app


def engine_settings(engine: AsyncLLMEngine) -> dict[str, Any]:
    """The settings a reader of the dashboard wants beside the charts."""
    config = engine.config
    spec = config.speculative_config
    kv = engine.kv_cache_info()
    return {"model": config.model, "device": config.device, "profile": config.profile, "quantization": config.quantization, "kv_cache_dtype": kv["dtype"], "kv_cache_tokens": kv["tokens"],
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


def serve(spec: ServingSpec) -> int:
    """Serve `spec`'s models from one port until SIGTERM or Ctrl-C, then drain. Every topology
    takes this one path: one model is a server of one model, each model's engine comes from
    `build_serving_engine` (at start with preload, else on first use), and a lone engine's loop
    runs on this, the main, thread (`ServingSpec.steps_on_main_thread`)."""
    from prometheus_client import Counter

    from tessera.metrics import PREFIX, MetricFamilies

    _configure_logging(spec.log_level)
    families = MetricFamilies()  # one /metrics for every model, a `model_name` label each
    degraded = families.get(Counter, PREFIX + "degraded_requests",
                            "Requests answered by a fallback model instead of the one asked for, by cause "
                            "(queue_full, queue_wait, kv_usage, unavailable).", ["model_name", "fallback", "cause"])
    if spec.ray is not None:
        _init_ray(spec.ray)
    router = ModelRouter([ServedModel(m) for m in spec.models],
                         builder=lambda served: build_serving_engine(served, spec, families),
                         closer=close_serving_engine, max_loaded=spec.max_loaded_models,
                         on_degraded=lambda asked, answered, cause: degraded.labels(asked, answered, cause).inc())
    router.default.pinned = spec.steps_on_main_thread
    sock = _bind(spec.host, spec.port)
    recorder = None
    try:
        for served in router.models:
            if served.spec.preload:
                _preload(router, served)
        router.start_reaper()
        if spec.record is not None:
            from tessera.server.traffic import TrafficRecorder

            recorder = TrafficRecorder(spec.record)
            logger.info("recording traffic to %s%s", spec.record.path, " with text" if spec.record.record_text else "")
        beyond_loopback = not is_loopback(spec.host)
        app = create_app(router=router, request_timeout=spec.request_timeout, metrics=families, ui=spec.ui,
                         max_stored_responses=spec.max_stored_responses, access=spec.access,
                         beyond_loopback=beyond_loopback, transport=spec.transport, families=families,
                         recorder=recorder, slo=spec.slo)
        # uvicorn's own timeout is the backstop: it cancels whatever our shutdown left running.
        config = uvicorn_config(app, spec.transport, log_level=spec.log_level,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS + 5)
        server = DrainingServer(config, app.state.tessera, spec.shutdown_timeout)
        for line in describe_access(spec.access, beyond_loopback):
            logger.info("%s", line)
        host = f"[{spec.host}]" if ":" in spec.host else spec.host
        logger.info("serving %s on %s://%s:%d", ", ".join(
            f"{m.name} ({m.spec.model}, {m.status})" for m in router.models),
            "https" if spec.transport.tls else "http", host, spec.port)
        http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="tessera-http")
        signal.signal(signal.SIGTERM, lambda *_: server.drain())
        http.start()
        # build_serving_engine left a lone engine's loop to this thread
        stepped = cast("AsyncLLMEngine", router.default.engine) if spec.steps_on_main_thread else None
        _run_until_stopped(http, server, stepped)
    finally:
        router.shutdown()
        sock.close()
        if recorder is not None:
            recorder.close()
    return 0


def _preload(router: ModelRouter, served: ServedModel) -> None:
    """Load a model before the server answers; a failure stops the server with one line."""
    try:
        router.load(served)
    except TesseraError:
        raise
    except Exception as exc:  # a replica set's RuntimeError and kin: still one line, naming the model
        raise TesseraError(f"model {served.name!r} failed to load: {type(exc).__name__}: {exc}") from exc


def _run_until_stopped(http: threading.Thread, server: DrainingServer, engine: Optional[AsyncLLMEngine]) -> None:
    """Until HTTP has stopped: step `engine`'s loop on this thread if there is one, else only wait
    (each engine's loop has a thread of its own). Ctrl-C drains: the engines keep stepping the
    running requests while HTTP shuts down; a second Ctrl-C stops at once."""
    stepping = engine is not None
    while http.is_alive():
        try:
            if stepping:
                assert engine is not None
                engine.run_until(lambda: not http.is_alive())
                stepping = False  # HTTP stopped, or the loop died (its requests failed, /health says so)
            else:
                http.join(0.5)
        except KeyboardInterrupt:
            logger.info("shutting down")
            server.drain()


def build_serving_engine(served: ServedModel, spec: ServingSpec, families: MetricFamilies) -> ServingEngine:
    """One model's engine, for any topology: an AsyncLLMEngine over an in-process or
    engine-process core, or a ReplicaSet of them over process or Ray cores (P/D included).
    Each engine gets the same wiring (`_start_engine`); the model's loggers are left on `served`
    for the app (429s, the dashboard) and `close_serving_engine`."""
    from tessera.engine.frontend.async_engine import make_engine_core

    model = served.spec
    config = spec.engine_config(model)
    queue, wait = spec.queue_limit(model), spec.queue_wait(model)
    source = "model config" if model.max_num_queued_requests else "flag"
    if queue is None:
        queue, source = PROFILE_SETTINGS[config.profile].max_num_queued_requests, f"profile {config.profile}"
    logger.info("%s: queue of up to %d waiting requests%s (%s), then HTTP 429", served.name, queue,
                " per replica" if spec.replicated else "", source)
    if not spec.replicated:
        on_main_thread = spec.steps_on_main_thread
        loggers = _stat_loggers(spec, served.name, config, families)
        core = functools.partial(make_engine_core, engine_process=spec.engine_process or not on_main_thread,
                                 log_level=spec.log_level)
        engine, consumer = _start_engine(spec, config, core, loggers, loggers.all(), queue, wait,
                                         thread_name=f"tessera-stats-{served.name}", start_thread=not on_main_thread)
        served.metrics, served.live, served.stats_consumer = loggers.prometheus, loggers.live, consumer
        return engine

    from tessera.deploy.replicas import ReplicaSet
    from tessera.live_stats import LiveStats

    if config.num_threads is None:  # replicas must not fight over cores: each gets its share
        threads = spec.ray.num_cpus_per_replica if spec.ray is not None else (os.cpu_count() or 1) / spec.replica_count
        config = dataclasses.replace(config, num_threads=max(1, int(threads)))
    placement = _placement(spec.ray) if spec.ray is not None else None
    live = LiveStats(served.name)
    consumers: dict[int, StatsConsumer] = {}
    prometheus: dict[int, PrometheusStatLogger] = {}
    replica_set: Optional[ReplicaSet] = None

    def one(replica_id: int) -> AsyncLLMEngine:
        """A replica: its own core, stats thread and Prometheus logger (a `replica` label), all
        feeding the model's one LiveStats with the whole set's gauges (the dashboard)."""
        loggers = _stat_loggers(spec, served.name, config, families, replica=str(replica_id), live=live)
        sinks = [lg for lg in loggers.all() if lg is not live] + [_SetLive(live, lambda: replica_set)]
        core = functools.partial(make_engine_core, engine_process=True, ray=placement,
                                 name=f"{served.name}/{replica_id}", log_level=spec.log_level)
        engine, consumer = _start_engine(spec, config, core, loggers, sinks, queue, wait,
                                         thread_name=f"tessera-stats-{served.name}-{replica_id}")
        consumers[replica_id], prometheus[replica_id] = consumer, loggers.prometheus
        return engine

    def close_one(replica_id: int, engine: AsyncLLMEngine) -> None:
        consumer = consumers.pop(replica_id, None)
        if consumer is not None:
            consumer.stop()
        prometheus.pop(replica_id, None)

    def rejected(replica_id: int) -> None:
        if replica_id in prometheus:
            prometheus[replica_id].record_rejection()

    replica_set = ReplicaSet(one, spec.replicas, spec.router_policy, close=close_one, on_rejection=rejected,
                             pd=spec.pd)
    served.metrics, served.live = None, live  # 429s are counted by the set (on_rejection) and here
    return replica_set


def _stat_loggers(spec: ServingSpec, name: str, config: EngineConfig, families: MetricFamilies, *,
                  replica: Optional[str] = None, live: Optional[LiveStats] = None) -> StatLoggers:
    from tessera.observability import build_stat_loggers

    return build_stat_loggers(name, max_model_len=config.max_model_len,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              otlp_traces_endpoint=spec.otlp_traces_endpoint, log_stats=spec.log_stats,
                              families=families, replica=replica, live=live)


def _start_engine(spec: ServingSpec, config: EngineConfig, core: CoreFactory, loggers: StatLoggers,
                  sinks: list, queue: int, wait: Optional[float], *, thread_name: str,
                  start_thread: bool = True) -> tuple[AsyncLLMEngine, StatsConsumer]:
    """An engine with the wiring every one gets: its stats on a thread of their own (metrics and
    traces are built there, off the engine loop), the queue bound and forecast admission, the
    watchdog, a warm-up, and the forecast on /metrics. Nothing is left running if it fails."""
    from tessera.engine.frontend.async_engine import AsyncLLMEngine
    from tessera.observability import StatsConsumer

    consumer = StatsConsumer(sinks, thread_name=thread_name)
    try:
        engine = AsyncLLMEngine(config, max_num_queued_requests=queue, stats_sink=consumer, start_thread=start_thread,
                                step_timeout=spec.engine_step_timeout, max_queue_wait=wait, core_factory=core)
        try:
            engine.warm_up()
        except BaseException:
            engine.shutdown()
            raise
    except BaseException:
        consumer.stop()
        raise
    loggers.prometheus.watch_predicted_wait(engine.predicted_wait)
    return engine, consumer


def close_serving_engine(served: ServedModel) -> None:
    """Stop what `build_serving_engine` started beside the engine (after the engine has shut down,
    so its last steps' stats still reached the loggers)."""
    if served.metrics is not None:
        served.metrics.watch_predicted_wait(lambda: None)
    if served.stats_consumer is not None:
        served.stats_consumer.stop()


class _SetLive:
    """Feeds a replica's step stats to the model's LiveStats with the whole set's scheduler
    gauges (running, waiting, KV use), so the dashboard does not flip between replicas."""

    def __init__(self, live, replica_set: Callable[[], Any]) -> None:
        self.live = live
        self.replica_set = replica_set

    def record(self, scheduler_stats, iteration_stats) -> None:
        replicas = self.replica_set()
        self.live.record(replicas.get_scheduler_stats() if replicas is not None else scheduler_stats,
                         iteration_stats)


def _init_ray(ray_settings: RaySettings) -> None:
    try:
        import ray
    except ImportError:
        raise TesseraError("--ray needs Ray: pip install 'tessera[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=ray_settings.address, include_dashboard=False, log_to_driver=True,
                 logging_level=logging.WARNING)
    logger.info("Ray cluster: %s", ", ".join(f"{k} {v:g}" for k, v in sorted(ray.cluster_resources().items())
                                              if k in ("CPU", "GPU", "memory")))


def _placement(ray_settings: RaySettings) -> RayPlacement:
    """What each replica asks of Ray."""
    from tessera.engine.frontend.ray_core import RayPlacement

    return RayPlacement(num_cpus=ray_settings.num_cpus_per_replica, num_gpus=ray_settings.num_gpus_per_replica,
                        memory_bytes=ray_settings.memory_per_replica)
