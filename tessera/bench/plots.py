"""PNG charts of benchmark results (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _load_axis(runs: Sequence[dict[str, Any]]) -> tuple[list[float], str, bool]:
    mode = runs[0]["load"]["mode"]
    xs = [float(r["load"]["value"]) for r in runs]
    if mode == "concurrency":
        return xs, "concurrency (requests in flight)", True
    finite = [x for x in xs if np.isfinite(x)]
    cap = (max(finite) * 2 if finite else 1.0)
    return [x if np.isfinite(x) else cap for x in xs], "request rate (req/s, Poisson; inf plotted at 2× max)", True


def _x_log(ax: Any, xs: Sequence[float]) -> None:
    """Log-2 load axis labelled with the load levels themselves (1, 4, 16, 32), not powers of two."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(xs))
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{x:g}" for x in ticks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def _get(run: dict[str, Any], metric: str, stat: str) -> float:
    v = run["summary"][metric][stat]
    return float("nan") if v is None else float(v)


def plot_sweep(runs: Sequence[dict[str, Any]], prefix: Path, title: str) -> list[Path]:
    """Throughput vs load, latency percentiles vs load, TTFT distribution per load level."""
    if not runs:
        return []
    prefix.parent.mkdir(parents=True, exist_ok=True)
    xs, xlabel, log = _load_axis(runs)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["summary"]["output_tokens_per_s"] for r in runs], "o-", label="output tokens/s")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["summary"]["requests_per_s"] for r in runs], "s--", color="tab:orange", label="requests/s")
    ax2.plot(xs, [r["summary"]["goodput_requests_per_s"] for r in runs], "^:", color="tab:green",
             label="goodput (req/s within SLO)")
    ax2.set_ylabel("requests/s")
    if log:
        _x_log(ax, xs)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="upper left", fontsize=8)
    ax.set_title(f"Throughput — {title}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "_throughput.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, metric, name in zip(axes, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "ITL", "end-to-end")):
        for stat, style in (("p50", "o-"), ("p95", "s--"), ("p99", "^:")):
            ax.plot(xs, [_get(r, metric, stat) for r in runs], style, label=stat.upper())
        slo = runs[0]["summary"]["slo"]
        if metric == "ttft_s":
            ax.axhline(slo["ttft_s"], color="red", lw=0.8, ls="--", label="SLO")
        if metric == "itl_s":
            ax.axhline(slo["itl_s"], color="red", lw=0.8, ls="--", label="SLO")
        ax.set_title(f"{name} (s)")
        ax.set_xlabel(xlabel, fontsize=8)
        if log:
            _x_log(ax, xs)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"Latency percentiles — {title}")
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "_latency.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ttfts = sorted(q["ttft"] for q in r.get("requests", []) if q["ok"])
        if ttfts:
            ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), label=r["load"]["name"])
    ax.axvline(runs[0]["summary"]["slo"]["ttft_s"], color="red", lw=0.8, ls="--", label="SLO")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of requests (CDF)")
    ax.set_title(f"TTFT distribution — {title}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(prefix.with_name(prefix.name + "_ttft_cdf.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def plot_capacity(probes: Sequence[dict[str, Any]], slo: dict[str, float], best: Optional[float],
                  path: Path, title: str) -> Path:
    """The curve behind a capacity figure: P95 TTFT and P50 ITL against the probed rates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ps = sorted(probes, key=lambda p: p["rate"])
    xs = [p["rate"] for p in ps]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = (("ttft_s", "p95", slo["ttft_s"], "P95 TTFT (s)"), ("itl_s", "p50", slo["itl_s"], "P50 ITL (s)"))
    for ax, (metric, stat, limit, name) in zip(axes, panels):
        ys = [float("nan") if p["summary"][metric][stat] is None else p["summary"][metric][stat] for p in ps]
        colors = ["tab:green" if p["passed"] else "tab:red" for p in ps]
        ax.plot(xs, ys, "-", color="gray", lw=0.8)
        ax.scatter(xs, ys, c=colors, zorder=3)
        ax.axhline(limit, color="red", ls="--", lw=0.8, label="SLO")
        if best:
            ax.axvline(best, color="tab:blue", ls=":", label=f"capacity {best:.3g} req/s")
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    ax.plot(xs, [p["summary"]["output_tokens_per_s"] for p in ps], "o-", label="output tokens/s")
    ax.set_xlabel("request rate (req/s)")
    ax.set_title("throughput (output tokens/s)")
    ax.grid(alpha=0.3)
    fig.suptitle(f"Capacity search — {title} (green: meets SLO)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_comparison(series: dict[str, Sequence[dict[str, Any]]], path: Path, title: str) -> Path:
    """Several servers on one chart: throughput and P95 TTFT against the same load levels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    xlabel = "load"
    all_xs: list[float] = []
    for label, runs in series.items():
        if not runs:
            continue
        xs, xlabel, _ = _load_axis(runs)
        all_xs += xs
        axes[0].plot(xs, [r["summary"]["output_tokens_per_s"] for r in runs], "o-", label=label)
        axes[1].plot(xs, [_get(r, "ttft_s", "p95") for r in runs], "o-", label=label)
        axes[2].plot(xs, [_get(r, "itl_s", "p50") for r in runs], "o-", label=label)
    for ax, name in zip(axes, ("output tokens/s", "P95 TTFT (s)", "P50 ITL (s)")):
        if all_xs:
            _x_log(ax, all_xs)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_title(name)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
