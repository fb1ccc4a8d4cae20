"""One served model: its configuration (ModelSpec, with its fallback rule) and, while loaded, its
engine, adapters and state (ServedModel); the router that holds them is model_router.py."""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Optional

from tessera.lora_config import LoRAModule
from tessera.server.output_parsers import OutputParsing

if TYPE_CHECKING:
    from tessera.engine.frontend.protocols import ServingEngine
    from tessera.models.adapters import AdapterSpec

ModelStatus = Literal["unloaded", "loading", "ready", "unloading", "failed"]

_CONDITION = re.compile(r"\s*(queue_full|unavailable|queue_wait\s*>\s*([0-9.]+)\s*(ms|s)?|kv_usage\s*>\s*([0-9.]+))\s*$")


@dataclass(frozen=True)
class FallbackCondition:
    """One `when` clause: queue_full, unavailable, "queue_wait > 2s", "kv_usage > 0.9"."""

    kind: Literal["queue_full", "unavailable", "queue_wait", "kv_usage"]
    threshold: float = 0.0

    @staticmethod
    def parse(text: str) -> "FallbackCondition":
        m = _CONDITION.fullmatch(text)
        if m is None:
            raise ValueError(f"unknown fallback condition {text!r}: use queue_full, unavailable, "
                             "'queue_wait > 2s' or 'kv_usage > 0.9'")
        if m.group(2) is not None:
            value = float(m.group(2)) / (1000.0 if m.group(3) == "ms" else 1.0)
            return FallbackCondition("queue_wait", value)
        if m.group(4) is not None:
            return FallbackCondition("kv_usage", float(m.group(4)))
        return FallbackCondition(m.group(1))  # type: ignore[arg-type]

    def __str__(self) -> str:
        if self.kind == "queue_wait":
            return f"queue_wait > {self.threshold:g}s"
        if self.kind == "kv_usage":
            return f"kv_usage > {self.threshold:g}"
        return self.kind


@dataclass(frozen=True)
class FallbackRule:
    model: str  # served name of the model that answers instead
    when: tuple[FallbackCondition, ...]


def model_capabilities(config, pooler) -> list[str]:
    """What a model with this ModelConfig (and embedding pooler, if any) takes and does: text
    completion (a decoder), images (a vision-language model), embeddings."""
    out = ["completion"] if getattr(config, "is_causal", True) else []
    if getattr(config, "vision", None) is not None:
        out.append("vision")
    if pooler is not None:
        out.append("embedding")
    return out


@dataclass
class ModelSpec:
    """One served model as configured (command line or --config TOML)."""

    name: str  # the name clients use (and the response reports)
    model: str  # registry name, .gguf path or folder
    aliases: list[str] = field(default_factory=list)
    preload: bool = False
    keep_alive: Optional[float] = None  # seconds idle before unloading; None = never
    fallback: Optional[FallbackRule] = None
    engine_overrides: dict = field(default_factory=dict)  # flag dests -> values, over the server's flags
    max_num_queued_requests: Optional[int] = None
    max_queue_wait: Optional[float] = None
    parsing: OutputParsing = field(default_factory=OutputParsing)  # tool-call / reasoning parsers, template

    def __post_init__(self) -> None:
        for what in ("name", "model"):
            value = getattr(self, what)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"a model's `{what}` must be a non-empty string, not {value!r}")
        if self.keep_alive is not None and not self.keep_alive >= 0:
            raise ValueError(f"keep_alive must be a duration >= 0 (or -1: never), not {self.keep_alive!r}")
        queued = self.max_num_queued_requests
        if queued is not None and (isinstance(queued, bool) or not isinstance(queued, int) or queued < 0):
            raise ValueError(f"max_num_queued_requests must be an integer >= 0, not {queued!r}")
        wait = self.max_queue_wait
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float)) or not wait >= 0):
            raise ValueError(f"max_queue_wait must be a number of seconds >= 0, not {wait!r}")


