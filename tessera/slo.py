"""Latency objectives as one string: `ttft_p95<=1s,itl_p50<=50ms`.

The same objectives are checked in three places: a capacity probe of `tessera tune` (against a
benchmark run's percentiles), `tessera serve --slo` (against the live percentiles of the last
minute, on /v1/engine/live and the dashboard), and the `slo` key of a tuned `--config` TOML that
carries them from one to the other. Metrics are the benchmark's (`ttft`, `itl`, `tpot`, `e2e`),
each at a percentile (p50, p90, p95, p99); limits take ms, s or m.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from tessera.errors import ConfigError

SLO_METRICS = ("ttft", "itl", "tpot", "e2e")
SLO_PERCENTILES = (50, 90, 95, 99)
# What the engine measures live (LiveStats keeps TTFT and ITL, not whole-request times).
LIVE_METRICS = ("ttft", "itl")
_TERM = re.compile(r"\s*(ttft|itl|tpot|e2e)_p(\d+)\s*<=?\s*([0-9]*\.?[0-9]+)\s*(ms|s|m)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


@dataclass(frozen=True)
class Objective:
    """One bound: the `percentile`-th percentile of `metric` at most `limit_s` seconds."""

    metric: str
    percentile: int
    limit_s: float

    def __post_init__(self) -> None:
        if self.metric not in SLO_METRICS:
            raise ConfigError(f"--slo: unknown metric {self.metric!r}; use one of {', '.join(SLO_METRICS)}")
        if self.percentile not in SLO_PERCENTILES:
            raise ConfigError(f"--slo: {self.metric}_p{self.percentile}: percentiles are "
                              + ", ".join(f"p{p}" for p in SLO_PERCENTILES))
        if not self.limit_s > 0:
            raise ConfigError(f"--slo: {self.name} needs a positive limit")

    @property
    def name(self) -> str:
        return f"{self.metric}_p{self.percentile}"

    def __str__(self) -> str:
        ms = self.limit_s * 1000
        limit = f"{ms:g}ms" if ms < 1000 else f"{self.limit_s:g}s"
        return f"{self.name}<={limit}"


@dataclass(frozen=True)
class SLOSpec:
    """Objectives that must all hold."""

    objectives: tuple[Objective, ...]

    def __post_init__(self) -> None:
        if not self.objectives:
            raise ConfigError("--slo needs at least one objective, e.g. ttft_p95<=1s,itl_p50<=50ms")
        names = [o.name for o in self.objectives]
        if len(set(names)) != len(names):
            raise ConfigError(f"--slo names an objective twice: {', '.join(names)}")

    @classmethod
    def parse(cls, text: str) -> "SLOSpec":
        if not isinstance(text, str):
            raise ConfigError(f"--slo must be a string such as 'ttft_p95<=1s,itl_p50<=50ms', not {text!r}")
        objectives = []
        for part in (p for p in text.split(",") if p.strip()):
            m = _TERM.fullmatch(part)
            if m is None:
                raise ConfigError(f"--slo: cannot read {part.strip()!r}; write METRIC_pNN<=LIMIT, e.g. "
                                  "ttft_p95<=1s or itl_p50<=50ms (metrics: " + ", ".join(SLO_METRICS) + ")")
            objectives.append(Objective(m.group(1), int(m.group(2)), float(m.group(3)) * _UNITS[m.group(4)]))
        return cls(tuple(objectives))

    def __str__(self) -> str:
        return ",".join(str(o) for o in self.objectives)

    def limit(self, metric: str) -> Optional[float]:
        """The tightest limit on `metric` in seconds (any percentile), None if unbounded."""
        limits = [o.limit_s for o in self.objectives if o.metric == metric]
        return min(limits) if limits else None

    def check_run(self, summary: Mapping[str, Any]) -> tuple[bool, str]:
        """Against a benchmark summary (tessera.bench.metrics.summarize: `ttft_s` {p50, p95, ...}
        in seconds); a percentile the summary lacks is computed from nothing and fails."""
        for o in self.objectives:
            dist = summary.get(f"{o.metric}_s") or {}
            value = dist.get(f"p{o.percentile}")
            if value is None:
                if o.metric == "itl" and summary.get("completed"):
                    continue  # single-token replies have no gaps: nothing to bound
                return False, f"no {o.name} measured"
            if value > o.limit_s:
                return False, f"{o.name} {_show(value)} > {_show(o.limit_s)}"
        return True, "meets SLO"

    def check_live(self, summary: Mapping[str, Any]) -> dict[str, Any]:
        """Against LiveStats' summary of the last minute (`ttft_ms` {p50, p95, p99} in ms): one
        entry per objective with the live value; `fits` is None while nothing was measured, and
        objectives the engine cannot see (tpot, e2e, p90) are listed as not measured."""
        checks, fits = [], None
        for o in self.objectives:
            live = (summary.get(f"{o.metric}_ms") or {}).get(f"p{o.percentile}")
            ok = None if live is None else live <= o.limit_s * 1000
            if ok is not None:
                fits = ok if fits is None else fits and ok
            checks.append({"objective": str(o), "metric": o.name, "limit_ms": round(o.limit_s * 1000, 3),
                           "live_ms": live, "ok": ok})
        if any(c["ok"] is False for c in checks):
            fits = False
        return {"slo": str(self), "fits": fits, "window_s": summary.get("seconds"), "objectives": checks}


def _show(seconds: float) -> str:
    return f"{seconds * 1000:.3g}ms" if seconds < 1 else f"{seconds:.3g}s"
