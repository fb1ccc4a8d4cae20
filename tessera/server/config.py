"""What `tessera serve` serves and how: the `ServingSpec`, built once from the command line
(`ServingSpec.from_args`), with the models from the MODEL arguments or a TOML file (--config).

    # models.toml
    keep_alive = "10m"            # server-wide defaults (flags of the same name override nothing here)
    max_loaded_models = 2

    [[model]]
    name = "coder"                # the name clients use (default: the model's name)
    model = "qwen2.5-coder-1.5b"  # registry name, .gguf path or model folder
    aliases = ["big"]
    preload = true
    keep_alive = "30m"            # -1: never unload
    fallback = "coder-small"      # another model's name: answers when a condition below holds
    when = ["queue_full", "queue_wait > 2s"]   # also "kv_usage > 0.9", "unavailable"
    max_num_queued_requests = 16
    max_queue_wait = 5.0
    tool_call_parser = "hermes"   # also reasoning_parser, chat_template (flags of the same names)
    lora_modules = ["sql=/srv/adapters/sql"]   # LoRA adapters served as models of their own (--lora-modules)
    [model.engine]                # any engine flag, spelled with underscores
    max_num_seqs = 8
    kv_cache_memory = "1GiB"

    [[model]]
    name = "coder-small"
    model = "qwen2.5-coder-0.5b"

Every engine option a model does not set comes from the server's command-line flags.

The spec is the only thing the serving code reads: typed, checked here, so a bad setting is one
clear error before anything loads, and the server never looks at an argparse namespace.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional

from tessera.config import EngineConfig
from tessera.deploy.routing import ROUTER_POLICIES, RouterPolicyName
from tessera.errors import ConfigError, TesseraError
from tessera.server.api_keys import AccessSettings
from tessera.server.media import MediaSettings
from tessera.server.output_parsers import OutputParsing
from tessera.server.served_model import FallbackCondition, FallbackRule, ModelSpec
from tessera.server.transport import TransportSettings
from tessera.server.traffic import RecordSettings
from tessera.slo import SLOSpec

_DURATION = re.compile(r"\s*(-?[0-9.]+)\s*(ms|s|m|h)?\s*$")
MODEL_KEYS = {"name", "model", "aliases", "preload", "keep_alive", "fallback", "when", "max_num_queued_requests",
              "max_queue_wait", "engine", "tool_call_parser", "reasoning_parser", "chat_template", "lora_modules"}
LOG_LEVELS = ("debug", "info", "warning", "error")
_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig)) - {"model"}


def parse_duration(value: Any) -> Optional[float]:
    """'5m', '30s', '1h', 90, '-1' -> seconds; a negative value means never (None)."""
    if value is None:
        return None
    m = _DURATION.fullmatch(str(value))
    if m is None:
        raise TesseraError(f"not a duration: {value!r} (try 30s, 5m or 1h; -1 for never)")
    seconds = float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}[m.group(2)]
    return None if seconds < 0 else seconds


def parse_pd(value: str) -> tuple[int, int]:
    """'prefill=1,decode=2' -> (1, 2)."""
    counts: dict[str, int] = {}
    for part in value.split(","):
        key, sep, num = part.partition("=")
        key = key.strip()
        if not sep or key not in ("prefill", "decode") or key in counts or not num.strip().isdigit():
            raise TesseraError(f"--pd: expected prefill=N,decode=M, not {value!r}")
        counts[key] = int(num)
    if set(counts) != {"prefill", "decode"} or min(counts.values()) < 1:
        raise TesseraError(f"--pd: needs at least one prefill and one decode replica: {value!r}")
    return counts["prefill"], counts["decode"]


@dataclass(frozen=True)
class RaySettings:
    """Where replicas go with --ray: the cluster to join and what each replica reserves there
    (its CPUs are also its torch thread count)."""

    address: Optional[str] = None  # None: start a local Ray instance
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    memory_per_replica: Optional[int] = None  # bytes; None: no reservation

    def __post_init__(self) -> None:
        if not self.num_cpus_per_replica > 0 or not self.num_gpus_per_replica >= 0:
            raise ConfigError("--ray-num-cpus-per-replica must be > 0 and --ray-num-gpus-per-replica >= 0")
        if self.memory_per_replica is not None and self.memory_per_replica <= 0:
            raise ConfigError(f"--ray-memory-per-replica must be positive, not {self.memory_per_replica}")


def _at_least(value: Optional[float], minimum: float, flag: str, what: str = "") -> None:
    if value is not None and not value >= minimum:  # `not >=` also refuses NaN
        raise ConfigError(f"{flag} must be {what or f'at least {minimum:g}'}, not {value}")


@dataclass(frozen=True)
class ServingSpec:
    """Everything a server reads: its models, the engine flags they share, the HTTP, logging and
    admission settings, and the topology (one engine per model, replicas, Ray, P/D)."""

    models: tuple[ModelSpec, ...]
    # Engine flags by EngineConfig field name, as given (None: the profile's value); each model's
    # `engine_overrides` go over them before the profile is applied (see `engine_config`).
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    log_stats: bool = True  # the periodic status line
    otlp_traces_endpoint: Optional[str] = None
    ui: bool = True  # the chat page and the dashboard
    max_stored_responses: int = 1000  # the Responses API's in-memory store (store / previous_response_id)
    # The engine in a process of its own; stepping in the server (False) is only possible for a
    # lone engine on the main thread (`steps_on_main_thread`); every other engine gets a process.
    engine_process: bool = True
    max_num_queued_requests: Optional[int] = None  # None: the profile's bound
    max_queue_wait: Optional[float] = None  # seconds; None: admission by the queue bound only
    engine_step_timeout: Optional[float] = 120.0  # watchdog seconds; None: off
    request_timeout: Optional[float] = 600.0  # seconds; None: never
    shutdown_timeout: float = 10.0
    max_loaded_models: Optional[int] = None  # None: no limit
    replicas: int = 1
    router_policy: RouterPolicyName = "prefix-aware"
    pd: Optional[tuple[int, int]] = None  # (prefill, decode) replicas
    ray: Optional[RaySettings] = None  # None: replicas are local processes
    access: AccessSettings = field(default_factory=AccessSettings)  # API keys, scopes, limits, --log-requests
    transport: TransportSettings = field(default_factory=TransportSettings)  # TLS, CORS, socket timeouts
    record: Optional[RecordSettings] = None  # --record-traffic: every request to a trace file
    batch_store: Optional[Path] = None  # --batch-store: the Files and Batch API's SQLite file (None: in $TESSERA_HOME)
    slo: Optional[SLOSpec] = None  # --slo (or a tuned --config's `slo`): checked live on /v1/engine/live
    media: MediaSettings = field(default_factory=MediaSettings)  # image sources and limits

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("a server needs at least one model")
        seen: dict[str, str] = {}
        for m in self.models:
            for name in (m.name, *m.aliases):
                if name in seen:
                    raise ConfigError(f"model name {name!r} is used twice (by {seen[name]!r} and {m.name!r})")
                seen[name] = m.name
        for m in self.models:
            if m.fallback is None:
                continue
            target = seen.get(m.fallback.model)
            if target is None:
                raise ConfigError(f"model {m.name!r} falls back to {m.fallback.model!r}, which is not served")
            if target == m.name:
                raise ConfigError(f"model {m.name!r} cannot fall back to itself")
        unknown = set(self.engine_options) - _ENGINE_FIELDS
        if unknown:
            raise ConfigError(f"unknown engine options: {', '.join(sorted(unknown))}")
        adapters: dict[str, str] = {}  # LoRA adapter name -> its model's
        for m in self.models:  # a bad engine option is an error now, not a model failing to load later
            try:
                config = self.engine_config(m)
            except ConfigError as exc:
                if not m.engine_overrides:
                    raise
                raise ConfigError(f"model {m.name!r}: {exc}") from None
            _check_adapter_names(m.name, config, seen, adapters)
        if not self.host:
            raise ConfigError("--host must not be empty")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be from 0 to 65535, not {self.port!r}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, not {self.log_level!r}")
        _at_least(self.max_num_queued_requests, 0, "--max-num-queued-requests")
        _at_least(self.max_queue_wait, 0, "--max-queue-wait", "a number of seconds >= 0")
        _at_least(self.engine_step_timeout, 0, "--engine-step-timeout", "a number of seconds >= 0 (0 = off)")
        _at_least(self.request_timeout, 0, "--request-timeout", "a number of seconds >= 0 (0 = never)")
        _at_least(self.shutdown_timeout, 0, "--shutdown-timeout", "a number of seconds >= 0")
        _at_least(self.max_loaded_models, 1, "--max-loaded-models")
        _at_least(self.max_stored_responses, 0, "--max-stored-responses")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(f"--replicas must be at least 1, not {self.replicas}")
        if self.router_policy not in ROUTER_POLICIES:
            raise ConfigError(f"--router-policy must be one of {', '.join(ROUTER_POLICIES)}, "
                              f"not {self.router_policy!r}")
        if self.pd is not None and (len(self.pd) != 2 or min(self.pd) < 1):
            raise ConfigError(f"--pd needs at least one prefill and one decode replica, not {self.pd}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServingSpec":
        """The spec of `tessera serve`'s flags (tessera/serve_flags.py): the one place a
        parsed command line becomes server settings."""
        from tessera.engine.args import engine_options

        ray = RaySettings(address=args.ray_address, num_cpus_per_replica=args.ray_num_cpus_per_replica,
                          num_gpus_per_replica=args.ray_num_gpus_per_replica,
                          memory_per_replica=args.ray_memory_per_replica)  # checked even without --ray
        pd = parse_pd(args.pd) if isinstance(args.pd, str) else args.pd
        replicated = args.replicas > 1 or args.ray or pd is not None
        keep_alive = parse_duration(args.keep_alive)
        max_loaded = args.max_loaded_models
        parsing = OutputParsing(tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                                chat_template=read_chat_template(args.chat_template))
        replicas, slo = args.replicas, args.slo
        if args.config is not None:
            models, loaded_in_file = models_from_toml(Path(args.config).expanduser(), keep_alive, args.preload,
                                                      parsing)
            max_loaded = max_loaded if max_loaded is not None else loaded_in_file
            replicas, slo = _tuned_keys(Path(args.config).expanduser(), replicas, slo)
        else:
            models = models_from_names([args.model, *args.more_models], args.served_model_name, keep_alive,
                                       args.preload, replicated, parsing)
        return cls(
            models=tuple(models), engine_options=engine_options(args), host=args.host, port=args.port,
            log_level=args.log_level or "info", log_stats=not args.disable_log_stats,
            otlp_traces_endpoint=args.otlp_traces_endpoint, ui=args.ui, max_stored_responses=args.max_stored_responses,
            engine_process=args.engine_process,
            max_num_queued_requests=args.max_num_queued_requests, max_queue_wait=args.max_queue_wait,
            engine_step_timeout=args.engine_step_timeout or None, request_timeout=args.request_timeout or None,
            shutdown_timeout=args.shutdown_timeout, max_loaded_models=max_loaded, replicas=replicas,
            router_policy=args.router_policy, pd=pd, ray=ray if args.ray else None,
            access=AccessSettings.from_args(args), transport=TransportSettings.from_args(args),
            record=None if args.record_traffic is None else RecordSettings(
                Path(args.record_traffic).expanduser(), record_text=args.record_text,
                max_bytes=args.record_traffic_max_size, keep=args.record_traffic_keep),
            slo=None if slo is None else SLOSpec.parse(slo),
            batch_store=None if args.batch_store is None else Path(args.batch_store).expanduser(),
            media=MediaSettings.from_args(args))

    @property
    def replicated(self) -> bool:
        """Whether each model is a ReplicaSet (several cores, Ray actors, or prefill/decode)."""
        return self.replicas > 1 or self.ray is not None or self.pd is not None

    @property
    def steps_on_main_thread(self) -> bool:
        """A lone model, one engine, loaded at start and never unloaded: its loop runs on the
        server's main thread, where torch's threads step markedly faster than from another
        thread, and only such an engine may step in the server process (--no-engine-process)."""
        only = self.models[0]
        return len(self.models) == 1 and not self.replicated and only.preload and only.keep_alive is None

    @property
    def replica_count(self) -> int:
        return sum(self.pd) if self.pd is not None else self.replicas

    def engine_config(self, model: ModelSpec) -> EngineConfig:
        """The model's EngineConfig: the server's engine flags, then its own overrides."""
        from tessera.engine.args import config_from_options

        return config_from_options({**self.engine_options, **model.engine_overrides}, model.model)

    def queue_limit(self, model: ModelSpec) -> Optional[int]:
        """The model's own bound on waiting requests, else the server's (None: the profile's)."""
        return model.max_num_queued_requests or self.max_num_queued_requests

    def queue_wait(self, model: ModelSpec) -> Optional[float]:
        return model.max_queue_wait if model.max_queue_wait is not None else self.max_queue_wait


def _check_adapter_names(model: str, config: EngineConfig, models: Mapping[str, str], adapters: dict[str, str]) -> None:
    """An adapter's name is a model name in every API: it must not be a model's, an alias or
    another model's adapter's (`adapters` collects them)."""
    for lora in config.lora_modules:
        if lora.name in models:
            raise ConfigError(f"LoRA adapter {lora.name!r} of model {model!r} has the name of the served model "
                              f"{models[lora.name]!r}; rename it in --lora-modules")
        if lora.name in adapters:
            raise ConfigError(f"LoRA adapter {lora.name!r} is served by models {adapters[lora.name]!r} and "
                              f"{model!r}; rename one (--lora-modules on the command line applies to every "
                              "model: give each its own `lora_modules` in --config)")
        adapters[lora.name] = model


def _load_toml(path: Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise TesseraError(f"--config: no such file: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TesseraError(f"--config {path}: {exc}") from None


def read_chat_template(value: Optional[str]) -> Optional[str]:
    """--chat-template: a file's text, or the value itself when it is a template (has Jinja tags)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{{" not in value and "{%" not in value:
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--chat-template: {value!r} is neither a readable file nor a template "
                              f"({exc})") from None
    return value


def models_from_names(names: list[str], served_model_name: Optional[str], keep_alive: Optional[float],
                      preload: bool, replicated: bool, parsing: OutputParsing = OutputParsing()) -> list[ModelSpec]:
    """The MODEL arguments as served models. A lone model is loaded at start; it is unloaded
    after `keep_alive` only as replicas (then built like any model of a multi-model server):
    one engine is the server's own, stepped on its main thread (ServingSpec.steps_on_main_thread)."""
    from tessera.models import registry

    if len(names) == 1:
        name = served_model_name or registry.display_name(names[0])
        return [_model_spec("the command line", name=name, model=names[0], preload=True,
                            keep_alive=keep_alive if replicated else None, parsing=parsing)]
    if served_model_name is not None:
        raise TesseraError("--served-model-name names one model; with several, use --config and `name`")
    return [_model_spec("the command line", name=registry.display_name(m), model=m, preload=preload,
                        keep_alive=keep_alive, parsing=parsing) for m in names]


def _model_spec(where: str, **kwargs: Any) -> ModelSpec:
    try:
        return ModelSpec(**kwargs)
    except ValueError as exc:
        raise TesseraError(f"{where}: {exc}") from None


def models_from_toml(path: Path, keep_alive: Optional[float], preload: bool,
                     parsing: OutputParsing = OutputParsing()) -> tuple[list[ModelSpec], Optional[int]]:
    """The [[model]] tables of a --config file, and its max_loaded_models (None if unset);
    `keep_alive`, `preload` and `parsing` (the flags) are the defaults the file's own keys beat."""
    from tessera.models import registry

    doc = _load_toml(path)
    tables = doc.get("model")
    if not isinstance(tables, list) or not tables:
        raise TesseraError(f"--config {path}: no [[model]] tables")
    unknown = set(doc) - {"model", "keep_alive", "max_loaded_models", "preload", *TUNED_KEYS}
    if unknown:
        raise TesseraError(f"--config {path}: unknown top-level keys {', '.join(sorted(unknown))}")
    default_keep = parse_duration(doc["keep_alive"]) if "keep_alive" in doc else keep_alive
    max_loaded = int(doc["max_loaded_models"]) if "max_loaded_models" in doc else None
    preload_all = bool(doc.get("preload", preload))
    specs = []
    for i, t in enumerate(tables):
        where = f"--config {path}, model #{i + 1}"
        if not isinstance(t, dict) or "model" not in t:
            raise TesseraError(f"{where}: `model` is required")
        bad = set(t) - MODEL_KEYS
        if bad:
            raise TesseraError(f"{where}: unknown keys {', '.join(sorted(bad))} (known: {', '.join(sorted(MODEL_KEYS))})")
        fallback = None
        if "fallback" in t:
            when = t.get("when", ["queue_full"])
            when = [when] if isinstance(when, str) else when
            try:
                fallback = FallbackRule(str(t["fallback"]), tuple(FallbackCondition.parse(w) for w in when))
            except ValueError as exc:
                raise TesseraError(f"{where}: {exc}") from None
        elif "when" in t:
            raise TesseraError(f"{where}: `when` needs a `fallback`")
        engine = t.get("engine", {})
        if not isinstance(engine, dict):
            raise TesseraError(f"{where}: [model.engine] must be a table")
        if "lora_modules" in t:  # the model's adapters, beside its name rather than in [model.engine]
            if "lora_modules" in engine:
                raise TesseraError(f"{where}: lora_modules is set twice (also in [model.engine])")
            if not isinstance(t["lora_modules"], list):
                raise TesseraError(f"{where}: lora_modules must be a list of \"name=path\" strings or "
                                   "{name, path} tables")
            engine = {**engine, "lora_modules": t["lora_modules"]}
        specs.append(_model_spec(
            where, name=str(t.get("name") or registry.display_name(str(t["model"]))), model=str(t["model"]),
            aliases=[str(a) for a in t.get("aliases", [])], preload=bool(t.get("preload", preload_all)),
            keep_alive=parse_duration(t["keep_alive"]) if "keep_alive" in t else default_keep,
            fallback=fallback, engine_overrides=_engine_overrides(engine, where),
            max_num_queued_requests=t.get("max_num_queued_requests"), max_queue_wait=t.get("max_queue_wait"),
            parsing=_model_parsing(t, parsing, where)))
    return specs, max_loaded


def _model_parsing(table: dict, default: OutputParsing, where: str) -> OutputParsing:
    """A [[model]] table's tool_call_parser / reasoning_parser / chat_template over the flags'."""
    try:
        return OutputParsing(
            tool_call_parser=table.get("tool_call_parser", default.tool_call_parser),
            reasoning_parser=table.get("reasoning_parser", default.reasoning_parser),
            chat_template=read_chat_template(table["chat_template"]) if "chat_template" in table
            else default.chat_template)
    except ConfigError as exc:
        raise TesseraError(f"{where}: {exc}") from None


TUNED_KEYS = ("replicas", "slo")  # top-level keys `tessera tune` writes beside the [[model]] table


def _tuned_keys(path: Path, replicas: int, slo: Optional[str]) -> tuple[int, Optional[str]]:
    """The file's `replicas` and `slo` (what `tessera tune` chose and tuned for), unless the
    command line set them (--replicas other than 1, --slo)."""
    doc = _load_toml(path)
    if replicas == 1 and "replicas" in doc:
        replicas = doc["replicas"]
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise TesseraError(f"--config {path}: replicas must be an integer, not {replicas!r}")
    if slo is None and "slo" in doc:
        slo = doc["slo"]
    return replicas, slo


def _engine_parser() -> argparse.ArgumentParser:
    from tessera.engine.args import add_engine_args

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return parser


def _engine_overrides(table: dict, where: str) -> dict:
    """A [model.engine] table checked and converted as the flags of the same names would be."""
    actions = {a.dest: a for a in _engine_parser()._actions if a.dest != "help"}
    out = {}
    for key, value in table.items():
        action = actions.get(key)
        if action is None:
            raise TesseraError(f"{where}: [model.engine] has no option {key!r} (known: {', '.join(sorted(actions))})")
        if isinstance(value, str) and action.type is not None:
            try:
                value = action.type(value)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                raise TesseraError(f"{where}: engine.{key}: {exc}") from None
        if action.choices is not None and value not in action.choices:
            raise TesseraError(f"{where}: engine.{key} must be one of {', '.join(map(str, action.choices))}")
        out[key] = value
    return out
