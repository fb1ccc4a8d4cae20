"""Ollama's routes: /api/chat, /api/generate, /api/show, /api/tags, /api/ps, /api/version,
/api/embed and /api/embeddings, every error in Ollama's `{"error": ...}` shape."""
from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from tessera import __version__
from tessera.server.endpoint import RequestModel, json_body, parse_then

from tessera.server.ollama.embed import OllamaEmbeddingsRequest, OllamaEmbedRequest, api_embed, api_embeddings
from tessera.server.ollama.models import ps, show, tags
from tessera.server.ollama.protocol import OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest
from tessera.server.ollama.serving import chat, generate, ollama_guarded

# The Ollama release whose API this one follows; clients read /api/version to decide what a
# server supports (tool calls, JSON-schema formats), so it names Ollama's version, not Tessera's.
OLLAMA_VERSION = "0.12.0"

REQUEST_MODELS: tuple[type[BaseModel], ...] = (OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest,
                                               OllamaEmbedRequest, OllamaEmbeddingsRequest)


def build_router(root: bool) -> APIRouter:
    """Ollama's endpoints. `root`: also answer GET/HEAD / with "Ollama is running", as Ollama
    does (for a server without the chat page there)."""
    router = APIRouter(tags=["ollama"])

    def post(path: str, model: type[RequestModel], handler: Callable[[RequestModel, Request], Awaitable[Response]],
             summary: str) -> None:
        async def endpoint(request: Request) -> Response:
            return await ollama_guarded(request, parse_then(request, model, handler))

        router.add_api_route(path, endpoint, methods=["POST"], name=f"ollama_{path.rsplit('/', 1)[-1]}",
                             openapi_extra={**json_body(model), "summary": summary})

    post("/api/chat", OllamaChatRequest, chat, "Ollama: chat")
    post("/api/generate", OllamaGenerateRequest, generate, "Ollama: generate")
    post("/api/show", OllamaShowRequest, show, "Ollama: one model's details")
    post("/api/embed", OllamaEmbedRequest, api_embed, "Ollama: embed texts")
    post("/api/embeddings", OllamaEmbeddingsRequest, api_embeddings, "Ollama (older API): embed one prompt")

    @router.get("/api/tags")
    async def ollama_tags(request: Request) -> Response:
        return await ollama_guarded(request, tags(request))

    @router.get("/api/ps")
    async def ollama_ps(request: Request) -> Response:
        return await ollama_guarded(request, ps(request))

    @router.get("/api/version")
    async def ollama_version() -> Response:
        return JSONResponse({"version": OLLAMA_VERSION, "tessera": __version__})

    if root:
        @router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
        async def ollama_root() -> Response:
            return PlainTextResponse("Ollama is running")

    return router



