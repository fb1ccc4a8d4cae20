"""The routes about the server rather than a model's API: GET /v1/models (and /v1/models/{id}),
/health (503 once
an engine loop has died), /metrics (Prometheus), and /v1/engine/stats, /v1/engine/live and
POST /v1/engine/replicas for operators, the dashboard and tests that watch the KV cache drain."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tessera.profiles import PROFILE_FIELDS
from tessera.server.auth import request_key
from tessera.server.endpoint import server_state
from tessera.server.errors import APIError, model_not_found
from tessera.server.served_model import ServedModel
from tessera.server.openai.response_models import ModelCard, ModelList

if TYPE_CHECKING:
    from tessera.engine.frontend.async_engine import AsyncLLMEngine


def build_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/models/{model_id:path}", model_card, methods=["GET"])
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/metrics", prometheus_metrics, methods=["GET"])
    router.add_api_route("/v1/engine/stats", engine_stats, methods=["GET"])
    router.add_api_route("/v1/engine/replicas", scale_replicas, methods=["POST"])
    router.add_api_route("/v1/engine/live", engine_live, methods=["GET"])
    return router


def _model_cards(request: Request) -> list[ModelCard]:
    """A card per name the request's key may use: each model and alias, then each LoRA adapter
    (as vLLM lists one: `root` its path, `parent` its base model)."""
    state = server_state(request)
    grant = request_key(request.scope)
    cards = []
    for name, served in state.router.names():
        if grant is not None and not grant[0].allows_model(name, served.name):
            continue  # a key sees only the models it may use
        cards.append(_card(state.started, name, served, served.spec.model))
    for served in state.router.models:
        for name, path in sorted(served.adapters().items()):
            if grant is None or grant[0].allows_model(name, name):  # an adapter is allowed by its own name
                cards.append(_card(state.started, name, served, path, parent=served.name))
    return cards


def _card(started: float, name: str, served: ServedModel, root: str, parent: Optional[str] = None) -> ModelCard:
    engine = served.engine
    return ModelCard(id=name, created=int(started), root=root, parent=parent, status=served.status,
                     max_model_len=engine.config.max_model_len if engine is not None else None,
                     capabilities=served.capabilities())


async def models(request: Request) -> ModelList:
    """Every name served (aliases and LoRA adapters included), loaded or not; `status` says which."""
    return ModelList(data=_model_cards(request))


async def model_card(model_id: str, request: Request) -> ModelCard:
    """One name's card (OpenAI's retrieve model); 404 for a name not served or not the key's."""
    card = next((c for c in _model_cards(request) if c.id == model_id), None)
    if card is None:
        raise model_not_found(model_id)
    return card


async def health(request: Request, model: Optional[str] = None) -> Response:
    """200 while every loaded model can serve (or `model` can); 503 with the reasons otherwise.
    A model not loaded counts as healthy: it loads on its first request."""
    state = server_state(request)
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


async def prometheus_metrics(request: Request) -> Response:
    metrics = server_state(request).metrics
    if metrics is None:
        return APIError(404, "Metrics are not enabled on this server.", code="metrics_disabled").response()
    body, content_type = metrics.render()
    return Response(body, media_type=content_type)


async def engine_stats(request: Request, model: Optional[str] = None) -> Response:
    """The scheduler, profile, step-cost model and KV cache of one model (default: the first)."""
    state = server_state(request)
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
                                     "max_num_queued_requests": engine.max_num_queued_requests,
            "max_loras": config.max_loras if getattr(config, "enable_lora", False) else None},
                         "step_cost_model": engine.cost_model_stats(),
                         "kv_cache": engine.kv_cache_info(),
                         "predicted_queue_wait_s": None if wait is None else round(wait, 4),
                         "engine_core": engine.core_info(),
                         "models": [m.describe() for m in state.router.models],
                         "server": {"active_requests": state.active_requests,
                                    "uptime_s": round(time.time() - state.started, 3)}})


async def scale_replicas(request: Request) -> Response:
    """Scale a replicated model (`tessera serve --replicas N`) at run time: {"model": name,
    "replicas": n}. New replicas join rotation once loaded; removed ones drain first."""
    from tessera.deploy.replicas import ReplicaSet

    state = server_state(request)
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


async def engine_live(request: Request, seconds: int = 120) -> Response:
    """The last `seconds` of per-second stats of every loaded model (at most the 300 kept)
    and each one's settings: what the dashboard draws."""
    state = server_state(request)
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
                               "num_blocks_free": stats.num_blocks_free,
                               # per-request states of recurrent layers (0 and 0 without them)
                               "num_state_slots_total": stats.num_state_slots_total,
                               "num_state_slots_used": stats.num_state_slots_used,
                               # requests per LoRA adapter name (empty without adapters)
                               "lora_running": dict(getattr(stats, "lora_running", None) or {}),
                               "lora_waiting": dict(getattr(stats, "lora_waiting", None) or {}),
                               "by_priority": [{"priority": p, "running": r, "waiting": w}
                                               for p, r, w in stats.requests_by_priority]}
        snapshot["adapters"] = sorted(served.adapters())
        snapshot["settings"] = engine_settings(engine)
        if state.slo is not None:  # does live traffic still fit the SLO the settings were tuned for?
            snapshot["slo"] = state.slo.check_live(snapshot["summary"])
        snapshots.append(snapshot)
    loaded = state.router.loaded()
    if loaded and all(m.live is None for m in loaded):
        return APIError(404, "Live stats are not enabled on this server.", code="live_stats_disabled").response()
    return JSONResponse({"models": snapshots, "configured": [m.describe() for m in state.router.models],
                         "batches": batch_progress(request)})


def batch_progress(request: Request) -> list[dict[str, Any]]:
    """Every batch with work left, oldest first, with its owner and counts (the dashboard shows them)."""
    batches = getattr(request.app.state, "batches", None)
    if batches is None:
        return []
    store = batches[0]
    out = []
    for row in store.active_batches():
        total, completed, failed = store.counts(row["id"])
        out.append({"id": row["id"], "owner": row["owner"], "status": row["status"], "endpoint": row["endpoint"],
                    "total": total, "completed": completed, "failed": failed, "created_at": row["created_at"]})
    return out


def engine_settings(engine: AsyncLLMEngine) -> dict[str, Any]:
    """The settings a reader of the dashboard wants beside the charts."""
    config = engine.config
    spec = config.speculative_config
    kv = engine.kv_cache_info()
    return {"model": config.model, "device": config.device, "profile": config.profile,
            "quantization": config.quantization, "kv_cache_dtype": kv["dtype"], "kv_cache_tokens": kv["tokens"],
            "max_model_len": config.max_model_len, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens, "target_itl_ms": config.target_itl_ms,
            "enable_prefix_caching": config.enable_prefix_caching, "preemption_mode": config.preemption_mode,
            "speculative": None if spec is None or spec.method is None else spec.method,
            "attention_backend": config.attention_backend, "num_threads": config.num_threads,
            "max_num_queued_requests": engine.max_num_queued_requests,
            "max_loras": config.max_loras if getattr(config, "enable_lora", False) else None}
