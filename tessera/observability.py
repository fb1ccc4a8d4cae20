"""Runs the stat loggers (Prometheus, traces, status line) on their own thread.

How the pieces fit (server start-up, the flags are `tessera serve`'s):

    loggers = build_stat_loggers(served_model_name, max_model_len=config.max_model_len,
                                 max_num_batched_tokens=config.max_num_batched_tokens,
                                 otlp_traces_endpoint=args.otlp_traces_endpoint)
    consumer = StatsConsumer(loggers.all())           # starts the thread
    engine = AsyncLLMEngine(config, stats_sink=consumer, max_num_queued_requests=...)
    GET /metrics    -> body, content_type = loggers.prometheus.render()
    GET /v1/engine/live -> loggers.live.snapshot()    # the dashboard's series
    HTTP 429        -> loggers.prometheus.record_rejection(); loggers.live.record_rejection()
    shutdown        -> engine.shutdown(); consumer.stop()   # drains, flushes spans, closes loggers

The engine thread calls `consumer.put(scheduler_stats, iteration_stats)` after
every step; `put` only appends to a queue.SimpleQueue, so the loop pays for
nothing but building the plain stats objects. (Do not hand these loggers to
AsyncLLMEngine's `stat_loggers=`: those run on the engine thread itself.)
Either argument of `put` may be None. The step that finishes the last request
should still put its SchedulerStats (now with nothing running), so the status
line knows the engine went idle.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

from tessera.live_stats import LiveStats
from tessera.metrics import MetricFamilies, PrometheusStatLogger
from tessera.status_log import StatusLineLogger
from tessera.tracing import RequestTracer

if TYPE_CHECKING:
    from tessera.engine.stats import IterationStats, SchedulerStats

logger = logging.getLogger("tessera")


class StatLogger(Protocol):
    def record(self, scheduler_stats: Optional[SchedulerStats],
               iteration_stats: Optional[IterationStats]) -> None: ...


class _Stop:
    """Queue marker: drain, close the loggers and end the thread."""


class StatsConsumer:
    """A daemon thread that hands each queued (SchedulerStats, IterationStats) to every logger.

    A logger that raises is logged (with traceback the first time) and keeps
    being called: one broken exporter must not take the others down. Loggers
    with a `tick()` method get it about every `tick_s` seconds even when no
    stats arrive; loggers with `flush()` / `shutdown()` get those on `stop()`.
    """

    def __init__(self, loggers: Sequence[StatLogger], *, tick_s: float = 1.0,
                 thread_name: str = "tessera-stats") -> None:
        self.loggers = list(loggers)
        self.tick_s = tick_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: set[int] = set()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    # -- producer side (engine thread) ----------------------------------------------------------

    def put(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats]) -> None:
        """Queue one step's stats; returns at once."""
        self._queue.put((scheduler_stats, iteration_stats))

    def flush(self, timeout_s: Optional[float] = 10.0) -> bool:
        """Wait until everything put so far has been recorded; False on timeout or if stopped."""
        if self._stopped:
            return False
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout_s)

    def stop(self, timeout_s: Optional[float] = 10.0) -> None:
        """Record what is queued, flush and shut down the loggers, and end the thread. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._queue.put(_Stop())
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- consumer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        next_tick = time.monotonic() + self.tick_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                item = None
            if isinstance(item, _Stop):
                break
            if isinstance(item, threading.Event):
                item.set()
            elif item is not None:
                for lg in self.loggers:
                    self._call(lg, "record", *item)
            if time.monotonic() >= next_tick:
                for lg in self.loggers:
                    if hasattr(lg, "tick"):
                        self._call(lg, "tick")
                next_tick = time.monotonic() + self.tick_s
        for method in ("flush", "shutdown"):
            for lg in self.loggers:
                if hasattr(lg, method):
                    self._call(lg, method)

    def _call(self, lg: object, method: str, *args: object) -> None:
        try:
            getattr(lg, method)(*args)
        except Exception:
            if id(lg) not in self._failed:
                self._failed.add(id(lg))
                logger.exception("stat logger %s failed in %s(); it keeps being called, further errors "
                                 "are logged at debug level", type(lg).__name__, method)
            else:
                logger.debug("stat logger %s failed in %s()", type(lg).__name__, method, exc_info=True)


# -- wiring for the server ------------------------------------------------------------


@dataclass
class StatLoggers:
    prometheus: PrometheusStatLogger
    tracer: Optional[RequestTracer] = None
    status: Optional[StatusLineLogger] = None
    live: Optional[LiveStats] = None  # the dashboard's rolling record

    def all(self) -> list[StatLogger]:
        return [lg for lg in (self.prometheus, self.tracer, self.status, self.live) if lg is not None]


def build_stat_loggers(model_name: str, *, max_model_len: Optional[int] = None, max_num_batched_tokens: int = 512,
                       otlp_traces_endpoint: Optional[str] = None, log_stats: bool = True,
                       families: Optional[MetricFamilies] = None, replica: Optional[str] = None,
                       live: Optional[LiveStats] = None) -> StatLoggers:
    """The loggers a server needs for one model (one replica of it, with `replica`); raises
    TesseraError for a bad trace endpoint. The models of one server share `families` (one
    /metrics); the replicas of one model share its `live` record."""
    return StatLoggers(
        prometheus=PrometheusStatLogger(model_name, max_model_len=max_model_len,
                                        max_num_batched_tokens=max_num_batched_tokens, families=families,
                                        replica=replica),
        tracer=RequestTracer.from_endpoint(otlp_traces_endpoint, model_name) if otlp_traces_endpoint else None,
        status=StatusLineLogger() if log_stats else None,
        live=live if live is not None else LiveStats(model_name),
    )
