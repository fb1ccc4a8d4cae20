"""Who may call what: the route policy, and the middleware that applies the API keys (what a key
is and where keys come from: tessera/server/api_keys.py) with each key's limits from
tessera/server/ratelimit.py.

Every route of the app has an entry in ROUTE_SCOPES (a test walks the route table and fails on
one without), so a route added later is closed until someone decides who may call it. A key is
checked by comparing SHA-256 digests with `hmac.compare_digest` against every configured key, so
neither the comparison nor the position of a match shows in the time taken.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import re
import uuid
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Optional

from starlette.responses import JSONResponse
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.server.api_keys import ADMIN, INFERENCE, METRICS, AccessSettings, ApiKey
from tessera.server.errors import APIError
from tessera.server.ratelimit import FairShare, KeyLimiter, KeyMeter, Refusal

if TYPE_CHECKING:
    from tessera.metrics import MetricFamilies

logger = logging.getLogger("tessera.server")

# Not scopes a key holds: what a route needs. PUBLIC is open to anyone; UI are the browser pages'
# static shells (no data: the pages ask for a key when the API answers 401); METRICS is open
# unless --metrics-require-key.
PUBLIC, UI = "public", "ui"
KEY_STATE = "tessera_key"  # the request's KeyMeter in the ASGI scope's state
CLIENT_REQUEST_ID = "client_request_id"  # the x-request-id echoed, in the ASGI scope's state
# In an ASGI scope the server built itself (a batch's line, never one from the socket): the name
# of the key the request runs as, in place of the key's secret.
INTERNAL_KEY = "tessera.run_as_key"
_PARAM = re.compile(r"\{[^}]*\}")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")

# The scope each route needs, by its path with parameters written `{}`. Routes served by other
# modules are listed before they exist, so adding them needs no change here.
ROUTE_SCOPES: Mapping[str, str] = MappingProxyType({
    "/health": PUBLIC,
    "/": UI, "/dashboard": UI, "/static": UI,
    "/metrics": METRICS,
    # OpenAI
    "/v1/completions": INFERENCE, "/v1/chat/completions": INFERENCE, "/v1/embeddings": INFERENCE,
    "/v1/models": INFERENCE, "/v1/models/{}": INFERENCE,
    "/v1/responses": INFERENCE, "/v1/responses/{}": INFERENCE, "/v1/responses/{}/cancel": INFERENCE,
    "/v1/responses/{}/input_items": INFERENCE,
    "/v1/files": INFERENCE, "/v1/files/{}": INFERENCE, "/v1/files/{}/content": INFERENCE,
    "/v1/batches": INFERENCE, "/v1/batches/{}": INFERENCE, "/v1/batches/{}/cancel": INFERENCE,
    "/tokenize": INFERENCE, "/detokenize": INFERENCE,
    "/openapi.json": INFERENCE, "/docs": INFERENCE, "/docs/oauth2-redirect": INFERENCE,
    # Anthropic
    "/v1/messages": INFERENCE, "/v1/messages/count_tokens": INFERENCE,
    # Ollama
    "/api/chat": INFERENCE, "/api/generate": INFERENCE, "/api/embed": INFERENCE, "/api/embeddings": INFERENCE,
    "/api/tags": INFERENCE, "/api/show": INFERENCE, "/api/ps": INFERENCE, "/api/version": INFERENCE,
    "/api/pull": ADMIN, "/api/push": ADMIN, "/api/create": ADMIN, "/api/copy": ADMIN, "/api/delete": ADMIN,
    "/api/blobs/{}": ADMIN,
    # the server itself: what it runs, and changing it
    "/v1/engine/stats": ADMIN, "/v1/engine/live": ADMIN, "/v1/engine/replicas": ADMIN,
    "/v1/load_lora_adapter": ADMIN, "/v1/unload_lora_adapter": ADMIN,
})


def policy_path(path: str) -> str:
    """A route's path as ROUTE_SCOPES spells it: every parameter becomes `{}`."""
    return _PARAM.sub("{}", path)


def route_scope(path: str) -> Optional[str]:
    """The scope a route (by its declared path) needs; None: the route has no policy."""
    return ROUTE_SCOPES.get(policy_path(path))


