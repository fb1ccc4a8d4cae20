"""`tessera bench replay TRACE`: send a recorded trace's requests again, at their recorded times.

The trace is what `tessera serve --record-traffic` wrote (tessera/server/traffic.py has the
format), or the Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`). The
text is synthetic and made to reproduce what the trace kept of the original: each recorded
prefix-block hash becomes the same run of words wherever it appears, so requests that shared a
head (a system prompt, an earlier turn) share it again and a prefix cache sees the same hits;
the rest of the prompt is words of its own. With the target model's tokenizer (`--tokenizer`,
by default the `--model` when Tessera can load it) the words are ones that are a single token,
with and without a leading space, so a block of 16 hashes' worth is exactly 16 tokens and every
prompt has its recorded token count; without one, lengths are approximate (about 1.3 tokens a
word). Outputs are sent with `max_tokens` = the recorded output length and `ignore_eos`, so their
lengths are reproduced too. Arrivals keep the recorded gaps, divided by `--speed`.

Prompts go to /v1/completions (they are text of a given token length, not conversations), so any
OpenAI-compatible server takes them; the report, percentiles and plots are `bench serve`'s.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from tessera.bench import options
from tessera.bench.datasets import VOCABULARY, Session, Turn
from tessera.bench.machine import machine_info
from tessera.bench.metrics import SLO, summarize
from tessera.bench.runner import RunOutput, Target, run_open_loop
from tessera.bench.serve import make_console, request_records, results_table, warm_up, write_outputs
from tessera.errors import TesseraError
from tessera.server.traffic import Trace, TraceError, TraceRecord, prefix_hit_rate, read_trace

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
WORDS_PER_TOKEN = 1 / 1.3  # the fixed vocabulary's words, in the usual BPE vocabularies


def parse_speed(text: str) -> float:
    """'2x', '2', '0.5x' -> the factor arrivals are sped up by."""
    value = text.strip().lower().removesuffix("x")
    try:
        speed = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a speed: {text!r} (try 1x, 2x or 0.5x)") from None
    if not (speed > 0) or math.isinf(speed):
        raise argparse.ArgumentTypeError(f"speed must be a positive factor, not {text!r}")
    return speed


def _azure_time(text: str, where: str) -> float:
    """The trace's 'YYYY-MM-DD HH:MM:SS.fffffff' (7 fractional digits) as seconds."""
    stamp = text.strip()
    head, dot, frac = stamp.partition(".")
    try:
        t = datetime.fromisoformat(head).timestamp()
        return t + (float("0." + frac) if dot and frac else 0.0)
    except ValueError:
        raise TraceError(f"{where}: TIMESTAMP {stamp!r} is not a date and time") from None


def read_azure_csv(path: Path, block_size: int = 16, skip_invalid: bool = False) -> Trace:
    """The Azure LLM inference trace (github.com/Azure/AzurePublicDataset) as trace records:
    arrivals and token counts only, no prefix sharing (the trace has none)."""
    records, skipped = [], []
    try:
        f = open(path, newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    with f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: not an Azure LLM inference trace: no column(s) {', '.join(missing)} "
                             f"(need {', '.join(AZURE_COLUMNS)})")
        for number, row in enumerate(reader, start=2):
            where = f"{path}, line {number}"
            try:
                try:
                    context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                except (TypeError, ValueError):
                    raise TraceError(f"{where}: ContextTokens and GeneratedTokens must be integers") from None
                if context < 1 or generated < 0:
                    raise TraceError(f"{where}: ContextTokens must be >= 1 and GeneratedTokens >= 0")
                records.append(TraceRecord(t=_azure_time(row["TIMESTAMP"] or "", where), endpoint="completions",
                                           model="", prompt_tokens=context, output_tokens=generated,
                                           max_tokens=generated, prefix_hashes=(), block_size=block_size,
                                           stream=True, status=200))
            except TraceError as exc:
                if not skip_invalid:
                    raise
                skipped.append(str(exc))
    if not records:
        raise TraceError(f"no requests in {path}")
    records.sort(key=lambda r: r.t)
    return Trace(records, [{"format": "azure-llm-inference-trace"}], skipped)


