"""`tessera tune MODEL`: search the engine's settings for the most load that still meets an SLO.

The sizing method of the source articles closed into a loop: each trial starts a real
`tessera serve --config trial.toml` with one choice of settings, and its objective is `bench
capacity`'s search (`capacity.search_capacity`: the highest arrival rate whose probe meets the
SLO) over the chosen workload: a recorded trace (replayed with its own arrival pattern, scaled to
each rate), or the synthetic `random`, `chat` (multi-turn behind shared system prompts) or
`code-edit` mixes. optuna's TPE sampler picks the next settings from the trials so far.

Trials that cannot win stop early. After the first, a trial's search starts at the best capacity
found so far (times 1 + --rel-tol): a probe there that misses the SLO proves the trial worse than
the incumbent, and `HopelessPruner` stops it after that one probe. The default profile runs first,
as the baseline every figure is compared with.

The search space: the profile fields (max_num_seqs, the step's token budget, the latency target
that sizes prefill chunks, in fractions of the SLO's per-token limit, and the chunk floor, prefix
caching, preemption mode), speculation (off, or n-gram with k proposals), the KV cache dtype, and
replicas x threads per replica on the machine's cores. The winner is written as a `--config`
TOML (with the SLO, which `tessera serve` then checks live) beside a JSON report and plots:
capacity per trial, and every probe's latency against its throughput with the frontier of the
passing ones. The command (its flags, the run, the report and plots) is tessera/bench/tune_cli.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from tessera.bench.capacity import CapacityResult, Probe, probe_requests, search_capacity
from tessera.bench.client import launch_server, stop_server
from tessera.bench.datasets import build_workload, requests_per_session
from tessera.bench.metrics import SLO, summarize
from tessera.bench.runner import Target, run_open_loop
from tessera.bench.serve import request_records, warm_up
from tessera.errors import TesseraError
from tessera.profiles import PROFILE_SETTINGS
from tessera.slo import SLOSpec

SYNTHETIC = {"random": "random", "chat": "chat", "code-edit": "code-edit"}  # --workload -> bench dataset
BASELINE_PROFILE = "bursty"  # what a server runs with no flags (profiles.DEFAULT_PROFILE)


# ----------------------------------------------------------------------------- the search space

def topologies(cores: int) -> list[str]:
    """'RxT': R replicas (at most 4) of T torch threads each, on all the machine's cores or half of
    them (fewer threads than cores can win where the cores are shared: an OpenMP team waits for its
    slowest thread); 1xN, one engine on every core, first."""
    out = []
    for used in (cores, cores // 2) if cores > 1 else (cores,):
        out += [f"{r}x{used // r}" for r in range(1, min(4, used) + 1) if used % r == 0]
    return out


@dataclass(frozen=True)
class Space:
    """The choices of each knob. Categorical throughout: TPE then models each value's own effect
    (a token budget or a batch size is not smooth in its capacity)."""

    max_num_seqs: tuple[int, ...] = (4, 8, 16, 32, 64)
    max_num_batched_tokens: tuple[int, ...] = (256, 512, 1024, 2048)
    target_itl_ms: tuple[float, ...] = (0.0, 25.0, 50.0, 100.0)
    min_prefill_chunk: tuple[int, ...] = (16, 32, 64, 128)
    enable_prefix_caching: tuple[bool, ...] = (True, False)
    preemption_mode: tuple[str, ...] = ("recompute", "swap")
    speculation: tuple[str, ...] = ("off", "ngram")
    num_speculative_tokens: tuple[int, ...] = (1, 2, 4)
    kv_cache_dtype: tuple[str, ...] = ("auto", "int8")
    topology: tuple[str, ...] = ("1x1",)

    def suggest(self, trial: Any) -> dict[str, Any]:
        p: dict[str, Any] = {name: trial.suggest_categorical(name, list(getattr(self, name)))
                             for name in ("max_num_seqs", "max_num_batched_tokens", "target_itl_ms",
                                          "enable_prefix_caching", "preemption_mode", "speculation",
                                          "kv_cache_dtype", "topology")}
        if p["target_itl_ms"] > 0:  # the chunk floor only matters under a latency target
            p["min_prefill_chunk"] = trial.suggest_categorical("min_prefill_chunk", list(self.min_prefill_chunk))
        if p["speculation"] != "off":
            p["num_speculative_tokens"] = trial.suggest_categorical("num_speculative_tokens",
                                                                    list(self.num_speculative_tokens))
        return p


def latency_targets(slo: SLOSpec) -> tuple[float, ...]:
    """The latency target's choices for an SLO: none (the token budget alone sizes prefill chunks),
    the default profile's, and 1/2, 3/4 and all of the SLO's tightest per-token limit (ITL, else
    TPOT). A step with decodes in it is an inter-token gap, so a target past the limit spends more
    than the objective on one step, and fixed choices miss a tight SLO's range; without a per-token
    objective, the fixed ones."""
    limit = slo.limit("itl") or slo.limit("tpot")
    if limit is None:
        return Space.target_itl_ms
    ms = limit * 1000
    own = PROFILE_SETTINGS[BASELINE_PROFILE].target_itl_ms
    return tuple(sorted({0.0, own, round(ms / 2, 1), round(ms * 3 / 4, 1), round(ms, 1)}))


def baseline_params(space: Space) -> dict[str, Any]:
    """The default profile as a point of the space: what a server started without flags runs."""
    profile = PROFILE_SETTINGS[BASELINE_PROFILE]
    return {"max_num_seqs": profile.max_num_seqs, "max_num_batched_tokens": profile.max_num_batched_tokens,
            "target_itl_ms": profile.target_itl_ms, "min_prefill_chunk": profile.min_prefill_chunk,
            "enable_prefix_caching": profile.enable_prefix_caching, "preemption_mode": profile.preemption_mode,
            "speculation": "off", "kv_cache_dtype": "auto", "topology": space.topology[0]}


def engine_settings(params: dict[str, Any], cores: int) -> tuple[dict[str, Any], int]:
    """A trial's choices as [model.engine] options and a replica count."""
    replicas, threads = (int(x) for x in params["topology"].split("x"))
    engine: dict[str, Any] = {k: params[k] for k in ("max_num_seqs", "max_num_batched_tokens", "target_itl_ms",
                                                     "enable_prefix_caching", "preemption_mode")}
    engine["min_prefill_chunk"] = params.get("min_prefill_chunk", PROFILE_SETTINGS[BASELINE_PROFILE].min_prefill_chunk)
    if params["kv_cache_dtype"] != "auto":
        engine["kv_cache_dtype"] = params["kv_cache_dtype"]
    if params["speculation"] == "ngram":
        engine["speculative_config"] = json.dumps({"method": "ngram",
                                                   "num_speculative_tokens": params["num_speculative_tokens"]})
    if replicas > 1 or threads != cores:
        engine["num_threads"] = threads
    return engine, replicas


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string for the plain texts written here


