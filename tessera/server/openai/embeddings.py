"""POST /v1/embeddings: OpenAI's embeddings API, served by the same engine machinery.

Each input becomes one engine request with pooling parameters (vLLM's pooling task): the
scheduler batches them as prefill-only chunks, the runner returns each one's pooled vector,
and nothing is sampled or kept. The whole API request passes the queue bound once (a
batch of inputs is one request of the client's) and shares one deadline, so a full queue
is a 429 and a slow one a 504, as for completions. `embed` is what the Ollama routes
(server/ollama/embed.py) call too.
"""
from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass
from typing import Literal, Optional, Protocol, Union, runtime_checkable

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from tessera.engine.errors import QueueFullError
from tessera.pooling_params import PoolingParams
from tessera.sampling_params import InvalidRequestError, SamplingParams
from tessera.server.auth import request_priority
from tessera.server.errors import APIError
from tessera.server.openai.protocol import Prompt, prompt_list
from tessera.server.openai.schema_base import OpenAIModel
from tessera.server.openai.response_models import UsageInfo
from tessera.server.model_router import Route
from tessera.server.serving import Run, ServerState, record_usage

# OpenAI's own limit on inputs per request; also what keeps one body from queueing 10,000 requests.
MAX_INPUTS = 2048


class EmbeddingRequest(OpenAIModel):
    model: Optional[str] = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    priority: Optional[int] = None  # vLLM extension, as on completions; None: the API key's default

    def inputs(self) -> list[Union[str, list[int]]]:
        """The inputs as engine prompts: texts or token-id lists, one request each."""
        return as_inputs(self.input, "input")


def as_inputs(value: Prompt, field: str) -> list[Union[str, list[int]]]:
    """A string, list of strings, token ids or lists of them as a list of inputs; 400 when empty,
    with an empty entry, or with more than MAX_INPUTS."""
    items = prompt_list(value, field)
    if len(items) > MAX_INPUTS:
        raise InvalidRequestError(f"{field} has {len(items)} entries; at most {MAX_INPUTS} are allowed per request")
    return items


@runtime_checkable
class EndpointSink(Protocol):
    """Something counting a model's requests per API endpoint (its PrometheusStatLogger)."""

    def record_endpoint(self, endpoint: str, prompt_tokens: int) -> None: ...


@dataclass
class Embedded:
    """An embedding request's results, in input order."""

    run: Run
    vectors: list[list[float]]
    prompt_tokens: int
    seconds: float  # from the request's arrival at the handler to its last vector


async def embed(state: ServerState, request: Request, route: Route, inputs: list[Union[str, list[int]]],
                pooling: PoolingParams, endpoint: str, priority: Optional[int] = None) -> Union[Embedded, Response]:
    """Run `inputs` through `route`'s engine as embedding requests; the vectors, or the response
    to send instead (the client left). Errors are raised as APIError (OpenAI's shape; the Ollama
    routes reshape them)."""
    t0 = time.perf_counter()
    try:
        params = SamplingParams(priority=request_priority(request.scope, priority))
    except ValueError as exc:  # a priority past 64 bits
        raise InvalidRequestError(str(exc)) from exc
    run = Run(state, request, route, inputs, params, f"embd-{uuid.uuid4().hex}", pooling=pooling)
    engine = run.engine  # a model that cannot embed is refused here (400)
    limit = engine.max_num_queued_requests
    if limit is not None and engine.num_queued(params.priority) >= limit:
        raise run.error(QueueFullError(f"the server has {limit} requests waiting; retry later"))
    finals = await run.collect()
    if isinstance(finals, Response):
        return finals
    vectors = []
    for i in range(len(inputs)):
        vector = finals[i].embedding
        if vector is None:  # ended by the engine before its step ran (aborted at a restart or a shutdown)
            raise APIError(503, "The embedding request was ended before it was computed; retry.", type="server_error",
                           code="request_aborted")
        vectors.append(vector)
    tokens = sum(len(out.prompt_token_ids) for out in finals.values())
    record_usage(request, UsageInfo(prompt_tokens=tokens, total_tokens=tokens))
    sink = route.model.metrics
    if isinstance(sink, EndpointSink):
        sink.record_endpoint(endpoint, tokens)
    return Embedded(run, vectors, tokens, time.perf_counter() - t0)


def encode_vector(vector: list[float], encoding_format: str) -> Union[list[float], str]:
    """OpenAI's base64 form is the little-endian float32 bytes of the vector."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
    state: ServerState = request.app.state.tessera
    state.router.resolve(body.model)  # 404 before anything else
    inputs = body.inputs()
    route = await state.route(body.model, request)
    result = await embed(state, request, route, inputs, PoolingParams(dimensions=body.dimensions), "/v1/embeddings",
                         body.priority)
    if isinstance(result, Response):
        return result
    # Plain dicts: validating a response model's every float cost more than the JSON encoding.
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(v, body.encoding_format)}
            for i, v in enumerate(result.vectors)]
    return result.run.json({"object": "list", "data": data, "model": route.reported,
                            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}})
