"""One log line every 10 seconds while the engine is busy, silent while it is idle.

`StatusLineLogger` is a StatLogger: it only adds up what each engine step
reports, and writes a line through the "tessera" logger once an interval has
passed. The stats consumer thread also calls `tick()` about once a second, so
the line comes on time even between steps and the interval that ends a burst
of work is still reported. An interval with no tokens processed and no request
running, waiting or swapped writes nothing.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from tessera.engine.stats import IterationStats, SchedulerStats

LOG_INTERVAL_S = 10.0


class StatusLineLogger:
    """Throughput, queue depths, KV use, prefix-cache hit rate and preemptions, per interval."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S, *, logger: Optional[logging.Logger] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.logger = logger if logger is not None else logging.getLogger("tessera")
        self._clock = clock
        self._last_log = clock()
        self._scheduler: Optional[SchedulerStats] = None
        self._reset()

    def _reset(self) -> None:
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._preemptions = 0
        self._prefix_queries = 0
        self._prefix_hits = 0

    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats]) -> None:
        if scheduler_stats is not None:
            self._scheduler = scheduler_stats
        if iteration_stats is not None:
            self._prompt_tokens += iteration_stats.num_prompt_tokens
            self._generation_tokens += iteration_stats.num_generation_tokens
            self._preemptions += iteration_stats.num_preemptions
            self._prefix_queries += iteration_stats.prefix_cache_queries
            self._prefix_hits += iteration_stats.prefix_cache_hits
        self.tick()

    def tick(self) -> None:
        """Write the line if an interval has passed (and there was something to say)."""
        now = self._clock()
        elapsed = now - self._last_log
        if elapsed < self.interval_s:
            return
        line = self.status_line(elapsed)
        if line is not None:
            self.logger.info("%s", line)
        self._last_log = now
        self._reset()

    def status_line(self, elapsed_s: float) -> Optional[str]:
        """The line for the interval accumulated so far, or None when the engine was idle."""
        s = self._scheduler
        running, waiting, swapped = (s.num_running, s.num_waiting, s.num_swapped) if s else (0, 0, 0)
        if not (self._prompt_tokens or self._generation_tokens or running or waiting or swapped):
            return None
        kv = f"{100.0 * s.kv_cache_usage:.1f}%" if s else "n/a"
        hit_rate = f"{100.0 * self._prefix_hits / self._prefix_queries:.1f}%" if self._prefix_queries else "n/a"
        total_preemptions = f" (total {s.num_preemptions})" if s else ""
        return (f"prompt throughput: {self._prompt_tokens / elapsed_s:.1f} tokens/s, "
                f"generation throughput: {self._generation_tokens / elapsed_s:.1f} tokens/s, "
                f"running: {running}, waiting: {waiting}, swapped: {swapped}, "
                f"KV cache usage: {kv}, prefix cache hit rate: {hit_rate}, "
                f"preemptions: {self._preemptions}{total_preemptions}")
