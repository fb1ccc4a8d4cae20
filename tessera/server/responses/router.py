"""The Responses routes: POST /v1/responses, and GET, DELETE and POST .../cancel of a stored one."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tessera.server.endpoint import guarded, json_body, parse_then
from tessera.server.responses.protocol import ResponsesRequest
from tessera.server.responses.serving import cancel_response, create_response, delete_response, get_response

REQUEST_MODELS: tuple[type[BaseModel], ...] = (ResponsesRequest,)


def build_router() -> APIRouter:
    """The routes; the store they read is the app's `state.responses` (create_app makes it)."""
    router = APIRouter()

    @router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest))
    async def responses_create(request: Request) -> Response:
        return await guarded(request, parse_then(request, ResponsesRequest, create_response))

    @router.get("/v1/responses/{response_id}")
    async def responses_get(response_id: str, request: Request) -> Response:
        return await guarded(request, get_response(response_id, request))

    @router.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str, request: Request) -> Response:
        return await guarded(request, delete_response(response_id, request))

    @router.post("/v1/responses/{response_id}/cancel")
    async def responses_cancel(response_id: str, request: Request) -> Response:
        return await guarded(request, cancel_response(response_id, request))

    return router