def load_trace(paths: Sequence[Path], skip_invalid: bool = False) -> Trace:
    """A Tessera trace (one or more files) or one Azure CSV, told apart by the extension."""
    if any(p.suffix.lower() == ".csv" for p in paths):
        if len(paths) != 1:
            raise TraceError("give one Azure trace CSV at a time")
        return read_azure_csv(paths[0], skip_invalid=skip_invalid)
    return read_trace(paths, skip_invalid=skip_invalid)


def load_tokenizer(name: Optional[str], required: bool = False):
    """The tokenizer the synthetic text is sized with: a Tessera registry name (if installed, or
    `required`), a .gguf or a model folder. None when it cannot be had (and not `required`)."""
    if not name:
        return None
    from tessera.models import registry
    from tessera.models.info import load_model_info

    try:
        if registry.is_registry_name(name) and not (required or registry.is_installed(registry.get_entry(name))):
            return None
        path = registry.resolve_model(name, progress=False) if (required or registry.is_registry_name(name)) \
            else Path(name)
        if not Path(path).exists():
            return None
        return load_model_info(path)[1]
    except Exception as exc:  # noqa: BLE001 - without a tokenizer the lengths are approximate
        if required:
            raise TesseraError(f"--tokenizer {name}: {exc}") from None
        return None


def one_token_words(tokenizer: Any, limit: int = 2048) -> list[str]:
    """Words that are one token both at the start of a text and after a space."""
    def single(text: str) -> bool:
        return len(tokenizer.encode(text, add_special_tokens=False)) == 1

    words = [w for w in VOCABULARY if w.isalpha() and single(w) and single(" " + w)]
    if len(words) >= 64:
        return words[:limit]
    for i in range(tokenizer.vocab_size):  # a small vocabulary: look at its own tokens
        piece = tokenizer.decode([i], skip_special_tokens=True)
        w = piece[1:] if piece.startswith(" ") else ""
        if w.isascii() and w.isalpha() and w not in words and single(w) and single(" " + w):
            words.append(w)
            if len(words) >= limit:
                break
    if len(words) < 8:
        raise TesseraError(f"the tokenizer has too few one-token words ({len(words)}) for synthetic prompts")
    return words


class PromptSynth:
    """Synthetic prompts of a record's token length whose full blocks are a function of the
    block's recorded hash (and `salt`: a fresh salt gives text no server has cached yet)."""

    def __init__(self, tokenizer: Any = None, salt: int = 0) -> None:
        self.tokenizer = tokenizer
        self.salt = salt
        if tokenizer is not None:
            self.words = one_token_words(tokenizer)
            probe = "the"
            self.specials = (len(tokenizer.encode(probe, add_special_tokens=True))
                             - len(tokenizer.encode(probe, add_special_tokens=False)))
        else:
            self.words = list(VOCABULARY)
            self.specials = 0

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def _count(self, tokens: int) -> int:
        return tokens if self.exact else max(1, round(tokens * WORDS_PER_TOKEN))

    def _chunk(self, seed: int, tokens: int) -> list[str]:
        rng = random.Random(seed)
        return [rng.choice(self.words) for _ in range(self._count(tokens))] if tokens > 0 else []

    def prompt(self, record: TraceRecord, index: int) -> str:
        words: list[str] = []
        bs = record.block_size
        for i, h in enumerate(record.prefix_hashes):
            words += self._chunk(int(h, 16) ^ (self.salt * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF),
                                 bs - (self.specials if i == 0 else 0))
        covered = len(record.prefix_hashes) * bs
        rest = record.prompt_tokens - covered - (self.specials if covered == 0 else 0)
        words += self._chunk(hash((self.salt, index, record.t)) & 0xFFFFFFFF, rest)
        if not words:
            words = self._chunk(index, 1)
        text = " ".join(words)
        if self.exact:  # one-token words concatenate token for token; make sure, and mend the tail
            for _ in range(3):
                n = len(self.tokenizer.encode(text, add_special_tokens=True))
                if n == record.prompt_tokens or n < 1:
                    break
                tail = text.split(" ")
                if n > record.prompt_tokens and len(tail) > 1:
                    text = " ".join(tail[:len(tail) - min(len(tail) - 1, n - record.prompt_tokens)])
                elif n < record.prompt_tokens:
                    text += " " + " ".join(self._chunk(index + n, record.prompt_tokens - n))
        return text


