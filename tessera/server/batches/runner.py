"""Runs batches in the gaps of interactive traffic: each line is sent through the server's own
app (the endpoint's validation, error shapes, per-key limits and metrics all apply) as its
batch's key, at the background priority, so the engine schedules it only into the room the
latency target leaves.

One asyncio task on the server's event loop keeps up to `BatchLimits.concurrency` lines in
flight over all active batches, oldest batch first. A line refused for load (429, 503, 504) waits
and is sent again; any other answer is recorded (2xx in the output file, the rest in the error
file) in the store at once. A batch with no line left is finalized; a cancelled one stops its
lines (aborting them in the engine) and keeps what was answered; one past its completion window
expires the same way.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, Optional

from starlette.types import ASGIApp, Message

from tessera.server.auth import INTERNAL_KEY
from tessera.server.batches.protocol import BatchLimits
from tessera.server.batches.store import BatchStore

logger = logging.getLogger("tessera.server")

# Load, not the line: send it again later. 504 too: a background line may wait past the server's
# --request-timeout behind interactive traffic; the batch's completion window bounds the retries.
RETRY_STATUSES = (429, 503, 504)
RETRY_DELAY_S = 0.5
IDLE_POLL_S = 1.0


class BatchRunner:
    def __init__(self, app: ASGIApp, store: BatchStore, limits: BatchLimits) -> None:
        self.app = app
        self.store = store
        self.limits = limits
        self._wake = asyncio.Event()
        self._task: Optional[asyncio.Task] = None
        # (batch id, line) -> the task running it
        self._running: dict[tuple[str, int], asyncio.Task] = {}

    def start(self) -> None:
        """Start (or resume, after a restart) every active batch."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="tessera-batches")

    async def stop(self) -> None:
        tasks = list(self._running.values()) + ([self._task] if self._task is not None else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    def wake(self) -> None:
        """A batch was created or cancelled: look again now."""
        self._wake.set()

    def in_flight(self, bid: str) -> int:
        return sum(1 for b, _ in self._running if b == bid)

    async def _loop(self) -> None:
        while True:
            try:
                self._tick()
            except Exception:  # a store fault must not end the runner; the next tick tries again
                logger.exception("batch runner")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
            except asyncio.TimeoutError:
                pass

    def _tick(self) -> None:
        """One look at every active batch: end those done, cancelled or expired; fill free slots."""
        now = time.time()
        for batch in self.store.active_batches():
            bid, status = batch["id"], batch["status"]
            if status == "in_progress" and batch["expires_at"] is not None and now >= batch["expires_at"]:
                self._stop_lines(bid)
                self.store.finish(bid, "expired", "expired_at")
                continue
            if status == "cancelling":
                self._stop_lines(bid)
                self.store.finish(bid, "cancelled", "cancelled_at")
                continue
            running = {line for b, line in self._running if b == bid}
            free = self.limits.concurrency - len(self._running)
            pending = self.store.pending_lines(bid, running, max(free, 0)) if free > 0 else []
            for row in pending:
                key = (bid, row["line"])
                self._running[key] = asyncio.get_running_loop().create_task(
                    self._run_line(batch, row["line"], row["custom_id"], json.loads(row["body"])))
            if not running and not pending and free > 0:
                self.store.set_status(bid, "finalizing", "finalizing_at")
                self.store.finish(bid, "completed", "completed_at")

    def _stop_lines(self, bid: str) -> None:
        for (b, line), task in list(self._running.items()):
            if b == bid:
                task.cancel()  # closes its generation: the engine aborts the request
                del self._running[(b, line)]

    async def _run_line(self, batch: Any, line: int, custom_id: str, body: dict[str, Any]) -> None:
        bid = batch["id"]
        try:
            body = dict(body, stream=False, priority=self.limits.priority)
            while True:
                request_id = f"batch_req_{uuid.uuid4().hex}"
                status, answer = await call_app(self.app, batch["endpoint"], body, batch["owner"], request_id)
                if status not in RETRY_STATUSES:
                    break
                await asyncio.sleep(RETRY_DELAY_S)
            result = {"id": request_id, "custom_id": custom_id,
                      "response": {"status_code": status, "request_id": request_id, "body": answer}, "error": None}
            self.store.record(bid, line, result, failed=not 200 <= status < 300)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the server's own fault on this line: it goes to the error file
            logger.exception("batch %s line %d", bid, line)
            self.store.record(bid, line, {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                                          "response": None, "error": {"code": "server_error", "message": str(exc)}},
                              failed=True)
        finally:
            if self._running.get((bid, line)) is asyncio.current_task():
                del self._running[(bid, line)]
            self._wake.set()


async def call_app(app: ASGIApp, path: str, body: dict[str, Any], owner: str,
                   request_id: str) -> tuple[int, Any]:
    """POST `body` to `path` through the whole app (middleware included) as the key named
    `owner` ("" on a server without keys); the status and the decoded JSON answer."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                         (b"x-request-id", request_id.encode())],
             "client": ("batch", 0), "server": ("batch", 0), INTERNAL_KEY: owner}
    sent = False
    never = asyncio.Event()

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()  # no disconnect: the line runs until it ends or is cancelled
        return {"type": "http.disconnect"}

    status, parts = 500, []

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))

    await app(scope, receive, send)
    data = b"".join(parts)
    try:
        return status, json.loads(data) if data else None
    except ValueError:
        return status, data.decode("utf-8", "replace")
