"""LoRA adapters at run time, as vLLM serves them: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (admin scope: they change what the server serves).

An adapter is checked here, in the server process, against its base model's shapes and
--max-lora-rank (tessera.models.adapters.read_adapter reads only the file's configuration and
tensor headers), so a bad file is a 400 before the engine hears of it. Once loaded, its name is a
model name in every API (tessera/server/model_router.py routes it to its base), and /v1/models
lists it with its base as `parent`. Answers are vLLM's: plain text on success, the OpenAI error
body otherwise.
"""
from __future__ import annotations

import asyncio
from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from tessera.errors import AdapterError
from tessera.models.adapters import read_adapter
from tessera.server.endpoint import server_state
from tessera.server.errors import APIError


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body, plus the base to serve it on when the server has several models (default:
    the first)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model_name: Optional[str] = None
    model: Optional[str] = None  # the same as base_model_name, under the name other routes use


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None  # vLLM's; names are what Tessera goes by


def build_router() -> APIRouter:
    router = APIRouter()
    router.add_api_route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"])
    router.add_api_route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])
    return router


def _check_name(name: str) -> None:
    if name != name.strip() or any(c in name for c in "\n\r\t,"):
        # a comma would split the name in the tessera:lora_requests_info labels
        raise APIError(400, f"lora_name {name!r} must have no surrounding spaces, tabs, newlines or commas.",
                       param="lora_name")


async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Check the adapter against its base (loaded for it if need be) and serve it from now on."""
    state = server_state(request)
    name = body.lora_name
    _check_name(name)
    state.router.check_adapter_name(name)  # a taken name is refused before the file is read
    served, adapter = state.router.lookup(body.base_model_name or body.model)
    if adapter is not None:
        raise APIError(400, f"`{adapter}` is a LoRA adapter; name its base model (`{served.name}`) instead.",
                       param="base_model_name")
    route = await state.route(served.name, request, fallback=False, generates=False)
    engine = route.model.engine
    if engine is None:
        raise APIError(503, f"Model {served.name!r} was unloaded; retry.", type="server_error",
                       code="model_unavailable")
    config = engine.config
    if not getattr(config, "enable_lora", False):
        raise APIError(400, f"LoRA adapters are not enabled on model `{served.name}`: start the server with "
                            "--enable-lora (or --lora-modules) to load them.", code="lora_not_enabled")
    try:
        spec = await asyncio.to_thread(read_adapter, name, body.lora_path, engine.model_config,
                                       config.max_lora_rank)
    except AdapterError as exc:
        raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
    state.router.add_adapter(route.model, spec)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Stop serving the adapter: requests running with it finish, later ones naming it get 404."""
    state = server_state(request)
    state.router.remove_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