@dataclass
class ReplayPlan:
    sessions: list[Session]
    arrivals: list[float]
    records: list[TraceRecord]
    speed: float


def plan_replay(records: Sequence[TraceRecord], synth: PromptSynth, speed: float = 1.0,
                chat: bool = False) -> ReplayPlan:
    """One session per record at its recorded offset / speed. A record refused at the time (no
    output) is sent again with its max_tokens (the load it asked for)."""
    if not records:
        raise TraceError("nothing to replay")
    t0 = records[0].t
    sessions, arrivals = [], []
    for i, r in enumerate(records):
        out = r.output_tokens if r.ok and r.output_tokens > 0 else (r.max_tokens or 16)
        sessions.append(Session(i, [Turn(synth.prompt(r, i), max(1, out))], chat=chat))
        arrivals.append((r.t - t0) / speed)
    return ReplayPlan(sessions, arrivals, list(records), speed)


def select(trace: Trace, start: float = 0.0, duration: Optional[float] = None,
           limit: Optional[int] = None) -> list[TraceRecord]:
    """The records from `start` seconds into the trace, for `duration` seconds, at most `limit`."""
    t0 = trace.records[0].t + start
    chosen = [r for r in trace.records if r.t >= t0 and (duration is None or r.t < t0 + duration)]
    return chosen[:limit] if limit else chosen


def trace_stats(records: Sequence[TraceRecord]) -> dict[str, Any]:
    """What a replay should reproduce, to print beside what it measured."""
    n = len(records)
    span = records[-1].t - records[0].t if n > 1 else 0.0
    return {"requests": n, "duration_s": span, "rate_per_s": (n - 1) / span if span > 0 else None,
            "mean_prompt_tokens": sum(r.prompt_tokens for r in records) / n,
            "mean_output_tokens": sum(r.output_tokens for r in records) / n,
            "prefix_hit_rate": prefix_hit_rate(records),
            "refused": sum(1 for r in records if not r.ok)}


