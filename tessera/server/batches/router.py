"""OpenAI's Files and Batch API: POST/GET /v1/files, GET/DELETE /v1/files/{id}, GET
/v1/files/{id}/content, POST/GET /v1/batches, GET /v1/batches/{id}, POST /v1/batches/{id}/cancel.

Files and batches belong to the API key that made them (another key gets 404, as for an id that
does not exist). Uploads are multipart/form-data (`file`, `purpose`), as the openai client sends
them, parsed with the standard library's MIME parser so the server needs no multipart package.
"""
from __future__ import annotations

import email.parser
import email.policy
from typing import Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tessera.server.auth import request_key
from tessera.server.batches.protocol import (
    COMPLETION_WINDOWS, ENDPOINTS, UPLOAD_PURPOSES, BatchLimits, CreateBatchRequest, batch_object, file_object,
    list_object, parse_input)
from tessera.server.batches.runner import BatchRunner
from tessera.server.batches.store import BatchStore
from tessera.server.endpoint import guarded, json_body, parse_then
from tessera.server.errors import APIError

REQUEST_MODELS = (CreateBatchRequest,)


def owner_of(request: Request) -> str:
    grant = request_key(request.scope)
    return grant[0].name if grant is not None else ""


def _batches(request: Request) -> tuple[BatchStore, BatchRunner, BatchLimits]:
    state = getattr(request.app.state, "batches", None)
    if state is None:
        raise APIError(404, "The Batch API is off on this server.", code="not_found")
    return state


def _not_found(what: str, ident: str) -> APIError:
    return APIError(404, f"No {what} found with id '{ident}'.", code="not_found")


async def _read_upload(request: Request, limit: int) -> tuple[str, str, bytes]:
    """(filename, purpose, content) of a multipart upload; 400 for anything else, 413 past `limit`."""
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise APIError(400, "Upload a file as multipart/form-data with the fields `file` and `purpose`.",
                       param="file")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + 65536:
        raise APIError(413, f"The file is larger than the server's limit of {limit} bytes.", code="file_too_large")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit + 65536:
            raise APIError(413, f"The file is larger than the server's limit of {limit} bytes.", code="file_too_large")
        parts.append(part)
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + ctype.encode("latin-1") + b"\r\n\r\n" + b"".join(parts))
    fields: dict[str, tuple[Optional[str], bytes]] = {}
    for part in message.iter_parts() if message.is_multipart() else ():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    if "file" not in fields:
        raise APIError(400, "The upload has no `file` field.", param="file")
    purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
    if purpose not in UPLOAD_PURPOSES:
        raise APIError(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, not {purpose!r}.", param="purpose")
    filename, content = fields["file"]
    if len(content) > limit:
        raise APIError(413, f"The file has {len(content)} bytes; the server's limit is {limit}.", code="file_too_large")
    return filename or "upload.jsonl", purpose, content


async def create_file(request: Request) -> Response:
    store, _, limits = _batches(request)
    filename, purpose, content = await _read_upload(request, limits.max_file_bytes)
    return JSONResponse(file_object(store.add_file(owner_of(request), filename, purpose, content)))


async def create_batch(body: CreateBatchRequest, request: Request) -> Response:
    store, runner, limits = _batches(request)
    owner = owner_of(request)
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, not {body.endpoint!r}.",
                       param="endpoint")
    if body.completion_window not in COMPLETION_WINDOWS:
        raise APIError(400, f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}.",
                       param="completion_window")
    meta = store.get_file(body.input_file_id, owner)
    content = store.file_content(body.input_file_id, owner)
    if meta is None or content is None:
        raise _not_found("file", body.input_file_id)
    if meta["purpose"] != "batch":
        raise APIError(400, f"The file {body.input_file_id} has purpose {meta['purpose']!r}, not 'batch'.",
                       param="input_file_id")
    lines, errors = parse_input(content, body.endpoint, limits)
    row = store.create_batch(owner, body.endpoint, body.input_file_id, body.completion_window, body.metadata,
                             lines, errors)
    runner.wake()
    return JSONResponse(batch_object(row, store.counts(row["id"])))


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/files")
    async def files_create(request: Request) -> Response:
        return await guarded(request, create_file(request))

    @router.get("/v1/files")
    async def files_list(request: Request, purpose: Optional[str] = None, limit: int = 100) -> Response:
        store, _, _ = _batches(request)
        rows = store.list_files(owner_of(request), purpose, max(1, min(limit, 10_000)))
        return JSONResponse(list_object([file_object(r) for r in rows], False))

    @router.get("/v1/files/{file_id}")
    async def files_get(file_id: str, request: Request) -> Response:
        store, _, _ = _batches(request)
        row = store.get_file(file_id, owner_of(request))
        if row is None:
            return _not_found("file", file_id).response()
        return JSONResponse(file_object(row))

    @router.delete("/v1/files/{file_id}")
    async def files_delete(file_id: str, request: Request) -> Response:
        store, _, _ = _batches(request)
        if not store.delete_file(file_id, owner_of(request)):
            return _not_found("file", file_id).response()
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @router.get("/v1/files/{file_id}/content")
    async def files_content(file_id: str, request: Request) -> Response:
        store, _, _ = _batches(request)
        content = store.file_content(file_id, owner_of(request))
        if content is None:
            return _not_found("file", file_id).response()
        return Response(content, media_type="application/jsonl")

    @router.post("/v1/batches", openapi_extra=json_body(CreateBatchRequest))
    async def batches_create(request: Request) -> Response:
        return await guarded(request, parse_then(request, CreateBatchRequest, create_batch))

    @router.get("/v1/batches")
    async def batches_list(request: Request, limit: int = 20, after: Optional[str] = None) -> Response:
        store, _, _ = _batches(request)
        limit = max(1, min(limit, 100))
        rows = store.list_batches(owner_of(request), limit + 1, after)
        return JSONResponse(list_object([batch_object(r, store.counts(r["id"])) for r in rows[:limit]],
                                        len(rows) > limit))

    @router.get("/v1/batches/{batch_id}")
    async def batches_get(batch_id: str, request: Request) -> Response:
        store, _, _ = _batches(request)
        row = store.get_batch(batch_id, owner_of(request))
        if row is None:
            return _not_found("batch", batch_id).response()
        return JSONResponse(batch_object(row, store.counts(batch_id)))

    @router.post("/v1/batches/{batch_id}/cancel")
    async def batches_cancel(batch_id: str, request: Request) -> Response:
        store, runner, _ = _batches(request)
        owner = owner_of(request)
        row = store.get_batch(batch_id, owner)
        if row is None:
            return _not_found("batch", batch_id).response()
        if row["status"] == "in_progress":
            store.set_status(batch_id, "cancelling", "cancelling_at")
            runner.wake()
        elif row["status"] not in ("cancelling", "cancelled"):
            return APIError(409, f"Batch {batch_id} is {row['status']} and cannot be cancelled.",
                            code="invalid_state").response()
        row = store.get_batch(batch_id, owner)
        return JSONResponse(batch_object(row, store.counts(batch_id)))

    return router
