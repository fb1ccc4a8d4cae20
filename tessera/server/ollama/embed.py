"""Ollama's embedding routes: POST /api/embed and the older POST /api/embeddings.

Shapes as Ollama has them: `/api/embed` takes `{"model", "input": text or list of texts,
"truncate", "dimensions", "options", "keep_alive"}` and answers `{"model", "embeddings":
[[...]], "total_duration", "load_duration", "prompt_eval_count"}` (durations in
nanoseconds), vectors L2-normalised; `/api/embeddings` takes `{"model", "prompt"}` and
answers `{"embedding": [...]}`, the pooled vector as the model gives it (Ollama does not
normalise on this route). Errors are `{"error": "..."}` with the status Ollama would use.
Both run through `embeddings.embed`, the engine path /v1/embeddings takes.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from tessera.pooling_params import PoolingParams
from tessera.server.openai.embeddings import Embedded, as_inputs, embed
from tessera.server.ollama.serving import keep_alive_seconds
from tessera.server.ollama.protocol import KeepAlive
from tessera.server.serving import ServerState

class OllamaEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    input: Union[str, list[str]]
    truncate: bool = True
    dimensions: Optional[int] = None
    options: Optional[dict[str, Any]] = None
    keep_alive: KeepAlive = None


class OllamaEmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    prompt: str
    options: Optional[dict[str, Any]] = None
    keep_alive: KeepAlive = None


async def _embed(state: ServerState, request: Request, model: str, inputs: list[Union[str, list[int]]],
                 pooling: PoolingParams, endpoint: str, keep_alive: KeepAlive = None) -> Union[Embedded, Response]:
    served = state.router.resolve(model)  # 404 for an unknown model
    keep = keep_alive_seconds(keep_alive, served)
    route = await state.route(model, request)
    try:
        return await embed(state, request, route, inputs, pooling, endpoint)
    finally:
        state.router.set_keep_alive(route.model, keep)


async def api_embed(body: OllamaEmbedRequest, request: Request) -> Response:
    state: ServerState = request.app.state.tessera
    inputs = as_inputs(body.input, "input")
    result = await _embed(state, request, body.model, inputs,
                          PoolingParams(normalize=True, dimensions=body.dimensions, truncate=body.truncate),
                          "/api/embed", body.keep_alive)
    if isinstance(result, Response):
        return result
    return result.run.json({"model": body.model, "embeddings": result.vectors,
                            "total_duration": int(result.seconds * 1e9), "load_duration": 0,
                            "prompt_eval_count": result.prompt_tokens})


async def api_embeddings(body: OllamaEmbeddingsRequest, request: Request) -> Response:
    state: ServerState = request.app.state.tessera
    if not body.prompt:  # Ollama answers an empty prompt with an empty embedding
        state.router.resolve(body.model)
        return JSONResponse({"embedding": []})
    result = await _embed(state, request, body.model, [body.prompt], PoolingParams(normalize=False),
                          "/api/embeddings", body.keep_alive)
    if isinstance(result, Response):
        return result
    return result.run.json({"embedding": result.vectors[0]})
