"""Errors that cross the engine's boundary, in one place.

The server maps each to an HTTP status (server/errors.py); the engine core, its
process client and the async front end raise them. Keeping them here means no
module imports another one's internals (or imports inside functions) only to
name an exception.
"""
from __future__ import annotations

from typing import Optional


class StepFailedError(Exception):
    """A step raised; the requests it touched were failed and freed, the engine goes on.

    `request_ids` are the (parent) requests that were ended; `cause` is the original error.
    """

    def __init__(self, request_ids: list[str], cause: BaseException,
                 errors: Optional[dict[str, BaseException]] = None) -> None:
        super().__init__(f"the engine step failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids
        self.cause = cause
        # A request's own error where it is not the step's (an engine-core process refusing its
        # constraint: InvalidRequestError, HTTP 400); the others get EngineStepError (HTTP 500).
        self.errors = errors or {}


class EngineCoreDiedError(Exception):
    """The engine-core process exited; the requests it was running are lost (it can be restarted)."""


class EngineCoreStepError(Exception):
    """A step failed inside the engine-core process (its message); the core serves on."""


class QueueFullError(Exception):
    """The waiting queue is at --max-num-queued-requests; try again later (HTTP 429)."""

    def __init__(self, message: str, retry_after: Optional[float] = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds the client should wait, when known


class PredictedWaitError(QueueFullError):
    """The step-cost model says the request would wait past its deadline: refused now (HTTP 429)
    rather than timed out later, with the blocks and time it would have taken left to others."""


class EngineStepError(Exception):
    """The engine step running this request failed; the request was ended (HTTP 500), the
    engine serves on."""


class EngineDeadError(Exception):
    """The engine loop stopped after an internal error (HTTP 503)."""
