"""OpenAI's Files and Batch API shapes: the request bodies, the file and batch objects, and the
checks an input file passes before a batch runs.

A batch's input is JSONL, one request a line: `{"custom_id", "method": "POST", "url", "body"}`,
every `url` the batch's endpoint. The file as a whole is checked when the batch is created (as
OpenAI does in its `validating` status): a file that is not JSONL, is past the line limit, has a
line without a custom_id, a repeated custom_id or another endpoint fails the batch with an error
per line (its number, 1-based). A line's `body` is checked only when it runs, by the endpoint
itself: a bad body gets its own entry in the error file and the other lines run.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from tessera.errors import ConfigError

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
COMPLETION_WINDOWS = ("24h",)
FILE_PURPOSES = ("batch", "batch_output")  # what may be uploaded / what the server writes
UPLOAD_PURPOSES = ("batch",)
# OpenAI's statuses; a batch in one of ACTIVE still has work (or its files) to do.
STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled")
ACTIVE = ("in_progress", "finalizing", "cancelling")
MAX_VALIDATION_ERRORS = 100  # errors listed for a file that fails (OpenAI lists the first ones too)


@dataclass(frozen=True)
class BatchLimits:
    """What a batch may hold and how much of it runs at once (OpenAI's limits on file size and lines).

    `concurrency`: lines in flight at once over all batches; the engine admits them at background
    priority, so this only needs to keep its scheduler supplied.
    """

    max_file_bytes: int = 200 * 2**20
    max_lines: int = 50_000
    concurrency: int = 32
    priority: int = 1000  # the engine's --background-priority: lines run only in the room left

    def __post_init__(self) -> None:
        for name in ("max_file_bytes", "max_lines", "concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"batch limit {name} must be a positive integer, not {value!r}")


class CreateBatchRequest(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: Optional[dict[str, str]] = Field(default=None, max_length=16)


@dataclass(frozen=True)
class BatchLine:
    """One checked line of an input file."""

    line: int  # 1-based
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineError:
    line: Optional[int]
    code: str
    message: str
    param: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def parse_input(content: bytes, endpoint: str, limits: BatchLimits) -> tuple[list[BatchLine], list[LineError]]:
    """The lines of a batch input file, or the errors that fail it (the first
    MAX_VALIDATION_ERRORS, with their line numbers)."""
    errors: list[LineError] = []
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [LineError(content.count(b"\n", 0, exc.start) + 1, "invalid_json_line",
                              "The file is not UTF-8 text.")]
    raw_lines = text.splitlines()
    while raw_lines and not raw_lines[-1].strip():
        raw_lines.pop()
    if not raw_lines:
        return [], [LineError(None, "empty_file", "The input file has no requests.")]
    if len(raw_lines) > limits.max_lines:
        return [], [LineError(limits.max_lines + 1, "too_many_requests",
                              f"The input file has {len(raw_lines)} lines; a batch holds at most {limits.max_lines}.")]
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, 1):
        parsed = _parse_line(number, raw, endpoint, seen)
        if isinstance(parsed, LineError):
            errors.append(parsed)
            if len(errors) >= MAX_VALIDATION_ERRORS:
                break
        else:
            lines.append(parsed)
    return lines, errors


def _parse_line(number: int, raw: str, endpoint: str, seen: dict[str, int]) -> BatchLine | LineError:
    try:
        obj = json.loads(raw)
    except ValueError:
        return LineError(number, "invalid_json_line", "This line is not valid JSON.")
    if not isinstance(obj, dict):
        return LineError(number, "invalid_json_line", "This line is not a JSON object.")
    custom_id, url, method, body = obj.get("custom_id"), obj.get("url"), obj.get("method", "POST"), obj.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        return LineError(number, "missing_required_parameter", "Each line needs a custom_id string.", "custom_id")
    if custom_id in seen:
        return LineError(number, "duplicate_custom_id",
                         f"The custom_id {custom_id!r} is also on line {seen[custom_id]}; each must be unique.",
                         "custom_id")
    seen[custom_id] = number
    if method != "POST":
        return LineError(number, "invalid_method", f"The method must be POST, not {method!r}.", "method")
    if url != endpoint:
        return LineError(number, "mismatched_endpoint",
                         f"The url {url!r} is not the batch's endpoint {endpoint!r}; a batch runs one endpoint.",
                         "url")
    if not isinstance(body, dict):
        return LineError(number, "invalid_body", "Each line needs a body object.", "body")
    return BatchLine(number, custom_id, body)


def file_object(row: Any) -> dict[str, Any]:
    """OpenAI's file object."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "expires_at": None, "status_details": None}


def batch_object(row: Any, counts: tuple[int, int, int]) -> dict[str, Any]:
    """OpenAI's batch object; `counts` (total, completed, failed)."""
    errors = json.loads(row["errors"]) if row["errors"] else None
    total, completed, failed = counts
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"], "model": row["model"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        "created_at": row["created_at"], "in_progress_at": row["in_progress_at"], "expires_at": row["expires_at"],
        "finalizing_at": row["finalizing_at"], "completed_at": row["completed_at"], "failed_at": row["failed_at"],
        "expired_at": row["expired_at"], "cancelling_at": row["cancelling_at"], "cancelled_at": row["cancelled_at"],
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