def error_shape(path: str) -> str:
    """Whose error body a path answers with: Anthropic's on /v1/messages, Ollama's on /api/."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    408: "timeout_error", 429: "rate_limit_error"}


def error_response(path: str, status: int, message: str, *, type: str, code: Optional[str],
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """An error in the API's own shape for `path` (OpenAI's, Anthropic's or Ollama's)."""
    shape = error_shape(path)
    if shape == "anthropic":
        body: dict[str, Any] = {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                                           "message": message}}
    elif shape == "ollama":
        body = {"error": message}
    else:
        body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class KeyMetrics:
    """Per-key Prometheus metrics, labelled with the key's name (never the key)."""

    def __init__(self, families: MetricFamilies) -> None:
        from prometheus_client import Counter, Gauge

        from tessera.metrics import PREFIX

        self.requests = families.get(Counter, PREFIX + "api_key_requests", "HTTP requests by API key and status.",
                                     ["key_name", "status"])
        self.tokens = families.get(Counter, PREFIX + "api_key_tokens",
                                   "Tokens charged to an API key (prompt and generation).", ["key_name", "kind"])
        self.rate_limited = families.get(Counter, PREFIX + "api_key_rate_limited",
                                         "Requests refused with 429 by a per-key limit (rpm, tpm, concurrency, "
                                         "queue_share).", ["key_name", "limit"])
        self.running = families.get(Gauge, PREFIX + "api_key_requests_running",
                                    "HTTP requests running, by API key.", ["key_name"])
        self.auth_failures = families.get(Counter, PREFIX + "auth_failures",
                                          "Requests refused by authentication or authorization (missing, "
                                          "invalid, scope, model).", ["reason"])

    def count_tokens(self, key: str, prompt: int, generated: int) -> None:
        if prompt:
            self.tokens.labels(key, "prompt").inc(prompt)
        if generated:
            self.tokens.labels(key, "generation").inc(generated)