class ServedModel:
    """A configured model and, while loaded, its engine."""

    def __init__(self, spec: ModelSpec, engine: Optional[ServingEngine] = None,
                 lora_modules: Optional[tuple[LoRAModule, ...]] = None) -> None:
        """`lora_modules`: the adapters its engine config serves from start-up (default: those of
        `engine`'s config), named before the engine is built so a lazy model's adapters route."""
        self.spec = spec
        self.engine = engine
        if lora_modules is None:
            lora_modules = tuple(getattr(engine.config, "lora_modules", ())) if engine is not None else ()
        self.lora_modules: tuple[LoRAModule, ...] = lora_modules
        self.added_loras: dict[str, AdapterSpec] = {}  # loaded at run time, given again to a rebuilt engine
        self.removed_loras: set[str] = set()  # unloaded at run time: hidden from the configured and engine lists
        self.status: ModelStatus = "ready" if engine is not None else "unloaded"
        self.error: Optional[str] = None
        self.last_used = time.monotonic()
        self.loaded_at: Optional[float] = time.time() if engine is not None else None
        self.fixed = engine is not None  # handed in already built: never unloaded
        # Its engine's loop runs on the server's main thread (ServingSpec.steps_on_main_thread),
        # which a rebuilt engine could not get back: no request's keep_alive unloads it.
        self.pinned = False
        # Seconds idle before unloading (None: never): the configured value, until a request
        # sets its own (Ollama's per-request keep_alive).
        self.keep_alive: Optional[float] = spec.keep_alive
        self.load_event = threading.Event()
        self.unloaded = threading.Event()  # clear while an unload is under way: a load waits for it
        self.unloaded.set()
        if engine is not None:
            self.load_event.set()
        self.live = None  # the model's LiveStats while loaded
        self.metrics = None  # the model's PrometheusStatLogger (counts its 429s)
        self.stats_consumer = None  # the StatsConsumer thread feeding its loggers, while loaded
        self._file_capabilities: Optional[list[str]] = None  # read once from its files (capabilities)

    @property
    def name(self) -> str:
        return self.spec.name

    def capabilities(self) -> Optional[list[str]]:
        """What the model takes and does ("completion", "vision", "embedding"): its engine's once
        loaded, else read from its files (a local folder or GGUF; a registry name not yet
        fetched: None), so a client can tell a model that sees before it loads."""
        engine = self.engine
        if engine is not None:
            return model_capabilities(engine.model_config, engine.config.pooler_for(engine.model_config))
        if self._file_capabilities is None:
            from pathlib import Path

            from tessera.models.info import read_model_config

            path = Path(self.spec.model).expanduser()
            if not path.exists():
                return None
            try:
                config = read_model_config(path)
            except Exception:  # noqa: BLE001 - an unreadable model says nothing here; loading it says why
                return None
            self._file_capabilities = model_capabilities(config, config.pooler)
        return self._file_capabilities

    @property
    def output_parsing(self) -> OutputParsing:
        """How this model's output is read (its tool-call parser detected from its chat template
        unless configured) and the template its prompts are rendered with; every API asks here."""
        engine = self.engine
        template = getattr(engine.tokenizer, "chat_template", None) if engine is not None else None
        return self.spec.parsing.resolved(template)

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters served on this model, name -> path: its engine's (once loaded), its
        configured ones, and those loaded at run time, less those unloaded at run time."""
        out = {m.name: m.path for m in self.lora_modules if m.name not in self.removed_loras}
        engine = self.engine
        listed = getattr(engine, "lora_adapters", None) if engine is not None else None
        if listed is not None:
            out.update((a.name, a.path) for a in listed() if a.name not in self.removed_loras)
        out.update((name, a.path) for name, a in self.added_loras.items())
        return out

    def restore_adapters(self, engine: ServingEngine) -> None:
        """Give a newly built engine the adapter changes made at run time before it was built."""
        if not (self.added_loras or self.removed_loras):
            return
        listed = getattr(engine, "lora_adapters", None)
        present = {m.name for m in self.lora_modules} | {a.name for a in (listed() if listed else ())}
        for name in self.removed_loras & present:
            engine.remove_lora(name)
        for spec in self.added_loras.values():
            engine.add_lora(spec)

    def available(self) -> bool:
        if self.status != "ready" or self.engine is None:
            return False
        try:
            self.engine.check_health()
        except Exception:  # noqa: BLE001 - any failure means "not now"
            return False
        return True

    def trigger(self, conditions: tuple[FallbackCondition, ...]) -> Optional[str]:
        """The first condition that holds now, as the cause to report; None if none does."""
        for cond in conditions:
            if cond.kind == "unavailable":
                if not self.available():
                    return "unavailable"
                continue
            engine = self.engine
            if engine is None or not self.available():
                continue  # "unavailable" covers it when asked for
            if cond.kind == "queue_full":
                limit = engine.max_num_queued_requests
                if limit is not None and engine.num_queued() >= limit:
                    return "queue_full"
            elif cond.kind == "queue_wait":
                wait = engine.predicted_wait(0)
                if wait is not None and wait > cond.threshold:
                    return "queue_wait"
            elif cond.kind == "kv_usage":
                if engine.get_scheduler_stats().kv_cache_usage > cond.threshold:
                    return "kv_usage"
        return None

    def describe(self) -> dict:
        return {"id": self.name, "model": self.spec.model, "aliases": list(self.spec.aliases),
                "status": self.status, "error": self.error,
                "fallback": None if self.spec.fallback is None else {
                    "model": self.spec.fallback.model, "when": [str(c) for c in self.spec.fallback.when]},
                "adapters": sorted(self.adapters()), "keep_alive_s": self.keep_alive, "loaded_at": self.loaded_at,
                "engine_core": None if self.engine is None else self.engine.core_info()}
