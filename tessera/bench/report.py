"""`tessera bench report`: markdown tables (and a comparison plot) from saved result files.

Used to turn the side-by-side runs of benchmarks/compare.sh into the tables in
docs/performance.md, so that the published numbers are exactly those in the JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from tessera.errors import TesseraError


def load_results(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(serve documents, capacity documents) read from the given files; a replay's document is a
    serve document (the same runs and summaries) whose workload is its trace."""
    serve, capacity = [], []
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TesseraError(f"cannot read results {path}: {exc}") from None
        doc["_path"] = str(path)
        kind = doc.get("kind")
        if kind in ("tessera-bench-serve", "tessera-bench-replay"):
            serve.append(doc)
        elif kind == "tessera-bench-capacity":
            capacity.append(doc)
        else:
            raise TesseraError(f"{path} is not a tessera bench result (kind {kind!r})")
    return serve, capacity


def _ms(v: Optional[float]) -> str:
    return "–" if v is None else f"{v * 1000:.0f}"


def _s(v: Optional[float]) -> str:
    return "–" if v is None else (f"{v:.2f}" if v < 10 else f"{v:.1f}")


def _label(doc: dict[str, Any]) -> str:
    return doc.get("label") or doc["config"].get("model", "?")


def _workload(doc: dict[str, Any]) -> str:
    if doc.get("kind") == "tessera-bench-replay":
        return "replay of " + ", ".join(Path(t).name for t in doc["config"].get("trace", []))
    return doc["config"].get("dataset", "?")


def _load_key(run: dict[str, Any]) -> tuple[str, float]:
    return run["load"]["mode"], float(run["load"]["value"])


def serve_table(docs: list[dict[str, Any]]) -> str:
    """One row per run. Where the runs span several models (benchmarks/peer_table.sh's one table),
    the workload cell names the model too: a server's label alone would not say which."""
    models = {doc["config"].get("model", "?") for doc in docs}

    def workload(doc: dict[str, Any]) -> str:
        return f"{doc['config'].get('model', '?')} {_workload(doc)}" if len(models) > 1 else _workload(doc)

    head = ("| server | workload | load | output tok/s | req/s | TTFT p50 (s) | TTFT p95 (s) | ITL p50 (ms) "
            "| ITL p95 (ms) | TPOT p50 (ms) | e2e p95 (s) | goodput | failed |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    rows = [(doc, run) for doc in docs for run in doc["runs"]]
    rows.sort(key=lambda dr: (workload(dr[0]), _label(dr[0]), _load_key(dr[1])) if len(models) > 1
              else (_label(dr[0]), _workload(dr[0]), _load_key(dr[1])))
    for doc, run in rows:
        s = run["summary"]
        lines.append(
            f"| {_label(doc)} | {workload(doc)} | {run['load']['name']} "
            f"| {s['output_tokens_per_s']:.1f} | {s['requests_per_s']:.2f} | {_s(s['ttft_s']['p50'])} "
            f"| {_s(s['ttft_s']['p95'])} | {_ms(s['itl_s']['p50'])} | {_ms(s['itl_s']['p95'])} "
            f"| {_ms(s['tpot_s']['p50'])} | {_s(s['e2e_s']['p95'])} | {s['goodput']:.0%} | {s['failed']} |")
    return "\n".join(lines)


def capacity_table(docs: list[dict[str, Any]]) -> str:
    head = "| server | workload | SLO | capacity (req/s) | fails at (req/s) | output tok/s at capacity | probes |"
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for doc in docs:
        slo = doc["slo"]
        rate = doc.get("capacity_requests_per_s")
        best = [p for p in doc["probes"] if p["passed"] and p["rate"] == rate]
        tok = f"{best[0]['summary']['output_tokens_per_s']:.1f}" if best else "–"
        hi = doc["bracket"][1] if doc.get("bracket") else None
        lines.append(f"| {_label(doc)} | {doc['config'].get('dataset', '?')} "
                     f"| TTFT p95 ≤ {slo['ttft_p95_s']:g} s, ITL p50 ≤ {slo['itl_p50_s'] * 1000:g} ms "
                     f"| {'none' if rate is None else f'{rate:.3g}'} | {'–' if hi is None else f'{hi:.3g}'} "
                     f"| {tok} | {len(doc['probes'])} |")
    return "\n".join(lines)


def machine_line(docs: list[dict[str, Any]]) -> str:
    if not docs:
        return ""
    m = docs[0].get("machine", {})
    dates = sorted(d.get("machine", {}).get("date", "") for d in docs if d.get("machine"))
    return (f"Machine: {m.get('cpu_model', '?')}, {m.get('cores', '?')} cores, {m.get('memory_gib', '?')} GiB; "
            f"runs from {dates[0] if dates else '?'} to {dates[-1] if dates else '?'}.")


def render(serve: list[dict[str, Any]], capacity: list[dict[str, Any]]) -> str:
    parts = [machine_line(serve + capacity)]
    if serve:
        parts += ["", serve_table(serve)]
    if capacity:
        parts += ["", capacity_table(capacity)]
    return "\n".join(parts).strip() + "\n"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("report", help="markdown tables and a comparison plot from saved bench results",
                       description="Read JSON files written by `tessera bench serve/capacity/replay --output` and "
                                   "print markdown tables (one row per server and load level; replays are rows too).")
    p.add_argument("files", nargs="+", type=Path, help="result JSON files")
    p.add_argument("--output", type=Path, help="write the markdown here instead of printing it")
    p.add_argument("--plot", type=Path, help="write a comparison PNG of the serve results here")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    serve, capacity = load_results(args.files)
    text = render(serve, capacity)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(f"table: {args.output}")
    else:
        print(text, end="")
    if args.plot and serve:
        from tessera.bench.plots import plot_comparison

        series: dict[str, list[dict[str, Any]]] = {}
        for doc in serve:
            key = f"{_label(doc)} ({_workload(doc)})"
            series.setdefault(key, []).extend(doc["runs"])
        for runs in series.values():
            runs.sort(key=_load_key)
        print(f"plot: {plot_comparison(series, args.plot, 'side by side')}")
    return 0
