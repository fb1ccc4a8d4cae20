"""The Messages routes: POST /v1/messages and /v1/messages/count_tokens, errors in Anthropic's shape."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tessera.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from tessera.server.anthropic.serving import anthropic_errors, count_tokens, create_message
from tessera.server.endpoint import guarded, json_body, parse_then

REQUEST_MODELS: tuple[type[BaseModel], ...] = (MessagesRequest, CountTokensRequest)


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages", openapi_extra=json_body(MessagesRequest))
    async def messages_create(request: Request) -> Response:
        return await anthropic_errors(guarded(request, parse_then(request, MessagesRequest, create_message)))

    @router.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest))
    async def messages_count_tokens(request: Request) -> Response:
        return await anthropic_errors(guarded(request, parse_then(request, CountTokensRequest, count_tokens)))

    return router
