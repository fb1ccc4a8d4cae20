"""Summary statistics of one benchmark run: throughput, latency percentiles, goodput.

Conventions (the same as vLLM's benchmark_serving, so numbers compare):
- TTFT: request sent → first chunk with text.
- ITL: every gap between successive text chunks, pooled over all requests.
- TPOT: per request, (e2e − TTFT) / (output tokens − 1).
- Goodput: share of *all* requests (failures count as misses) whose TTFT ≤ slo_ttft and
  whose own median ITL ≤ slo_itl. The median (P50) of each request's gaps is used, matching
  the "ITL P50 < 50 ms" target; a request with a single output token has no gap and meets
  the ITL criterion trivially.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from tessera.bench.client import RequestResult

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class SLO:
    ttft: float = 1.0  # seconds, applied to each request's TTFT (and to the run's P95 in capacity)
    itl: float = 0.05  # seconds, applied to each request's median ITL (and the run's pooled P50)


def distribution(values: Sequence[float]) -> dict[str, Optional[float]]:
    """Mean and P50/P95/P99 (linear interpolation); None when there are no values."""
    if len(values) == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "count": 0}
    arr = np.asarray(values, dtype=float)
    out: dict[str, Any] = {"mean": float(arr.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    out["count"] = int(arr.size)
    return out


def meets_slo(r: RequestResult, slo: SLO) -> bool:
    if not r.ok or r.ttft > slo.ttft:
        return False
    return not r.itls or statistics.median(r.itls) <= slo.itl


def summarize(results: Sequence[RequestResult], duration: float, slo: SLO,
              max_errors: int = 5) -> dict[str, Any]:
    """Everything a report needs about one run at one load level."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = sum(1 for r in results if meets_slo(r, slo))
    errors: list[str] = []
    for r in failed:
        if r.error not in errors:
            errors.append(r.error)
        if len(errors) >= max_errors:
            break
    duration = max(duration, 1e-9)
    short = sum(1 for r in ok if r.max_tokens and r.output_tokens < r.max_tokens)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "rejected_429": sum(1 for r in failed if r.status == 429),
        "errors": errors,
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "output_tokens_per_s": out_tokens / duration,
        "total_tokens_per_s": (out_tokens + in_tokens) / duration,
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        # Requests stopped before max_tokens although ignore_eos was sent: lengths not controlled.
        "short_outputs": short,
        "ttft_s": distribution([r.ttft for r in ok]),
        "itl_s": distribution([g for r in ok for g in r.itls]),
        "tpot_s": distribution([t for r in ok if (t := r.tpot) is not None]),
        "e2e_s": distribution([r.e2e for r in ok]),
        "goodput": good / len(results) if results else 0.0,
        "goodput_requests_per_s": good / duration,
        "slo": {"ttft_s": slo.ttft, "itl_s": slo.itl, "itl_criterion": "per-request median ITL"},
    }


def model_breakdown(results: Sequence[RequestResult], duration: float, slo: SLO) -> dict[str, Any]:
    """A model mix taken apart: per model asked for, who answered it and how many were refused
    (429); per model that answered, its latencies; and the degraded requests (answered by a
    fallback model, as the server's `x-tessera-fallback-cause` says): their causes, TTFT and the
    share of them within the TTFT SLO."""
    asked: dict[str, dict[str, Any]] = {}
    for r in results:
        a = asked.setdefault(r.model, {"requests": 0, "completed": 0, "rejected_429": 0, "failed": 0,
                                       "answered_by": {}})
        a["requests"] += 1
        if r.ok:
            a["completed"] += 1
            who = r.served_model or r.model
            a["answered_by"][who] = a["answered_by"].get(who, 0) + 1
        elif r.status == 429:
            a["rejected_429"] += 1
        else:
            a["failed"] += 1
    answered: dict[str, Any] = {}
    for who in sorted({r.served_model or r.model for r in results if r.ok}):
        mine = [r for r in results if r.ok and (r.served_model or r.model) == who]
        s = summarize(mine, duration, slo)
        answered[who] = {k: s[k] for k in ("completed", "output_tokens_per_s", "ttft_s", "itl_s", "e2e_s", "goodput")}
    degraded = [r for r in results if r.ok and r.fallback_cause]
    causes: dict[str, int] = {}
    for r in degraded:
        causes[r.fallback_cause] = causes.get(r.fallback_cause, 0) + 1
    return {
        "asked": asked,
        "answered": answered,
        "degraded": {"requests": len(degraded), "causes": causes,
                     "ttft_s": distribution([r.ttft for r in degraded]),
                     "within_slo": (sum(1 for r in degraded if meets_slo(r, slo)) / len(degraded)
                                    if degraded else None)},
    }
