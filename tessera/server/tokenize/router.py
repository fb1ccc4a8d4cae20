"""The tokenizer routes: POST /tokenize and POST /detokenize (OpenAI-shaped errors, as vLLM's)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tessera.server.endpoint import guarded, json_body, parse_then
from tessera.server.tokenize.serving import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

REQUEST_MODELS: tuple[type[BaseModel], ...] = (TokenizeRequest, DetokenizeRequest)


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", openapi_extra=json_body(TokenizeRequest))
    async def tokenize_endpoint(request: Request) -> Response:
        return await guarded(request, parse_then(request, TokenizeRequest, tokenize))

    @router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest))
    async def detokenize_endpoint(request: Request) -> Response:
        return await guarded(request, parse_then(request, DetokenizeRequest, detokenize))

    return router