class AccessControl:
    """ASGI middleware: request ids, authentication, scopes and per-key limits.

    Every HTTP request gets an `x-request-id` (the client's, if it sent a sane one) echoed on the
    response. With keys configured, each request's route is looked up in ROUTE_SCOPES: a request
    without a valid key gets 401 (`WWW-Authenticate: Bearer`), a key without the route's scope
    403, a key over one of its limits 429 with `Retry-After` and OpenAI's x-ratelimit-* headers.
    A path no route matches needs a valid key too (it then gets the router's 404), so a caller
    without one learns nothing about what is served. The admin routes are 404 for everyone when
    the server listens beyond loopback and no key has the admin scope."""

    def __init__(self, app: ASGIApp, settings: AccessSettings, *, beyond_loopback: bool = False,
                 families: Optional[MetricFamilies] = None) -> None:
        self.app = app
        self.settings = settings
        self.keys = settings.keys
        self.digests = [bytes.fromhex(k.sha256) for k in self.keys]
        self.admin_enabled = settings.has_admin_key or not beyond_loopback
        self.limiters = {k.name: KeyLimiter(k.name, k.rpm, k.tpm, k.max_concurrent) for k in self.keys}
        self.by_name = {k.name: k for k in self.keys}
        self.fair = FairShare(sum(1 for k in self.keys if k.has(INFERENCE)))
        self.metrics = KeyMetrics(families) if families is not None and self.keys else None
        self._routes: Optional[list[tuple[Any, Optional[str]]]] = None

    def _route_table(self, scope: Scope) -> list[tuple[Any, Optional[str]]]:
        if self._routes is None:
            routes = scope["app"].router.routes if "app" in scope else []
            self._routes = [(r, route_scope(r.path)) for r in routes]
        return self._routes

    def needed_scope(self, scope: Scope) -> tuple[bool, Optional[str]]:
        """(whether a route matches, the scope it needs); an unlisted route needs admin."""
        partial: Optional[tuple[bool, Optional[str]]] = None
        for route, needed in self._route_table(scope):
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return True, needed or ADMIN
            if match == Match.PARTIAL and partial is None:
                partial = True, needed or ADMIN
        return partial if partial is not None else (False, None)

    def authenticate(self, scope: Scope) -> tuple[Optional[ApiKey], bool]:
        """(the key presented, whether one was presented at all)."""
        secret = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    secret = token.strip()
            elif name == b"x-api-key" and secret is None:
                secret = value.decode("latin-1").strip()
        if not secret:
            return None, False
        presented = hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()
        found = None
        for key, digest in zip(self.keys, self.digests):  # every key compared: no early exit
            if hmac.compare_digest(presented, digest):
                found = key
        return found, True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        request_id = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                text = value.decode("latin-1")
                request_id = text if _REQUEST_ID.fullmatch(text) else None
        request_id = request_id or uuid.uuid4().hex
        state[CLIENT_REQUEST_ID] = request_id
        extra = [(b"x-request-id", request_id.encode())]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + extra
            await send(message)

        matched, needed = self.needed_scope(scope)
        if needed == ADMIN and not self.admin_enabled:
            await self._refuse(scope, receive, send_with_headers, 404, "Not Found", "invalid_request_error", "404")
            return
        if not self.keys or needed in (PUBLIC, UI) or (needed == METRICS and not self.settings.metrics_require_key):
            await self.app(scope, receive, send_with_headers)
            return
        if INTERNAL_KEY in scope:  # the server's own request (a batch line), as its batch's key
            key, presented = self.by_name.get(scope[INTERNAL_KEY]), True
        else:
            key, presented = self.authenticate(scope)
        if key is None:
            self._failure("invalid" if presented else "missing")
            message = ("Invalid API key." if presented else
                       "Missing API key: send it as `Authorization: Bearer KEY` (or `x-api-key: KEY`).")
            await self._refuse(scope, receive, send_with_headers, 401, message, "invalid_request_error",
                               "invalid_api_key" if presented else "missing_api_key",
                               {"WWW-Authenticate": "Bearer"})
            return
        if matched and needed is not None and not key.has(needed):
            self._failure("scope")
            await self._refuse(scope, receive, send_with_headers, 403,
                               f"This API key lacks the `{needed}` scope this endpoint needs.",
                               "permission_error", "missing_scope")
            return
        limiter = self.limiters[key.name]
        refusal = limiter.admit()
        if refusal is not None:
            await self.refuse_limit(scope, receive, send_with_headers, limiter, refusal)
            return
        if limiter.limited:
            extra += limiter.headers()
        meter = KeyMeter(limiter, self.fair, on_tokens=self.metrics.count_tokens if self.metrics else None,
                         on_refusal=self._rate_limited)
        state[KEY_STATE] = key, meter
        status = 500
        running = self.metrics.running.labels(key.name) if self.metrics else None
        if running is not None:
            running.inc()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send_with_headers(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            limiter.release()
            usage = state.get("usage")
            meter.settle(getattr(usage, "prompt_tokens", 0) or 0, getattr(usage, "completion_tokens", 0) or 0)
            if self.metrics is not None:
                running.dec()
                self.metrics.requests.labels(key.name, str(status)).inc()

    def _failure(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.auth_failures.labels(reason).inc()

    def _rate_limited(self, key_name: str, limit: str) -> None:
        """A refusal after authentication: a model the key may not use, or one of its limits."""
        if self.metrics is None:
            return
        if limit == "model":
            self.metrics.auth_failures.labels("model").inc()
        else:
            self.metrics.rate_limited.labels(key_name, limit).inc()

    async def refuse_limit(self, scope: Scope, receive: Receive, send: Send, limiter: KeyLimiter,
                           refusal: Refusal) -> None:
        self._rate_limited(limiter.name, refusal.limit)
        await self._refuse(scope, receive, send, 429, refusal.message,
                           "tokens" if refusal.limit == "tpm" else "requests", "rate_limit_exceeded",
                           limit_headers(limiter, refusal))

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int, message: str, type: str,
                      code: Optional[str], headers: Optional[dict[str, str]] = None) -> None:
        response = error_response(scope["path"], status, message, type=type, code=code, headers=headers)
        await response(scope, receive, send)


def limit_headers(limiter: KeyLimiter, refusal: Refusal) -> dict[str, str]:
    """Retry-After (whole seconds, at least 1) and the key's x-ratelimit-* headers."""
    headers = {"Retry-After": str(max(1, math.ceil(refusal.retry_after_s)))}
    headers.update((k.decode(), v.decode()) for k, v in limiter.headers())
    return headers


def request_key(scope: Scope) -> Optional[tuple[ApiKey, KeyMeter]]:
    """The key (and its meter) the middleware admitted this request with; None without keys."""
    return scope.get("state", {}).get(KEY_STATE)


def request_priority(scope: Scope, asked: Optional[int]) -> int:
    """A request's priority: the one it names, else its key's default (0 without keys)."""
    if asked is not None:
        return asked
    grant = request_key(scope)
    return grant[0].priority if grant is not None else 0


def check_model(scope: Scope, requested: Optional[str], served_name: str) -> None:
    """403 unless the request's key may use the model (checked before the model is loaded)."""
    grant = request_key(scope)
    if grant is not None and not grant[0].allows_model(requested, served_name):
        grant[1].refused("model")
        raise APIError(403, f"This API key may not use the model `{requested or served_name}`.",
                       type="permission_error", param="model", code="model_not_allowed")


def enter_queue(scope: Scope, engine: Any) -> None:
    """Count the request in its key's share of `engine`'s waiting queue; 429 when the key holds
    its fair share of a contended queue already."""
    grant = request_key(scope)
    if grant is None or engine is None:
        return
    meter = grant[1]
    refusal = meter.queue_at(engine, engine.max_num_queued_requests, engine.num_queued())
    if refusal is not None:
        meter.refused(refusal.limit)
        raise APIError(429, refusal.message, type="requests", code="queue_share_exceeded",
                       headers=limit_headers(meter.limiter, refusal))
