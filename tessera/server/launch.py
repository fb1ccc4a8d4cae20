"""`tessera serve`: the socket bound before the models load, uvicorn on a thread of its own, a
lone engine's loop stepped on the main thread, and a drain on SIGTERM or Ctrl-C.

The engine steps on a thread apart from the event loop, so the event loop only parses,
streams and waits: a slow client never stalls decoding, and a long step never stalls HTTP.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Optional, cast

import uvicorn

from tessera.errors import TesseraError
from tessera.models.registry import tessera_home
from tessera.server.app import create_app
from tessera.server.api_keys import describe_access
from tessera.server.auth import is_loopback
from tessera.server.batches.protocol import BatchLimits
from tessera.server.model_router import ModelRouter
from tessera.server.served_model import ServedModel
from tessera.server.serving import ServerState
from tessera.server.topology import build_serving_engine, close_serving_engine, init_ray
from tessera.server.transport import uvicorn_config

if TYPE_CHECKING:
    from tessera.engine.frontend.async_engine import AsyncLLMEngine
    from tessera.server.config import ServingSpec

logger = logging.getLogger("tessera.server")

# Seconds open requests (e.g. long streams) may still run after Ctrl-C before they are ended with a 503.
GRACEFUL_SHUTDOWN_SECONDS = 5


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tessera").setLevel(level.upper())


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain: on SIGTERM or Ctrl-C (`drain()`), new requests get 503 while the
    running ones finish, for up to `shutdown_timeout` seconds; then uvicorn shuts down and the
    requests still running are ended with a 503 / final error event, not cut mid-write."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.drain_deadline: Optional[float] = None

    def drain(self) -> None:
        """Stop taking requests (thread-safe); a second call stops at once."""
        if self.drain_deadline is not None:
            self.should_exit = True
            return
        logger.info("draining: new requests get 503; %d running request(s) have up to %gs to finish",
                    len(self.state.generations), self.shutdown_timeout)
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.shutdown_timeout

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit and (
                not self.state.generations or time.monotonic() >= self.drain_deadline):
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        async def end_stragglers() -> None:
            await asyncio.sleep(0 if self.drain_deadline is not None else GRACEFUL_SHUTDOWN_SECONDS)
            if self.state.generations:
                logger.info("ending %d request(s) still running at shutdown", len(self.state.generations))
            self.state.shut_down()

        stragglers = asyncio.create_task(end_stragglers())
        try:
            await super().shutdown(sockets)
        finally:
            stragglers.cancel()


def _bind(host: str, port: int) -> socket.socket:
    """Claim the address before the model loads, so a port in use fails in a second, not after loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise TesseraError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                           "pick another --port or --host") from None
    return sock


def serve(spec: ServingSpec) -> int:
    """Serve `spec`'s models from one port until SIGTERM or Ctrl-C, then drain. Every topology
    takes this one path: one model is a server of one model, each model's engine comes from
    `build_serving_engine` (at start with preload, else on first use), and a lone engine's loop
    runs on this, the main, thread (`ServingSpec.steps_on_main_thread`)."""
    from prometheus_client import Counter

    from tessera.metrics import PREFIX, MetricFamilies

    _configure_logging(spec.log_level)
    families = MetricFamilies()  # one /metrics for every model, a `model_name` label each
    degraded = families.get(Counter, PREFIX + "degraded_requests",
                            "Requests answered by a fallback model instead of the one asked for, by cause "
                            "(queue_full, queue_wait, kv_usage, unavailable).", ["model_name", "fallback", "cause"])
    if spec.ray is not None:
        init_ray(spec.ray)
    # each model's --lora-modules named up front, so a model not loaded yet answers to its adapters
    router = ModelRouter([ServedModel(m, lora_modules=spec.engine_config(m).lora_modules) for m in spec.models],
                         builder=lambda served: build_serving_engine(served, spec, families),
                         closer=close_serving_engine, max_loaded=spec.max_loaded_models,
                         on_degraded=lambda asked, answered, cause: degraded.labels(asked, answered, cause).inc())
    router.default.pinned = spec.steps_on_main_thread
    sock = _bind(spec.host, spec.port)
    recorder = None
    try:
        for served in router.models:
            if served.spec.preload:
                _preload(router, served)
        router.start_reaper()
        if spec.record is not None:
            from tessera.server.traffic import TrafficRecorder

            recorder = TrafficRecorder(spec.record)
            logger.info("recording traffic to %s%s", spec.record.path, " with text" if spec.record.record_text else "")
        beyond_loopback = not is_loopback(spec.host)
        app = create_app(router=router, request_timeout=spec.request_timeout, metrics=families, ui=spec.ui,
                         max_stored_responses=spec.max_stored_responses, access=spec.access,
                         beyond_loopback=beyond_loopback, transport=spec.transport, families=families,
                         recorder=recorder, slo=spec.slo, media=spec.media, batch_store=spec.batch_store or tessera_home() / "batches.sqlite3",
                         batch_limits=BatchLimits(priority=spec.engine_config(spec.models[0]).background_priority))
        # uvicorn's own timeout is the backstop: it cancels whatever our shutdown left running.
        config = uvicorn_config(app, spec.transport, log_level=spec.log_level,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS + 5)
        server = DrainingServer(config, app.state.tessera, spec.shutdown_timeout)
        for line in describe_access(spec.access, beyond_loopback):
            logger.info("%s", line)
        host = f"[{spec.host}]" if ":" in spec.host else spec.host
        logger.info("serving %s on %s://%s:%d", ", ".join(
            f"{m.name} ({m.spec.model}, {m.status})" for m in router.models),
            "https" if spec.transport.tls else "http", host, spec.port)
        http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="tessera-http")
        signal.signal(signal.SIGTERM, lambda *_: server.drain())
        http.start()
        # build_serving_engine left a lone engine's loop to this thread
        stepped = cast("AsyncLLMEngine", router.default.engine) if spec.steps_on_main_thread else None
        _run_until_stopped(http, server, stepped)
    finally:
        router.shutdown()
        sock.close()
        if recorder is not None:
            recorder.close()
    return 0


def _preload(router: ModelRouter, served: ServedModel) -> None:
    """Load a model before the server answers; a failure stops the server with one line."""
    try:
        router.load(served)
    except TesseraError:
        raise
    except Exception as exc:  # a replica set's RuntimeError and kin: still one line, naming the model
        raise TesseraError(f"model {served.name!r} failed to load: {type(exc).__name__}: {exc}") from exc


def _run_until_stopped(http: threading.Thread, server: DrainingServer, engine: Optional[AsyncLLMEngine]) -> None:
    """Until HTTP has stopped: step `engine`'s loop on this thread if there is one, else only wait
    (each engine's loop has a thread of its own). Ctrl-C drains: the engines keep stepping the
    running requests while HTTP shuts down; a second Ctrl-C stops at once."""
    stepping = engine is not None
    while http.is_alive():
        try:
            if stepping:
                assert engine is not None
                engine.run_until(lambda: not http.is_alive())
                stepping = False  # HTTP stopped, or the loop died (its requests failed, /health says so)
            else:
                http.join(0.5)
        except KeyboardInterrupt:
            logger.info("shutting down")
            server.drain()
