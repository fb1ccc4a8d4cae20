"""The request plumbing every API's routes share: the body read with a size limit and parsed
by the route's own pydantic model, the guard that turns any failure into the API's error
shape, and the request schemas /docs shows.

Bodies are parsed here rather than by FastAPI so that JSON is accepted whatever the
Content-Type (curl -d sends a form type) and every schema error is the same 400.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from tessera.server.errors import APIError, validation_error
from tessera.server.serving import CLIENT_CLOSED_REQUEST, ServerState

RequestModel = TypeVar("RequestModel", bound=BaseModel)
Handler = Callable[[RequestModel, Request], Awaitable[Response]]

# Largest request body read: a 4k-token prompt as text or ids is well under 1 MiB, a long chat
# history a few MiB; past this a client gets a 413 before the server buffers the rest.
MAX_REQUEST_BODY_BYTES = 16 * 2**20


def server_state(request: Request) -> ServerState:
    return request.app.state.tessera


async def guarded(request: Request, handler: Awaitable[Response]) -> Response:
    """Every failure inside a handler becomes an OpenAI-style error response; the server stays up."""
    try:
        return await handler
    except APIError as exc:
        return exc.response()
    except Exception as exc:
        return server_state(request).error(exc).response()


async def parse_then(request: Request, model: type[RequestModel], handler: Handler) -> Response:
    """Read the body (413 past the limit), validate it as `model` (400), then run `handler`; a
    draining server takes nothing new (503)."""
    if server_state(request).draining:
        raise APIError(503, "The server is shutting down and takes no new requests.", type="server_error",
                       code="server_shutting_down", headers={"Retry-After": "5"})
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REQUEST_BODY_BYTES:
        raise _body_too_large()
    try:
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > MAX_REQUEST_BODY_BYTES:
                raise _body_too_large()
            parts.append(part)
        raw = b"".join(parts)
    except ClientDisconnect:
        request.state.outcome = "client disconnected while sending the body"
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    return await handler(body, request)


def _body_too_large() -> APIError:
    return APIError(413, f"The request body is larger than the server's limit of {MAX_REQUEST_BODY_BYTES // 2**20} "
                         "MiB.", code="request_too_large")


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The request body for /docs, since it is not a FastAPI parameter (see add_request_schemas)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def add_request_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put each route's request model into the OpenAPI components that json_body refers to."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
