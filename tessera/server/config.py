"""Which models `tessera serve` serves: from its MODEL arguments or a TOML file (--config).

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
    [model.engine]                # any engine flag, spelled with underscores
    max_num_seqs = 8
    kv_cache_memory = "1GiB"

    [[model]]
    name = "coder-small"
    model = "qwen2.5-coder-0.5b"

Every engine option a model does not set comes from the server's command-line flags.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path
from typing import Any, Optional

from tessera.config import EngineConfig
from tessera.errors import TesseraError
from tessera.server.models import FallbackCondition, FallbackRule, ModelSpec

_DURATION = re.compile(r"\s*(-?[0-9.]+)\s*(ms|s|m|h)?\s*$")
MODEL_KEYS = {"name", "model", "aliases", "preload", "keep_alive", "fallback", "when", "max_num_queued_requests",
              "max_queue_wait", "engine"}


def parse_duration(value: Any) -> Optional[float]:
    """'5m', '30s', '1h', 90, '-1' -> seconds; a negative value means never (None)."""
    if value is None:
        return None
    m = _DURATION.fullmatch(str(value))
    if m is None:
        raise TesseraError(f"not a duration: {value!r} (try 30s, 5m or 1h; -1 for never)")
    seconds = float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}[m.group(2)]
    return None if seconds < 0 else seconds


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


def model_specs(args: argparse.Namespace) -> list[ModelSpec]:
    """The served models from --config, or else from the MODEL arguments (with the server flags)."""
    from tessera.models import registry

    keep_alive = parse_duration(args.keep_alive)
    if args.config is None:
        names = [args.model, *args.more_models]
        if len(names) == 1:  # one model (as replicas): loaded at start, as `tessera serve MODEL` does
            name = args.served_model_name or registry.display_name(args.model)
            return [ModelSpec(name, args.model, preload=True, keep_alive=keep_alive)]
        if args.served_model_name is not None:
            raise TesseraError("--served-model-name names one model; with several, use --config and `name`")
        return [ModelSpec(registry.display_name(m), m, preload=args.preload, keep_alive=keep_alive) for m in names]
    doc = _load_toml(Path(args.config).expanduser())
    tables = doc.get("model")
    if not isinstance(tables, list) or not tables:
        raise TesseraError(f"--config {args.config}: no [[model]] tables")
    unknown = set(doc) - {"model", "keep_alive", "max_loaded_models", "preload"}
    if unknown:
        raise TesseraError(f"--config {args.config}: unknown top-level keys {', '.join(sorted(unknown))}")
    default_keep = parse_duration(doc["keep_alive"]) if "keep_alive" in doc else keep_alive
    if "max_loaded_models" in doc and args.max_loaded_models is None:
        args.max_loaded_models = int(doc["max_loaded_models"])
    preload_all = bool(doc.get("preload", args.preload))
    specs = []
    for i, t in enumerate(tables):
        where = f"--config {args.config}, model #{i + 1}"
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
        specs.append(ModelSpec(
            name=str(t.get("name") or registry.display_name(str(t["model"]))), model=str(t["model"]),
            aliases=[str(a) for a in t.get("aliases", [])], preload=bool(t.get("preload", preload_all)),
            keep_alive=parse_duration(t["keep_alive"]) if "keep_alive" in t else default_keep,
            fallback=fallback, engine_overrides=_engine_overrides(engine, where),
            max_num_queued_requests=t.get("max_num_queued_requests"), max_queue_wait=t.get("max_queue_wait")))
    return specs


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


def engine_config(spec: ModelSpec, args: argparse.Namespace) -> EngineConfig:
    """The model's EngineConfig: the server's engine flags, then its own overrides."""
    from tessera.engine.args import config_from_args

    merged = copy.copy(args)
    for key, value in spec.engine_overrides.items():
        setattr(merged, key, value)
    return config_from_args(merged, spec.model)
