"""OpenAI-style error responses, and the one place exceptions become HTTP statuses.

Every error the server sends has the body
`{"error": {"message", "type", "param", "code"}}`. Bad input is always a 4xx;
only a fault of the server itself is a 5xx, and it never takes the server down.
"""
from __future__ import annotations

import json
import logging
import math
import re
from http import HTTPStatus
from typing import Any, Optional, Sequence, TypeVar, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.errors import AdapterError
from tessera.sampling_params import InvalidRequestError
from tessera.server.openai.protocol import REQUEST_FIELDS, UNION_FIELDS
from tessera.server.openai.response_models import ErrorInfo, ErrorResponse

logger = logging.getLogger("tessera.server")

Model = TypeVar("Model", bound=BaseModel)

# Seconds a client told "queue full" should wait before trying again.
RETRY_AFTER_SECONDS = 1
MAX_RETRY_AFTER_SECONDS = 600


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields, raised anywhere in a handler."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Union[str, int, None] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        """The error as a server-sent event, for a stream whose headers are already out."""
        return f"data: {json.dumps(self.body())}\n\n"


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def request_timeout(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within the server's request timeout ({seconds:g}s) "
                         "and was aborted.", type="timeout_error", code="request_timeout")


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down; the request was aborted.", type="server_error",
                    code="server_shutting_down")


def api_error_from(exc: BaseException) -> APIError:
    """Map any exception from parsing, admission or generation to the error the client sees."""
    # Imported here: the engine module pulls in torch, which the error paths never need first.
    from tessera.engine.errors import EngineDeadError, EngineStepError, PredictedWaitError, QueueFullError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        message = str(exc) or "invalid request"
        first_word = message.split()[0]
        return APIError(400, message, param=first_word if first_word in REQUEST_FIELDS else None)
    if isinstance(exc, AdapterError):  # a LoRA adapter file that cannot serve on its base
        return APIError(400, str(exc) or "invalid LoRA adapter", code="invalid_lora_adapter")
    if isinstance(exc, QueueFullError):
        retry = RETRY_AFTER_SECONDS if exc.retry_after is None else \
            min(MAX_RETRY_AFTER_SECONDS, max(1, math.ceil(exc.retry_after)))
        if isinstance(exc, PredictedWaitError):
            return APIError(429, f"Server overloaded: {exc}", type="rate_limit_error",
                            code="queue_wait_exceeds_deadline", headers={"Retry-After": str(retry)})
        return APIError(429, f"Request queue full: {exc}",
                        type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(retry)})
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), type="server_error", code="engine_step_failed")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine has stopped and cannot serve requests: {exc}",
                        type="server_error", code="engine_dead")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}", type="server_error",
                    code="internal_error")


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*|function-.*)$")


def validation_error(errors: Sequence[Any]) -> APIError:
    """A 400 from pydantic's error list: one readable line, and the offending top-level field as param."""
    if not errors:
        return APIError(400, "Invalid request body.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON: {detail}".rstrip(": "))
    # Drop FastAPI's "body" prefix and the union-member tags pydantic adds (e.g. prompt.list[int].0).
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_TAG.match(str(p))]
    if not loc:
        return APIError(400, f"The request body must be a JSON object: {first.get('msg', 'invalid value')}")
    param = loc[0]
    where = ".".join(loc)
    same_field = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"
                                        and not _UNION_TAG.match(str(p))][:len(loc)] == loc]
    if loc[-1] in UNION_FIELDS and len(same_field) > 1:
        return APIError(400, f"{where} must be {UNION_FIELDS[loc[-1]]}", param=param)
    message = f"{where}: {first.get('msg', 'invalid value')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param)


def validated(model: type[Model], fields: dict[str, Any]) -> Model:
    """`model` from fields another API's request was translated into; a value it refuses (a tool
    name the chat request does not allow, say) is a 400 like any other."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def install_error_handlers(app: FastAPI) -> None:
    """Replace FastAPI's 422 and HTML/plain error bodies with OpenAI-style JSON."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "Error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        err = APIError(exc.status_code, message, type="invalid_request_error" if exc.status_code < 500
                       else "server_error", code=exc.status_code)
        err.headers = dict(exc.headers) if exc.headers else None
        return err.response()

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return api_error_from(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return api_error_from(exc).response()