async def run_replay(target: Target, plan: ReplayPlan, progress: bool = True,
                     drain_timeout: Optional[float] = None, desc: str = "replay") -> RunOutput:
    return await run_open_loop(target, plan.sessions, 1.0, 0, progress=progress, desc=desc,
                               drain_timeout=drain_timeout, arrivals=plan.arrivals)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "replay", help="replay a recorded traffic trace (or the Azure LLM trace CSV) against a server",
        description="Send a trace's requests at their recorded arrival times (scaled by --speed) with "
                    "synthetic text of the recorded token lengths and prefix sharing, and report what "
                    "`bench serve` reports. Traces come from `tessera serve --record-traffic`.")
    p.add_argument("trace", nargs="+", type=Path, metavar="TRACE",
                   help="trace file(s): a --record-traffic JSONL (rotated parts may be given together) or an "
                        "Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)")
    options.add_target_args(p)
    g = p.add_argument_group("replay")
    g.add_argument("--speed", type=parse_speed, default=1.0, metavar="FACTOR",
                   help="arrivals this many times faster than recorded, e.g. 2x or 0.5x (default: 1x)")
    g.add_argument("--start", type=options.positive_float, default=None, metavar="SECONDS",
                   help="skip the trace's first SECONDS")
    g.add_argument("--duration", type=options.positive_float, default=None, metavar="SECONDS",
                   help="replay only this many seconds of the trace (before --speed)")
    g.add_argument("--num-requests", type=options.positive_int, default=None, help="at most this many requests")
    g.add_argument("--tokenizer", default=None,
                   help="model whose tokenizer sizes the synthetic text (registry name, .gguf or folder); "
                        "default: --model, when Tessera can load it; else lengths are approximate")
    g.add_argument("--skip-invalid", action="store_true",
                   help="leave out lines that are not valid records (counted) instead of refusing the trace")
    g.add_argument("--seed", type=int, default=0,
                   help="salt of the synthetic text; another seed gives text no cache has seen (default: 0)")
    g.add_argument("--slo-ttft", type=options.positive_float, default=1.0, help="TTFT objective, s (default: 1)")
    g.add_argument("--slo-itl", type=options.positive_float, default=0.05, help="ITL objective, s (default: 0.05)")
    g.add_argument("--warmup", type=int, default=1, help="requests sent before the replay (default: 1)")
    g.add_argument("--drain-timeout", type=options.positive_float, default=None, metavar="SECONDS",
                   help="cancel requests unfinished this long after the last arrival (default: wait)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    o = p.add_argument_group("output")
    o.add_argument("--output", type=Path, help="write results as JSON to this file")
    o.add_argument("--plot-dir", type=Path, help="write PNG plots here (default: beside --output)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from rich.table import Table

    from tessera.bench.plots import plot_sweep

    console = make_console()
    trace = load_trace(args.trace, skip_invalid=args.skip_invalid)
    if trace.skipped:
        console.print(f"[yellow]left out {len(trace.skipped)} invalid line(s)[/], first: {trace.skipped[0]}")
    records = select(trace, args.start or 0.0, args.duration, args.num_requests)
    if not records:
        raise TesseraError("no requests in the chosen part of the trace")
    target = options.target_from_args(args)
    tokenizer = load_tokenizer(args.tokenizer or target.model, required=args.tokenizer is not None)
    synth = PromptSynth(tokenizer, salt=args.seed)
    if not synth.exact:
        console.print("[yellow]no tokenizer for the model: prompt lengths are approximate[/] (--tokenizer)")
    plan = plan_replay(records, synth, args.speed, chat=args.endpoint == "chat")
    slo = SLO(ttft=args.slo_ttft, itl=args.slo_itl)
    failed = asyncio.run(warm_up(target, args.warmup, args.seed, chat=args.endpoint == "chat"))
    if failed is not None:
        raise TesseraError(f"cannot get a completion from {target.url(args.endpoint == 'chat')}: {failed.error}")
    recorded = trace_stats(records)
    span = plan.arrivals[-1] if plan.arrivals else 0.0
    console.print(f"replaying {len(records)} requests over {span:.1f} s ({args.speed:g}x)")
    run = asyncio.run(run_replay(target, plan, progress=not args.no_progress, drain_timeout=args.drain_timeout))
    summary = summarize(run.results, run.duration, slo)
    rate = (len(records) - 1) / span if span > 0 else float("inf")
    name = f"replay {args.speed:g}x"
    level = {"load": {"mode": "request_rate", "value": rate if math.isfinite(rate) else "inf", "name": name},
             "seed": args.seed, "num_prompts": len(records), "summary": summary, "requests": request_records(run)}
    title = f"{args.label or target.model}, replay of {', '.join(p.name for p in args.trace)}"
    console.print(results_table([level], title))
    ok = [r for r in run.results if r.ok]
    fidelity = Table(title="recorded vs replayed")
    for col in ("", "requests", "span (s)", "mean prompt tokens", "mean output tokens"):
        fidelity.add_column(col, justify="right")
    fidelity.add_row("recorded", str(recorded["requests"]), f"{recorded['duration_s']:.1f}",
                     f"{recorded['mean_prompt_tokens']:.1f}", f"{recorded['mean_output_tokens']:.1f}")
    if ok:
        fidelity.add_row(f"replayed ({args.speed:g}x)", str(len(run.results)), f"{run.duration:.1f}",
                         f"{sum(r.prompt_tokens for r in ok) / len(ok):.1f}",
                         f"{sum(r.output_tokens for r in ok) / len(ok):.1f}")
    console.print(fidelity)
    if recorded["prefix_hit_rate"] is not None:
        console.print(f"recorded prefix sharing: {recorded['prefix_hit_rate']:.1%} of prompt tokens in blocks "
                      "an earlier request had (reproduced by the synthetic text)")
    doc = {"kind": "tessera-bench-replay", "version": 1, "label": args.label, "machine": machine_info(args.label),
           "config": {"trace": [str(p) for p in args.trace], "speed": args.speed, "start": args.start,
                      "duration": args.duration, "num_requests": args.num_requests, "exact_lengths": synth.exact,
                      "skipped_lines": len(trace.skipped), "base_url": args.base_url, "model": args.model,
                      "slo_ttft": slo.ttft, "slo_itl": slo.itl},
           "recorded": recorded, "runs": [level]}
    write_outputs(doc, args.output, args.plot_dir, lambda prefix: plot_sweep(doc["runs"], prefix, title), console)
    return 0
