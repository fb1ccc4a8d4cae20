"""The HTTP transport: TLS, CORS, and the timeouts and connection cap that keep slow or idle
sockets from starving real clients.

uvicorn gives TLS (`ssl_keyfile` / `ssl_certfile`, as vLLM passes them), the keep-alive timeout
and h11's cap on the size of a request's head, but nothing times out a request whose head or
body is still arriving, and its `limit_concurrency` answers 503 to *new* requests once that many
connections are open, so a few hundred sockets trickling one header byte a second would turn
every real client away. `guarded_protocol` wraps uvicorn's HTTP protocol with what is missing:

- the request line and headers must arrive within `timeout_header` seconds of the connection
  opening (or of the previous response ending): past it the socket gets a 408 and is closed;
- the body must arrive within `timeout_body` seconds of the headers: past it the connection is
  closed (the handler sees a disconnect and aborts the request);
- beyond `max_connections` open connections, a new connection closes the one that has waited
  longest without a request running (a trickling or idle socket), never a running request; only
  when every connection is serving a request is the newcomer itself closed.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Optional

from tessera.errors import ConfigError

logger = logging.getLogger("tessera.server")

_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


@dataclass(frozen=True)
class TransportSettings:
    """TLS, CORS and the socket limits of one server."""

    ssl_keyfile: Optional[str] = None
    ssl_certfile: Optional[str] = None
    allowed_origins: tuple[str, ...] = ()  # empty: same origin only (no CORS headers at all)
    timeout_header: float = 10.0  # seconds for a request's line and headers
    timeout_body: float = 60.0  # seconds for its body, once the headers are in
    timeout_keep_alive: float = 5.0  # seconds an idle keep-alive connection stays open (uvicorn's)
    max_connections: int = 1024

    def __post_init__(self) -> None:
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ConfigError("--ssl-keyfile and --ssl-certfile go together")
        for flag, value in (("--timeout-header", self.timeout_header), ("--timeout-body", self.timeout_body),
                            ("--timeout-keep-alive", self.timeout_keep_alive)):
            if not value > 0:
                raise ConfigError(f"{flag} must be a number of seconds > 0, not {value}")
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise ConfigError(f"--max-connections must be at least 1, not {self.max_connections!r}")
        for origin in self.allowed_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ConfigError(f"--allowed-origins: {origin!r} is not an origin (https://host[:port], or *)")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @classmethod
    def from_args(cls, args: Any) -> "TransportSettings":
        origins = tuple(o.strip() for value in (args.allowed_origins or []) for o in value.split(",") if o.strip())
        return cls(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, allowed_origins=origins,
                   timeout_header=args.timeout_header, timeout_body=args.timeout_body,
                   timeout_keep_alive=args.timeout_keep_alive, max_connections=args.max_connections)


class HTTPGuard:
    """What guarded_protocol adds to uvicorn's HTTP protocol: a clock on each request's headers
    and body (408 and close when it runs out) and a cap on open connections (the one idle the
    longest is closed to make room). The limits are class attributes of the protocol made."""

    timeout_header: float
    timeout_body: float
    max_connections: int
    # uvicorn's protocol provides these
    loop: Any
    transport: Any
    connections: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._guard: Optional[asyncio.TimerHandle] = None
        self._guarding: Optional[str] = None  # "header" or "body"
        self._body_cycle: Any = None
        self._idle_since = self.loop.time()
        super().connection_made(transport)
        self._arm("header")
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        cycle = self._cycle()
        if cycle is None:
            if self._guarding != "header":
                self._arm("header")  # a new request has begun arriving on a kept-alive connection
        elif getattr(cycle, "more_body", False):
            if self._body_cycle is not cycle:  # the headers are in: now the body's clock runs
                self._body_cycle = cycle
                self._arm("body")
        elif self._guarding is not None:
            self._disarm()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        self._disarm()
        super().on_response_complete()  # uvicorn's keep-alive timer takes over the idle socket

    def busy(self) -> bool:
        return self._cycle() is not None

    def _cycle(self) -> Any:
        """The request being served now (its headers are in), or None."""
        cycle = getattr(self, "cycle", None)
        return None if cycle is None or cycle.response_complete else cycle

    def _arm(self, what: str) -> None:
        self._disarm()
        delay = self.timeout_header if what == "header" else self.timeout_body
        self._guarding = what
        self._guard = self.loop.call_later(delay, self._timed_out, what)

    def _disarm(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
        self._guard, self._guarding = None, None

    def _timed_out(self, what: str) -> None:
        self._guard, self._guarding = None, None
        if self.transport.is_closing():
            return
        cycle = self._cycle()
        if what == "header" and cycle is None:
            self.transport.write(_TIMEOUT_408)
            self.transport.close()
        elif what == "body" and cycle is not None and getattr(cycle, "more_body", False):
            if not getattr(cycle, "response_started", True):
                self.transport.write(_TIMEOUT_408)
            self.transport.close()

    def _make_room(self) -> None:
        """Over the cap: close the connection idle (no request running) the longest."""
        idle = [c for c in self.connections if isinstance(c, HTTPGuard) and not c.busy()
                and not c.transport.is_closing()]
        victim = min(idle, key=lambda c: c._idle_since) if idle else self
        victim._disarm()
        victim.transport.close()


def guarded_protocol(settings: TransportSettings) -> type:
    """uvicorn's HTTP protocol class (httptools' or h11's, whichever uvicorn would pick) with the
    header and body timeouts and the connection cap of `settings` (HTTPGuard)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return type("GuardedHTTPProtocol", (HTTPGuard, AutoHTTPProtocol),
                {"timeout_header": settings.timeout_header, "timeout_body": settings.timeout_body,
                 "max_connections": settings.max_connections})


def uvicorn_config(app: Any, settings: TransportSettings, *, log_level: str = "info",
                   timeout_graceful_shutdown: Optional[float] = None) -> Any:
    """The uvicorn.Config of a server with these transport settings."""
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, access_log=False, http=guarded_protocol(settings),
                          ssl_keyfile=settings.ssl_keyfile, ssl_certfile=settings.ssl_certfile,
                          timeout_keep_alive=settings.timeout_keep_alive,
                          timeout_graceful_shutdown=timeout_graceful_shutdown)


def install_cors(app: Any, settings: TransportSettings) -> None:
    """CORS for the configured origins (outermost, so preflights and 401s carry its headers);
    none configured: no CORS headers, and browsers keep pages of other origins out."""
    if not settings.allowed_origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                       allow_headers=["*"], expose_headers=["x-request-id", "retry-after", "x-ratelimit-limit-requests",
                                                            "x-ratelimit-remaining-requests",
                                                            "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
                                                            "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"])
