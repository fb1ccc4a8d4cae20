"""API keys: what a key is (a name, its SHA-256, scopes and limits), where keys come from, and
the server's access settings (the middleware that applies them is in auth.py).

Keys come from `--api-key` (repeatable, every scope, as vLLM's flag), `TESSERA_API_KEY`, and a
keys file (`--api-keys-file keys.toml`) that stores each key only as its SHA-256:

    [[key]]
    name = "alice"                 # what logs and metrics show; never the key itself
    sha256 = "9f86d08..."          # printf %s "$KEY" | sha256sum
    scopes = ["inference"]         # inference, metrics, admin (admin implies the others)
    rpm = 60                       # requests per minute
    tpm = 20000                    # tokens per minute, prompt + generated
    max_concurrent = 4
    models = ["coder", "chat"]     # names, aliases or LoRA adapters it may use (default: all)
    priority = 10                  # its requests' priority where they name none (lower first;
                                   # under --scheduling-policy priority; default 0)
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from tessera.errors import ConfigError, TesseraError

INFERENCE, METRICS, ADMIN = "inference", "metrics", "admin"
SCOPES = (INFERENCE, METRICS, ADMIN)
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
KEY_FIELDS = {"name", "sha256", "scopes", "rpm", "tpm", "max_concurrent", "models", "priority"}


def digest_of(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def _positive(value: Optional[int], what: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{what} must be a positive integer, not {value!r}")


@dataclass(frozen=True)
class ApiKey:
    """One key as the server knows it: a name, the key's SHA-256, its scopes and limits."""

    name: str
    sha256: str  # hex digest of the key
    scopes: frozenset[str] = frozenset({INFERENCE})
    rpm: Optional[int] = None
    tpm: Optional[int] = None
    max_concurrent: Optional[int] = None
    models: Optional[frozenset[str]] = None  # names, aliases or adapters it may use; None: every one
    priority: int = 0  # its requests' priority where they name none

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _KEY_NAME.fullmatch(self.name):
            raise ConfigError(f"API key name {self.name!r}: use 1-64 letters, digits, '.', '_', '-' or '@'")
        if not isinstance(self.sha256, str) or not _HEX64.fullmatch(self.sha256):
            raise ConfigError(f"API key {self.name!r}: sha256 must be 64 lowercase hex digits "
                              "(printf %s \"$KEY\" | sha256sum)")
        unknown = set(self.scopes) - set(SCOPES)
        if unknown or not self.scopes:
            raise ConfigError(f"API key {self.name!r}: scopes must be some of {', '.join(SCOPES)}, "
                              f"not {sorted(self.scopes)}")
        for what in ("rpm", "tpm", "max_concurrent"):
            _positive(getattr(self, what), f"API key {self.name!r}: {what}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) or not -(2**63) <= self.priority < 2**63:
            raise ConfigError(f"API key {self.name!r}: priority must be an integer, not {self.priority!r}")
        if self.models is not None and not all(isinstance(m, str) and m for m in self.models):
            raise ConfigError(f"API key {self.name!r}: models must be a list of model names")

    @classmethod
    def from_secret(cls, name: str, secret: str, scopes: Iterable[str] = SCOPES) -> "ApiKey":
        if not secret or secret != secret.strip():
            raise ConfigError(f"API key {name!r} is empty or has surrounding spaces")
        return cls(name=name, sha256=digest_of(secret), scopes=frozenset(scopes))

    def has(self, scope: str) -> bool:
        return scope in self.scopes or ADMIN in self.scopes

    def allows_model(self, requested: Optional[str], served_name: str) -> bool:
        return self.models is None or served_name in self.models or (requested or served_name) in self.models


@dataclass(frozen=True)
class AccessSettings:
    """The server's keys and what stays open: checked once, before anything loads."""

    keys: tuple[ApiKey, ...] = ()
    metrics_require_key: bool = False
    log_requests: bool = False  # prompts and completions in the log (never by default)

    def __post_init__(self) -> None:
        names, digests = set(), set()
        for key in self.keys:
            if key.name in names:
                raise ConfigError(f"API key name {key.name!r} is used twice")
            if key.sha256 in digests:
                raise ConfigError(f"API key {key.name!r} is the same key as another one")
            names.add(key.name)
            digests.add(key.sha256)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @property
    def has_admin_key(self) -> bool:
        return any(ADMIN in k.scopes for k in self.keys)

    @classmethod
    def from_args(cls, args: Any) -> "AccessSettings":
        """`--api-key`, `TESSERA_API_KEY`, `--api-keys-file`, `--metrics-require-key`, `--log-requests`."""
        keys = [ApiKey.from_secret(f"api-key-{i + 1}", secret) for i, secret in enumerate(args.api_key or [])]
        env = os.environ.get("TESSERA_API_KEY")
        if env:
            keys.append(ApiKey.from_secret("env", env))
        if args.api_keys_file is not None:
            keys += keys_from_toml(Path(args.api_keys_file).expanduser())
        return cls(keys=tuple(keys), metrics_require_key=args.metrics_require_key, log_requests=args.log_requests)


def keys_from_toml(path: Path) -> list[ApiKey]:
    """The [[key]] tables of a keys file."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise TesseraError(f"--api-keys-file: no such file: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TesseraError(f"--api-keys-file {path}: {exc}") from None
    tables = doc.get("key")
    if set(doc) - {"key"} or not isinstance(tables, list) or not tables:
        raise TesseraError(f"--api-keys-file {path}: expected [[key]] tables only")
    keys = []
    for i, t in enumerate(tables):
        where = f"--api-keys-file {path}, key #{i + 1}"
        if not isinstance(t, dict) or "name" not in t or "sha256" not in t:
            raise TesseraError(f"{where}: `name` and `sha256` are required")
        bad = set(t) - KEY_FIELDS
        if bad:
            raise TesseraError(f"{where}: unknown keys {', '.join(sorted(bad))} (known: {', '.join(sorted(KEY_FIELDS))})")
        scopes, models = t.get("scopes", [INFERENCE]), t.get("models")
        if not isinstance(scopes, list) or (models is not None and not isinstance(models, list)):
            raise TesseraError(f"{where}: `scopes` and `models` must be lists")
        try:
            keys.append(ApiKey(name=t["name"], sha256=str(t["sha256"]).lower(), scopes=frozenset(scopes),
                               rpm=t.get("rpm"), tpm=t.get("tpm"), max_concurrent=t.get("max_concurrent"),
                               models=None if models is None else frozenset(models),
                               priority=t.get("priority", 0)))
        except (ConfigError, TypeError) as exc:
            raise TesseraError(f"{where}: {exc}") from None
    return keys


def describe_access(settings: AccessSettings, beyond_loopback: bool) -> list[str]:
    """Start-up log lines: what is open, what needs a key, what is off."""
    lines = []
    if settings.keys:
        lines.append(f"API keys: {len(settings.keys)} (" + "; ".join(
            f"{k.name}: {'+'.join(sorted(k.scopes))}" for k in settings.keys) + "); /health is open, /metrics "
            + ("needs a key with the metrics scope" if settings.metrics_require_key else "is open"))
    elif beyond_loopback:
        lines.append("no API key: the API answers anyone who reaches the port "
                     "(give --api-key or --api-keys-file when serving beyond this machine)")
    if beyond_loopback and not settings.has_admin_key:
        lines.append("admin endpoints (/v1/engine/stats, /v1/engine/live, /v1/engine/replicas) are off (404): "
                     "the server listens beyond loopback and no API key has the admin scope")
    return lines
