"""OpenAI's routes: POST /v1/completions, /v1/chat/completions and /v1/embeddings."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tessera.server.endpoint import guarded, json_body, parse_then
from tessera.server.openai.chat import create_chat_completion
from tessera.server.openai.completions import create_completion
from tessera.server.openai.embeddings import EmbeddingRequest, create_embedding
from tessera.server.openai.protocol import ChatCompletionRequest, CompletionRequest

REQUEST_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, EmbeddingRequest)


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await guarded(request, parse_then(request, CompletionRequest, create_completion))

    @router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await guarded(request, parse_then(request, ChatCompletionRequest, create_chat_completion))

    @router.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        return await guarded(request, parse_then(request, EmbeddingRequest, create_embedding))

    return router