def served_name(model: str) -> str:
    """The name a server gives `model` (what requests must ask for)."""
    from tessera.models import registry

    return registry.display_name(model)


def config_toml(model: str, engine: dict[str, Any], replicas: int, slo: SLOSpec, comment: str = "") -> str:
    """A `tessera serve --config` file serving `model` with these settings and checking `slo` live."""
    lines = [f"# {line}" for line in comment.splitlines()] + [
        f"replicas = {replicas}", f"slo = {_toml_value(str(slo))}", "", "[[model]]",
        f"name = {_toml_value(served_name(model))}", f"model = {_toml_value(model)}", "preload = true", "",
        "[model.engine]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in engine.items()]
    return "\n".join(lines) + "\n"


class HopelessPruner:
    """Stops a trial once one of its probes has missed the SLO at a rate no higher than the best
    capacity already found: its own capacity is then below the incumbent's, whatever follows.
    (An optuna pruner: `prune(study, trial)` reads the trial's `lowest_fail` attribute.)"""

    def prune(self, study: Any, trial: Any) -> bool:
        import optuna

        fail = trial.user_attrs.get("lowest_fail")
        done = [t.value for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                if t.value is not None and t.value > 0]
        return fail is not None and bool(done) and fail <= max(done)


def make_pruner() -> Any:
    import optuna

    class _Pruner(optuna.pruners.BasePruner):
        def __init__(self) -> None:
            self.rule = HopelessPruner()

        def prune(self, study: "optuna.Study", trial: "optuna.trial.FrozenTrial") -> bool:
            return self.rule.prune(study, trial)

    return _Pruner()


# ----------------------------------------------------------------------------- workloads

@dataclass
class Workload:
    """Builds one probe's sessions and arrivals for a request rate (sessions per second)."""

    name: str
    build: Callable[[float, int, int], tuple[list, Optional[list[float]]]]  # (rate, requests, seed)
    chat: bool
    per_session: int = 1  # requests a session sends (a conversation's turns); rates count sessions


def synthetic_workload(name: str, args: argparse.Namespace) -> Workload:
    dataset = SYNTHETIC[name]

    def build(rate: float, n: int, seed: int) -> tuple[list, None]:
        return build_workload(dataset, n, seed, input_words=args.prompt_words, output_tokens=args.max_tokens,
                              turns=args.turns), None

    return Workload(name, build, chat=dataset != "random", per_session=requests_per_session(dataset, args.turns))


def trace_workload(path: Path, args: argparse.Namespace) -> Workload:
    """Probes replay the trace with its own arrival pattern, sped up or slowed to each rate, with
    fresh synthetic text per probe (another salt: no help from the last probe's cache)."""
    from tessera.bench import replay

    trace = replay.load_trace([path], skip_invalid=args.skip_invalid)
    records = trace.records
    if len(records) < 2 or trace.duration <= 0:
        raise TesseraError(f"{path}: a trace to tune for needs at least two requests at different times")
    base_rate = (len(records) - 1) / trace.duration
    tokenizer = replay.load_tokenizer(args.model)

    def build(rate: float, n: int, seed: int) -> tuple[list, list[float]]:
        chosen = records[:max(2, n)]
        plan = replay.plan_replay(chosen, replay.PromptSynth(tokenizer, salt=seed), speed=rate / base_rate)
        return plan.sessions, plan.arrivals

    return Workload(f"trace {path.name}", build, chat=False)


# ----------------------------------------------------------------------------- trials

@dataclass
class TrialResult:
    number: int
    params: dict[str, Any]
    state: str  # complete, pruned, failed
    capacity: Optional[float]
    bracket: tuple[Optional[float], Optional[float]]
    probes: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tuner:
    def __init__(self, args: argparse.Namespace, workload: Workload, slo: SLOSpec, console: Any) -> None:
        self.args = args
        self.workload = workload
        self.slo = slo
        self.console = console
        self.bench_slo = SLO(ttft=slo.limit("ttft") or 1.0, itl=slo.limit("itl") or 0.05)
        self.out = Path(args.output_dir)
        (self.out / "trials").mkdir(parents=True, exist_ok=True)
        self.cores = args.cores or os.cpu_count() or 1
        self.space = Space(topology=tuple(topologies(self.cores)), target_itl_ms=latency_targets(slo))
        self.results: list[TrialResult] = []
        self.deadline = time.monotonic() + args.time_budget
        self.probe_seed = 0

    def best(self) -> Optional[TrialResult]:
        done = [r for r in self.results if r.state == "complete" and r.capacity]
        return max(done, key=lambda r: r.capacity or 0) if done else None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def trial_toml(self, number: int, params: dict[str, Any]) -> Path:
        engine, replicas = engine_settings(params, self.cores)
        engine = {**self.args.fixed, **engine}
        path = self.out / "trials" / f"trial_{number:03d}.toml"
        path.write_text(config_toml(self.args.model, engine, replicas, self.slo,
                                    f"tessera tune trial {number}"))
        return path

    def probe_fn(self, target: Target, trial: Any, number: int) -> Callable[[float], Probe]:
        import optuna
        from rich.markup import escape

        args = self.args
        lowest_fail: list[Optional[float]] = [None]
        count = [0]

        def probe(rate: float) -> Probe:
            if self.left() < args.probe_duration:
                raise _OutOfTime()
            n = probe_requests(rate, args.probe_duration, self.workload.per_session, args.min_requests,
                               args.max_requests)
            self.probe_seed += 1
            sessions, arrivals = self.workload.build(rate, n, args.seed + 1000 * self.probe_seed)
            # The same limits as `bench capacity` (its --probe-timeout default), so the two agree.
            run = asyncio.run(run_open_loop(target, sessions, rate, args.seed + self.probe_seed, progress=False,
                                            drain_timeout=args.probe_duration + 60, arrivals=arrivals))
            summary = summarize(run.results, run.duration, self.bench_slo)
            passed, reason = self.check(summary)
            count[0] += 1
            self.console.print(f"    probe {count[0]}: {rate:.3g} req/s, {len(run.results)} requests -> "
                               f"{'[green]pass[/]' if passed else '[red]fail[/]'} ({reason})"
                               + (f"; first error: {escape(summary['errors'][0])}" if summary["errors"] else ""),
                               highlight=False)
            if not passed:
                lowest_fail[0] = rate if lowest_fail[0] is None else min(lowest_fail[0], rate)
                trial.set_user_attr("lowest_fail", lowest_fail[0])
            result = Probe(rate, passed, reason, summary, request_records(run) if args.keep_requests else [])
            trial.report(rate if passed else 0.0, count[0])
            if trial.should_prune():
                self.pending_probes.append(result)
                raise optuna.TrialPruned()
            return result

        return probe

    def check(self, summary: dict[str, Any]) -> tuple[bool, str]:
        n = summary["num_requests"]
        if summary["completed"] == 0:
            return False, "no request completed"
        if summary["failed"]:
            return False, f"{summary['failed']}/{n} failed"
        return self.slo.check_run(summary)

    def run_trial(self, trial: Any, params: dict[str, Any]) -> TrialResult:
        import optuna

        number = trial.number
        started = time.monotonic()
        toml = self.trial_toml(number, params)
        port = _free_port()
        log = self.out / "trials" / f"trial_{number:03d}.log"
        best = self.best()
        start_rate = self.args.start_rate if best is None else best.capacity * (1 + self.args.rel_tol)
        self.pending_probes: list[Probe] = []
        probes: list[Probe] = []
        try:
            proc = launch_server(self.args.model, port, log, "--config", str(toml), "--no-ui", "--disable-log-stats",
                                 "--log-level", "warning", *self.args.serve_args)
        except RuntimeError as exc:
            return TrialResult(number, params, "failed", None, (None, None), seconds=time.monotonic() - started,
                               note=f"server did not start: {exc}")
        try:
            target = Target(base_url=f"http://127.0.0.1:{port}", model=served_name(self.args.model),
                            request_timeout=self.args.request_timeout)
            failed = asyncio.run(warm_up(target, 2, self.args.seed, chat=self.workload.chat))
            if failed is not None:
                return TrialResult(number, params, "failed", None, (None, None),
                                   seconds=time.monotonic() - started, note=f"warm-up failed: {failed.error}")
            probe = self.probe_fn(target, trial, number)

            def recorded(rate: float) -> Probe:
                p = probe(rate)
                probes.append(p)
                return p

            try:
                result: CapacityResult = search_capacity(
                    recorded, start_rate=start_rate, growth=self.args.growth, max_probes=self.args.max_probes,
                    min_rate=min(self.args.min_rate, start_rate), max_rate=self.args.max_rate,
                    rel_tol=self.args.rel_tol)
                state, capacity, bracket, note = "complete", result.rate, result.bracket, result.note
            except optuna.TrialPruned:
                probes.extend(self.pending_probes)
                lo = max((p.rate for p in probes if p.passed), default=None)
                hi = min((p.rate for p in probes if not p.passed), default=None)
                state, capacity, bracket = "pruned", lo, (lo, hi)
                note = f"missed the SLO at {hi:.3g} req/s, not above the best so far: stopped"
            except _OutOfTime:
                lo = max((p.rate for p in probes if p.passed), default=None)
                hi = min((p.rate for p in probes if not p.passed), default=None)
                state, capacity, bracket, note = "complete", lo, (lo, hi), "stopped by the time budget"
        finally:
            stop_server(proc)
        return TrialResult(number, params, state, capacity, bracket,
                           [_probe_dict(p) for p in probes], time.monotonic() - started, note)

    def tune(self) -> list[TrialResult]:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(seed=self.args.seed, n_startup_trials=self.args.startup_trials)
        study = optuna.create_study(direction="maximize", sampler=sampler, pruner=make_pruner())
        if self.args.baseline:
            study.enqueue_trial(baseline_params(self.space))
        shortest = None
        while len(self.results) < self.args.trials:
            # A trial needs a server start and at least one probe; do not start one that cannot finish.
            need = shortest if shortest is not None else self.args.probe_duration
            if self.left() < min(need, 2 * self.args.probe_duration + 30):
                break
            trial = study.ask()
            params = self.space.suggest(trial)
            label = "default profile" if self.args.baseline and trial.number == 0 else "trial"
            self.console.print(f"[bold]{label} {trial.number}[/] ({self.left() / 60:.1f} min left): "
                               + ", ".join(f"{k}={v}" for k, v in params.items()))
            res = self.run_trial(trial, params)
            self.results.append(res)
            shortest = res.seconds if shortest is None else min(shortest, res.seconds)
            if res.state == "complete" and res.capacity is not None:
                study.tell(trial, res.capacity)
            elif res.state == "complete":  # no rate met the SLO
                study.tell(trial, 0.0)
            elif res.state == "pruned":
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            else:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            best = self.best()
            cap = "-" if res.capacity is None else f"{res.capacity:.3g} req/s"
            self.console.print(f"  -> {res.state}: capacity {cap}" + (f" ({res.note})" if res.note else "")
                               + f" in {res.seconds:.0f} s; best {best.capacity:.3g} req/s (trial {best.number})"
                               if best else f"  -> {res.state}: {res.note or cap}")
        return self.results


class _OutOfTime(Exception):
    """The time budget ends before another probe could."""


def _probe_dict(p: Probe) -> dict[str, Any]:
    s = p.summary
    return {"rate": p.rate, "passed": p.passed, "reason": p.reason, "summary": s, "requests": p.requests}
