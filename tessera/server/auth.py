"""Who may call what: API keys, their scopes, the route policy, and the middleware that applies
them (with each key's limits from tessera/server/ratelimit.py).

Keys come from `--api-key` (repeatable, every scope, as vLLM's flag), `TESSERA_API_KEY`, and a
keys file (`--api-keys-file keys.toml`) that stores each key only as its SHA-256:

    [[key]]
    name = "alice"                 # what logs and metrics show; never the key itself
    sha256 = "9f86d08..."          # printf %s "$KEY" | sha256sum
    scopes = ["inference"]         # inference, metrics, admin (admin implies the others)
    rpm = 60                       # requests per minute
    tpm = 20000                    # tokens per minute, prompt + generated
    max_concurrent = 4
    models = ["coder", "chat"]     # names, aliases or LoRA adapters it may use (default: all)
    priority = 10                  # its requests' priority where they name none (lower first;
                                   # under --scheduling-policy priority; default 0)

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
import os
import re
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

from starlette.responses import JSONResponse
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tessera.errors import ConfigError, TesseraError
from tessera.server.errors import APIError
from tessera.server.ratelimit import FairShare, KeyLimiter, KeyMeter, Refusal

if TYPE_CHECKING:
    from tessera.metrics import MetricFamilies

logger = logging.getLogger("tessera.server")

INFERENCE, METRICS, ADMIN = "inference", "metrics", "admin"
SCOPES = (INFERENCE, METRICS, ADMIN)
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
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
KEY_FIELDS = {"name", "sha256", "scopes", "rpm", "tpm", "max_concurrent", "models", "priority"}

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


def digest_of(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def _positive(value: Optional[int], what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{what} must be a positive integer, not {value!r}")


@dataclass(frozen=True)
class ApiKey:
    """One key as the server knows it: a name, the key's SHA-256, its scopes and limits."""

    name: str
    sha256: str  # hex digest of the key
    scopes: frozenset[str] = frozenset({INFERENCE})
    rpm: Optional[int] = None
    tpm: Optional[int] = None
    max_concurrent: Optional[int] = None
    models: Optional[frozenset[str]] = None  # names, aliases or adapters it may use; None: every one
    priority: int = 0  # its requests' priority where they name none

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _KEY_NAME.fullmatch(self.name):
            raise ConfigError(f"API key name {self.name!r}: use 1-64 letters, digits, '.', '_', '-' or '@'")
        if not isinstance(self.sha256, str) or not _HEX64.fullmatch(self.sha256):
            raise ConfigError(f"API key {self.name!r}: sha256 must be 64 lowercase hex digits "
                              "(printf %s \"$KEY\" | sha256sum)")
        unknown = set(self.scopes) - set(SCOPES)
        if unknown or not self.scopes:
            raise ConfigError(f"API key {self.name!r}: scopes must be some of {', '.join(SCOPES)}, "
                              f"not {sorted(self.scopes)}")
        for what in ("rpm", "tpm", "max_concurrent"):
            _positive(getattr(self, what), f"API key {self.name!r}: {what}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not -(2**63) <= self.priority < 2**63:
            raise ConfigError(f"API key {self.name!r}: priority must be an integer, not {self.priority!r}")
        if self.models is not None and not all(isinstance(m, str) and m for m in self.models):
            raise ConfigError(f"API key {self.name!r}: models must be a list of model names")

    @classmethod
    def from_secret(cls, name: str, secret: str, scopes: Iterable[str] = SCOPES) -> "ApiKey":
        if not secret or secret != secret.strip():
            raise ConfigError(f"API key {name!r} is empty or has surrounding spaces")
        return cls(name=name, sha256=digest_of(secret), scopes=frozenset(scopes))

    def has(self, scope: str) -> bool:
        return scope in self.scopes or ADMIN in self.scopes

    def allows_model(self, requested: Optional[str], served_name: str) -> bool:
        return self.models is None or served_name in self.models or (requested or served_name) in self.models


@dataclass(frozen=True)
class AccessSettings:
    """The server's keys and what stays open: checked once, before anything loads."""

    keys: tuple[ApiKey, ...] = ()
    metrics_require_key: bool = False
    log_requests: bool = False  # prompts and completions in the log (never by default)

    def __post_init__(self) -> None:
        names, digests = set(), set()
        for key in self.keys:
            if key.name in names:
                raise ConfigError(f"API key name {key.name!r} is used twice")
            if key.sha256 in digests:
                raise ConfigError(f"API key {key.name!r} is the same key as another one")
            names.add(key.name)
            digests.add(key.sha256)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @property
    def has_admin_key(self) -> bool:
        return any(ADMIN in k.scopes for k in self.keys)

    @classmethod
    def from_args(cls, args: Any) -> "AccessSettings":
        """`--api-key`, `TESSERA_API_KEY`, `--api-keys-file`, `--metrics-require-key`, `--log-requests`."""
        keys = [ApiKey.from_secret(f"api-key-{i + 1}", secret) for i, secret in enumerate(args.api_key or [])]
        env = os.environ.get("TESSERA_API_KEY")
        if env:
            keys.append(ApiKey.from_secret("env", env))
        if args.api_keys_file is not None:
            keys += keys_from_toml(Path(args.api_keys_file).expanduser())
        return cls(keys=tuple(keys), metrics_require_key=args.metrics_require_key, log_requests=args.log_requests)


def keys_from_toml(path: Path) -> list[ApiKey]:
    """The [[key]] tables of a keys file."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise TesseraError(f"--api-keys-file: no such file: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TesseraError(f"--api-keys-file {path}: {exc}") from None
    tables = doc.get("key")
    if set(doc) - {"key"} or not isinstance(tables, list) or not tables:
        raise TesseraError(f"--api-keys-file {path}: expected [[key]] tables only")
    keys = []
    for i, t in enumerate(tables):
        where = f"--api-keys-file {path}, key #{i + 1}"
        if not isinstance(t, dict) or "name" not in t or "sha256" not in t:
            raise TesseraError(f"{where}: `name` and `sha256` are required")
        bad = set(t) - KEY_FIELDS
        if bad:
            raise TesseraError(f"{where}: unknown keys {', '.join(sorted(bad))} (known: {', '.join(sorted(KEY_FIELDS))})")
        scopes, models = t.get("scopes", [INFERENCE]), t.get("models")
        if not isinstance(scopes, list) or (models is not None and not isinstance(models, list)):
            raise TesseraError(f"{where}: `scopes` and `models` must be lists")
        try:
            keys.append(ApiKey(name=t["name"], sha256=str(t["sha256"]).lower(), scopes=frozenset(scopes),
                               rpm=t.get("rpm"), tpm=t.get("tpm"), max_concurrent=t.get("max_concurrent"),
                               models=None if models is None else frozenset(models),
                               priority=t.get("priority", 0)))
        except (ConfigError, TypeError) as exc:
            raise TesseraError(f"{where}: {exc}") from None
    return keys


def describe_access(settings: AccessSettings, beyond_loopback: bool) -> list[str]:
    """Start-up log lines: what is open, what needs a key, what is off."""
    lines = []
    if settings.keys:
        lines.append(f"API keys: {len(settings.keys)} (" + "; ".join(
            f"{k.name}: {'+'.join(sorted(k.scopes))}" for k in settings.keys) + "); /health is open, /metrics "
            + ("needs a key with the metrics scope" if settings.metrics_require_key else "is open"))
    elif beyond_loopback:
        lines.append("no API key: the API answers anyone who reaches the port "
                     "(give --api-key or --api-keys-file when serving beyond this machine)")
    if beyond_loopback and not settings.has_admin_key:
        lines.append("admin endpoints (/v1/engine/stats, /v1/engine/live, /v1/engine/replicas) are off (404): "
                     "the server listens beyond loopback and no API key has the admin scope")
    return lines


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
