"""The last few minutes of engine stats, second by second, for the dashboard (`/dashboard`).

Prometheus keeps cumulative counters and bucketed histograms, which is what a
scraper wants; a page refreshing every few seconds wants recent rates and
exact percentiles without running PromQL in the browser. `LiveStats` is one
more stat logger on the stats consumer thread (never on the engine loop): it
folds each step's IterationStats into a one-second bucket, keeps
`history_s` of them, and `snapshot()` turns them into series (one point per
second) and a summary of the last `summary_s` seconds. Rates and percentiles
in the series are taken over a trailing `window_s` (10 s by default), which
keeps the lines readable when a step takes longer than a second or traffic is light.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from tessera.engine.stats import IterationStats, SchedulerStats


@dataclass
class _Second:
    """What happened during one wall-clock second (and the scheduler state at its end)."""

    t: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    rejections: int = 0
    finished: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    steps: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    running: Optional[int] = None
    waiting: Optional[int] = None
    kv_usage: Optional[float] = None


def percentile(values: list[float], q: float) -> Optional[float]:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ms(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value * 1000.0, 2)


class LiveStats:
    """A rolling, per-second record of one model's engine stats; thread-safe.

    `record` runs on the stats consumer thread, `record_rejection` on the HTTP
    thread, `snapshot` on whichever thread serves the dashboard's requests.
    """

    def __init__(self, model_name: str, *, history_s: int = 300, window_s: int = 10,
                 clock: Callable[[], float] = time.time) -> None:
        if history_s < 1 or window_s < 1:
            raise ValueError("history_s and window_s must be at least 1 second")
        self.model_name = model_name
        self.history_s = history_s
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seconds: deque[_Second] = deque()
        self._last_sched: Optional[SchedulerStats] = None
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "rejections": 0,
                       "finished": 0}

    def _current(self) -> _Second:
        """The bucket of this second, creating it (and dropping what fell out of the history)."""
        now = int(self._clock())
        if not self._seconds or self._seconds[-1].t != now:
            self._seconds.append(_Second(now))
            while self._seconds and self._seconds[0].t <= now - self.history_s:
                self._seconds.popleft()
        return self._seconds[-1]

    def record(self, scheduler_stats: Optional[SchedulerStats], iteration_stats: Optional[IterationStats]) -> None:
        with self._lock:
            sec = self._current()
            if scheduler_stats is not None:
                self._last_sched = scheduler_stats
                sec.running = scheduler_stats.num_running
                sec.waiting = scheduler_stats.num_waiting
                sec.kv_usage = scheduler_stats.kv_cache_usage
            it = iteration_stats
            if it is None:
                return
            sec.steps += 1
            sec.prompt_tokens += it.num_prompt_tokens
            sec.generation_tokens += it.num_generation_tokens
            sec.preemptions += it.num_preemptions
            sec.prefix_queries += it.prefix_cache_queries
            sec.prefix_hits += it.prefix_cache_hits
            sec.finished += len(it.finished)
            sec.ttft.extend(it.time_to_first_tokens)
            sec.itl.extend(it.inter_token_latencies)
            for key, value in (("prompt_tokens", it.num_prompt_tokens), ("generation_tokens", it.num_generation_tokens),
                               ("preemptions", it.num_preemptions), ("finished", len(it.finished))):
                self.totals[key] += value

    def tick(self) -> None:
        """Called about once a second by the consumer: an idle second still gets its point."""
        with self._lock:
            self._current()

    def record_rejection(self) -> None:
        """A request refused with 429."""
        with self._lock:
            self._current().rejections += 1
            self.totals["rejections"] += 1

    def snapshot(self, seconds: Optional[int] = None, summary_s: int = 60) -> dict[str, Any]:
        """Series over the last `seconds` (default: the whole history) and a summary of the last
        `summary_s`; every time in milliseconds, rates per second, shares in 0..1."""
        with self._lock:
            self._current()
            secs = list(self._seconds)
            last = self._last_sched
            totals = dict(self.totals)
        now = secs[-1].t
        span = self.history_s if seconds is None else max(1, min(int(seconds), self.history_s))
        by_t = {s.t: s for s in secs}
        series: dict[str, list] = {k: [] for k in (
            "t", "generation_tps", "prompt_tps", "running", "waiting", "kv_usage", "prefix_hit_rate",
            "preemptions", "rejections", "finished", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms")}
        state = (None, None, None)
        # Scheduler state carries forward through seconds with no step (an idle engine reports once).
        for s in secs:
            if s.t > now - span:
                break
            if s.running is not None:
                state = (s.running, s.waiting, s.kv_usage)
        for t in range(now - span + 1, now + 1):
            s = by_t.get(t) or _Second(t)
            if s.running is not None:
                state = (s.running, s.waiting, s.kv_usage)
            window = [by_t[u] for u in range(t - self.window_s + 1, t + 1) if u in by_t]
            ttft = [x for w in window for x in w.ttft]
            itl = [x for w in window for x in w.itl]
            queries = sum(w.prefix_queries for w in window)
            series["t"].append(t)
            # Over the trailing window, but not before the history starts (a fresh server).
            span_s = max(1, min(self.window_s, t - secs[0].t + 1))
            series["generation_tps"].append(round(sum(w.generation_tokens for w in window) / span_s, 2))
            series["prompt_tps"].append(round(sum(w.prompt_tokens for w in window) / span_s, 2))
            series["running"].append(state[0])
            series["waiting"].append(state[1])
            series["kv_usage"].append(None if state[2] is None else round(state[2], 4))
            series["prefix_hit_rate"].append(
                round(sum(w.prefix_hits for w in window) / queries, 4) if queries else None)
            series["preemptions"].append(s.preemptions)
            series["rejections"].append(s.rejections)
            series["finished"].append(s.finished)
            series["ttft_p50_ms"].append(_ms(percentile(ttft, 50)))
            series["ttft_p95_ms"].append(_ms(percentile(ttft, 95)))
            series["itl_p50_ms"].append(_ms(percentile(itl, 50)))
            series["itl_p95_ms"].append(_ms(percentile(itl, 95)))
        recent = [s for s in secs if s.t > now - summary_s]
        ttft = [x for s in recent for x in s.ttft]
        itl = [x for s in recent for x in s.itl]
        queries = sum(s.prefix_queries for s in recent)
        summary = {
            "seconds": summary_s,
            "generation_tps": round(sum(s.generation_tokens for s in recent) / summary_s, 2),
            "prompt_tps": round(sum(s.prompt_tokens for s in recent) / summary_s, 2),
            "requests_finished": sum(s.finished for s in recent),
            "ttft_ms": {f"p{q}": _ms(percentile(ttft, q)) for q in (50, 95, 99)},
            "itl_ms": {f"p{q}": _ms(percentile(itl, q)) for q in (50, 95, 99)},
            "prefix_hit_rate": round(sum(s.prefix_hits for s in recent) / queries, 4) if queries else None,
            "preemptions": sum(s.preemptions for s in recent),
            "rejections": sum(s.rejections for s in recent),
        }
        current = None if last is None else {
            "running": last.num_running, "waiting": last.num_waiting, "swapped": last.num_swapped,
            "kv_usage": round(last.kv_cache_usage, 4), "num_blocks_total": last.num_blocks_total,
            "num_blocks_free": last.num_blocks_free}  # as of the last step reported
        return {"model": self.model_name, "now": now, "window_s": self.window_s, "series": series,
                "summary": summary, "current": current, "totals": totals}
