"""The access log: one info line per HTTP request, and the per-route request metrics."""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.server.auth import CLIENT_REQUEST_ID, request_key
from tessera.server.serving import HTTPRequestSink, ServerState

access_logger = logging.getLogger("tessera.server.access")


class AccessLog:
    """One info line per HTTP request, written when its response has been sent (or abandoned):
    client, method, path, status, duration, and for generation requests the id and token counts."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: Optional[int] = None
        request_state: dict[str, Any] = scope.setdefault("state", {})
        request_state["received_at"] = time.time()  # the arrival --record-traffic writes
        server: Optional[ServerState] = getattr(scope["app"].state, "tessera", None) if "app" in scope else None

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        generating = scope["method"] == "POST" and scope["path"].startswith(("/v1/", "/api/"))
        if server is not None and generating:
            server.active_requests += 1
        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            if server is not None and generating:
                server.active_requests -= 1
            elapsed = time.perf_counter() - start
            route = getattr(scope.get("route"), "path", None)  # the matched route's template
            if server is not None and route is not None and isinstance(server.metrics, HTTPRequestSink):
                server.metrics.record_http_request(route, scope["method"], status if status is not None else 500,
                                                   elapsed)
            client = scope.get("client")
            line = (f'{client[0] if client else "-"} "{scope["method"]} {scope["path"]}" '
                    f"{status if status is not None else 500} {elapsed * 1000:.1f}ms")
            if "request_id" in request_state:
                line += f" id={request_state['request_id']}"
            if CLIENT_REQUEST_ID in request_state:
                line += f" req={request_state[CLIENT_REQUEST_ID]}"
            grant = request_key(scope)
            if grant is not None:
                line += f" key={grant[0].name}"
            usage = request_state.get("usage")
            if usage is not None:
                line += f" prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens}"
            if "outcome" in request_state:
                line += f" ({request_state['outcome']})"
            access_logger.info(line)
