"""The HTTP app: `create_app` builds FastAPI over a ModelRouter (or one engine), adds the
middleware (access control, the access log, CORS) and attaches each API's router.

Endpoints, by package: openai/ (POST /v1/completions, /v1/chat/completions, /v1/embeddings),
responses/ (POST /v1/responses and GET, DELETE, POST .../cancel of a stored response),
anthropic/ (POST /v1/messages and /v1/messages/count_tokens), ollama/ (/api/*), tokenize/
(POST /tokenize, /detokenize), admin.py (GET /v1/models, /health, /metrics and
/v1/engine/*), lora.py (POST /v1/load_lora_adapter, /v1/unload_lora_adapter), batches/ (OpenAI's
Files and Batch API: /v1/files, /v1/batches), ui.py (the chat page at / and /dashboard). Serving it
is launch.py's job.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from fastapi import FastAPI

from tessera.server import admin, lora
from tessera.server.access_log import AccessLog
from tessera.server.anthropic import router as anthropic_api
from tessera.server.api_keys import AccessSettings
from tessera.server.auth import AccessControl
from tessera.server.batches import router as batches_api
from tessera.server.batches.protocol import BatchLimits
from tessera.server.endpoint import add_request_schemas
from tessera.server.errors import install_error_handlers
from tessera.server.media import MediaSettings
from tessera.server.model_router import ModelRouter
from tessera.server.ollama import router as ollama_api
from tessera.server.openai import router as openai_api
from tessera.server.responses import router as responses_api
from tessera.server.responses.serving import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from tessera.server.serving import LiveView, RejectionSink, ServerMetrics, ServerState
from tessera.server.tokenize import router as tokenize_api
from tessera.server.transport import TransportSettings, install_cors
from tessera.server.ui import install_ui

if TYPE_CHECKING:
    from tessera.engine.frontend.async_engine import AsyncLLMEngine
    from tessera.metrics import MetricFamilies
    from tessera.server.traffic import TrafficRecorder
    from tessera.slo import SLOSpec


def create_app(engine: Optional[AsyncLLMEngine] = None, model_names: Optional[list[str]] = None, *,
               router: Optional[ModelRouter] = None, request_timeout: Optional[float] = None,
               metrics: Optional[ServerMetrics] = None, live: Optional[LiveView] = None, ui: bool = True,
               max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES, access: Optional[AccessSettings] = None,
               beyond_loopback: bool = False, transport: Optional[TransportSettings] = None,
               families: Optional[MetricFamilies] = None, recorder: Optional[TrafficRecorder] = None,
               slo: Optional[SLOSpec] = None, batch_store: Optional[Path] = None,
               batch_limits: Optional[BatchLimits] = None, media: Optional[MediaSettings] = None) -> FastAPI:
    """The app over one engine (`model_names`: the names clients may use, the first reported;
    `metrics`/`live` its loggers) or over a `router` of several models. `ui` adds the chat page
    (/) and the dashboard (/dashboard); `max_stored_responses` bounds the Responses API's store.
    `access`: API keys and what stays open (the admin routes are off beyond loopback without an
    admin key); `transport`: the CORS origins; `families`: where the per-key metrics go;
    `recorder` writes every request to a traffic trace (--record-traffic); `slo` is checked
    against the live percentiles on /v1/engine/live. `batch_store`: the SQLite file of the Files
    and Batch API (None: those routes answer 404), `batch_limits` its limits. `media`: where images
    may come from and their limits."""
    if router is None:
        if engine is None or not model_names:
            raise ValueError("create_app needs an engine and at least one served model name, or a router")
        router = ModelRouter.single(engine, list(model_names), live)
        router.default.metrics = metrics if isinstance(metrics, RejectionSink) else None
    # Each API's APIRouter gives its routes to the app itself (not include_router), so that
    # app.router.routes lists every route: access control and the access log match on them.
    routers = [openai_api.build_router(), responses_api.build_router(), anthropic_api.build_router(),
               admin.build_router(), lora.build_router(), tokenize_api.build_router(), batches_api.build_router(),
               ollama_api.build_router(root=not ui)]  # "Ollama is running" at / without the chat page
    app = FastAPI(title="Tessera", summary="OpenAI-compatible LLM inference server", docs_url="/docs",
                  redoc_url=None, routes=[route for r in routers for route in r.routes])
    access = access or AccessSettings()
    app.state.tessera = ServerState(router=router, request_timeout=request_timeout, metrics=metrics,
                                    log_requests=access.log_requests, recorder=recorder, slo=slo,
                                    media=media or MediaSettings())
    app.state.responses = ResponseStore(max_stored_responses)
    install_error_handlers(app)
    if batch_store is not None:
        _install_batches(app, batch_store, batch_limits or BatchLimits())
    app.add_middleware(AccessControl, settings=access, beyond_loopback=beyond_loopback, families=families)
    app.add_middleware(AccessLog)
    install_cors(app, transport or TransportSettings())

    if ui:
        install_ui(app)
    add_request_schemas(app, [*openai_api.REQUEST_MODELS, *responses_api.REQUEST_MODELS,
                              *anthropic_api.REQUEST_MODELS, *tokenize_api.REQUEST_MODELS,
                              *ollama_api.REQUEST_MODELS, *batches_api.REQUEST_MODELS])
    return app


def _install_batches(app: FastAPI, path: Path, limits: BatchLimits) -> None:
    """The batch store and its runner, which starts (resuming what a restart interrupted) with the
    server's event loop and stops with it."""
    from tessera.server.batches.runner import BatchRunner
    from tessera.server.batches.store import BatchStore

    store = BatchStore(path)
    runner = BatchRunner(app, store, limits)
    app.state.batches = (store, runner, limits)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_: FastAPI) -> AsyncIterator[Any]:
        async with inner(app_) as state:
            runner.start()
            try:
                yield state
            finally:
                await runner.stop()
                store.close()

    app.router.lifespan_context = lifespan
