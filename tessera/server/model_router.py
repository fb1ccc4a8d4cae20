"""The models one server serves: their engines, loading and unloading, and where a request goes
(one model, its configuration and fallback rule: served_model.py).

A `ModelRouter` holds one `ServedModel` per configured model. A model's engine
is built on first use (or at start with `preload`) on a thread of its own, so
loading one model never stalls requests to the others; it is shut down after
`keep_alive` seconds without requests, or when loading another needs room
(least recently used first, never one with requests in flight), as Ollama's
keep_alive and OLLAMA_MAX_LOADED_MODELS do. With several models each engine
runs in its own process (tessera/engine/frontend/core_client.py), so a crash or an
unload returns that model's memory and touches nobody else.

Degradation: a model may name a `fallback` and the conditions (`when`) under
which a request is answered by it instead of waiting or failing: its queue is
full, its forecast wait is past a bound, its KV cache is nearly full, or it is
unavailable (loading, restarting after a crash, failed). The answer says who
answered (the response's `model`, `x-tessera-model`, and
`x-tessera-fallback-from` / `x-tessera-fallback-cause`); a request can forbid
it with `x-tessera-no-fallback: 1`.

LoRA adapters (vLLM's --lora-modules and /v1/load_lora_adapter) are names too: an adapter
resolves to its base model, and the `Route` carries the adapter's name for the engine. An
adapter never falls back (another model has no such adapter). Adapters loaded at run time are
kept on their `ServedModel`, so a model unloaded (keep_alive, room) and loaded again serves
them still.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from tessera.errors import TesseraError
from tessera.server.errors import APIError, model_not_found
from tessera.server.served_model import ModelSpec, ServedModel

if TYPE_CHECKING:
    from tessera.engine.frontend.protocols import ServingEngine
    from tessera.models.adapters import AdapterSpec

logger = logging.getLogger("tessera")

NO_FALLBACK_HEADER = "x-tessera-no-fallback"
# Unloading (for room, or idle past a keep_alive shorter than this) skips a model used this
# recently: a request may be between choosing it and handing its prompt to the engine.
RECENT_USE_S = 2.0


# Builds a model's engine (blocking; on a thread) and tears it down.
EngineBuilder = Callable[[ServedModel], "ServingEngine"]
EngineCloser = Callable[[ServedModel], None]


@dataclass
class Route:
    model: ServedModel  # who answers (an adapter's base model)
    requested: str  # the name the client asked for
    cause: Optional[str] = None  # why another model answers, if one does
    allow_fallback: bool = True  # False when the request forbids it
    adapter: Optional[str] = None  # the LoRA adapter the engine runs the request with; None: the base

    @property
    def reported(self) -> str:
        """The `model` of the response: the name asked for (an alias stays an alias), or the
        fallback's name when another model answered."""
        return self.requested if self.cause is None else self.model.name

    def headers(self) -> dict[str, str]:
        out = {"x-tessera-model": self.model.name}
        if self.cause is not None:
            out["x-tessera-fallback-from"] = self.requested
            out["x-tessera-fallback-cause"] = self.cause
        return out


class ModelRouter:
    """Resolves names, loads and unloads engines, applies fallback rules. Thread-safe."""

    def __init__(self, models: list[ServedModel], *, builder: Optional[EngineBuilder] = None,
                 closer: Optional[EngineCloser] = None, max_loaded: Optional[int] = None,
                 on_degraded: Optional[Callable[[str, str, str], None]] = None) -> None:
        if not models:
            raise ValueError("a server needs at least one model")
        self.models = models
        self.builder = builder
        self.closer = closer
        self.max_loaded = max_loaded
        self.on_degraded = on_degraded
        self._by_name: dict[str, ServedModel] = {}
        for m in models:
            for name in [m.name, *m.spec.aliases]:
                if name in self._by_name:
                    raise ValueError(f"model name {name!r} is used twice")
                self._by_name[name] = m
        adapters: dict[str, str] = {}
        for m in models:
            for name in m.adapters():
                if name in self._by_name or name in adapters:
                    raise ValueError(f"LoRA adapter name {name!r} is already "
                                     f"{'a model name' if name in self._by_name else 'an adapter of ' + repr(adapters[name])}")
                adapters[name] = m.name
        for m in models:
            rule = m.spec.fallback
            if rule is not None:
                if rule.model not in self._by_name:
                    raise ValueError(f"model {m.name!r} falls back to {rule.model!r}, which is not served")
                if self._by_name[rule.model] is m:
                    raise ValueError(f"model {m.name!r} cannot fall back to itself")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: Optional[threading.Thread] = None

    @classmethod
    def single(cls, engine: ServingEngine, names: list[str], live=None) -> "ModelRouter":
        """One engine built by the caller, answering to every name in `names` (the first reported)."""
        served = ServedModel(ModelSpec(names[0], engine.config.model, aliases=list(names[1:])), engine)
        served.live = live
        return cls([served])

    # -- names ------------------------------------------------------------------------------
    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def resolve(self, requested: Optional[str]) -> ServedModel:
        """The model a name (or alias, or adapter) designates; the first model when none is given;
        404 else."""
        return self.lookup(requested)[0]

    def lookup(self, requested: Optional[str]) -> tuple[ServedModel, Optional[str]]:
        """The model a name designates and, for a LoRA adapter's name, the adapter (else None)."""
        if requested is None or requested == "":
            return self.default, None
        served = self._by_name.get(requested)
        if served is not None:
            return served, None
        owner = self.adapter_owner(requested)
        if owner is None:
            raise model_not_found(requested)
        return owner, requested

    def adapter_owner(self, name: str) -> Optional[ServedModel]:
        """The model serving the LoRA adapter `name`; None when no model does."""
        return next((m for m in self.models if name in m.adapters()), None)

    def check_adapter_name(self, name: str) -> None:
        """400 for a new adapter's name that a model, an alias or another adapter has already."""
        if name in self._by_name:
            raise APIError(400, f"The lora adapter '{name}' has the name of a served model; pick another "
                                "lora_name.", param="lora_name", code="lora_name_taken")
        if self.adapter_owner(name) is not None:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                           code="lora_already_loaded")

    def add_adapter(self, served: ServedModel, spec: AdapterSpec) -> None:
        """Serve `spec` on `served` (loaded) from now on, and again whenever it is reloaded.
        400 for a name a model or another adapter has already."""
        with self._lock:
            self.check_adapter_name(spec.name)
            engine = served.engine
            if engine is None:
                raise APIError(503, f"Model {served.name!r} was unloaded; retry.", type="server_error",
                               code="model_unavailable")
            engine.add_lora(spec)
            served.added_loras[spec.name] = spec
            served.removed_loras.discard(spec.name)

    def remove_adapter(self, name: str) -> None:
        """Stop serving the adapter `name` (requests running with it finish); 404 if none has it."""
        with self._lock:
            served = self.adapter_owner(name)
            if served is None:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                               code="lora_not_found")
            served.added_loras.pop(name, None)
            served.removed_loras.add(name)  # hides it in a configured or rebuilt engine's list too
            engine = served.engine
            if engine is not None and hasattr(engine, "remove_lora"):
                engine.remove_lora(name)

    def names(self) -> list[tuple[str, ServedModel]]:
        return list(self._by_name.items())

    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models if m.engine is not None and m.status == "ready"]

    # -- routing ----------------------------------------------------------------------------
    async def route(self, requested: Optional[str], allow_fallback: bool = True) -> Route:
        """The model that will answer, loaded; waits for a load (another model may answer meanwhile
        if the rule says `unavailable`). Raises APIError 503 for a model that cannot load."""
        served, adapter = self.lookup(requested)
        name = requested or served.name
        if adapter is not None:
            return await self._route_adapter(served, adapter)
        rule = served.spec.fallback
        if allow_fallback and rule is not None:
            if served.status in ("unloaded", "unloading", "failed") \
                    and any(c.kind == "unavailable" for c in rule.when):
                self._start_load(served)  # load it for later requests; this one goes elsewhere
            cause = served.trigger(rule.when)
            if cause is not None:
                other = self._by_name[rule.model]
                if other.status != "failed":
                    await self._ensure_loaded(other)
                    other.last_used = time.monotonic()
                    if self.on_degraded is not None:
                        self.on_degraded(served.name, other.name, cause)
                    return Route(other, name, cause)
        await self._ensure_loaded(served)
        served.last_used = time.monotonic()
        return Route(served, name, allow_fallback=allow_fallback)

    async def _route_adapter(self, served: ServedModel, adapter: str) -> Route:
        """The route of a request naming a LoRA adapter: its base, loaded; no fallback."""
        await self._ensure_loaded(served)
        if adapter not in served.adapters():  # unloaded while the base was loading
            raise model_not_found(adapter)
        served.last_used = time.monotonic()
        return Route(served, adapter, allow_fallback=False, adapter=adapter)

    async def fall_back(self, route: Route, cause: str) -> Optional[Route]:
        """The route to `route`'s fallback after its model refused the request for `cause` at
        admission (the check in `route` saw room, but others took it first); None when its rule
        does not cover that cause or the request forbids falling back."""
        served = route.model
        rule = served.spec.fallback
        if route.cause is not None or not route.allow_fallback or rule is None \
                or cause not in {c.kind for c in rule.when}:
            return None
        other = self._by_name[rule.model]
        if other.status == "failed":
            return None
        await self._ensure_loaded(other)
        other.last_used = time.monotonic()
        if self.on_degraded is not None:
            self.on_degraded(served.name, other.name, cause)
        return Route(other, route.requested, cause)

    async def _ensure_loaded(self, served: ServedModel) -> None:
        if served.status == "ready" and served.engine is not None:
            return
        self._start_load(served)
        await asyncio.to_thread(served.load_event.wait)
        if served.status != "ready":
            raise APIError(503, f"Model {served.name!r} could not be loaded: {served.error}", type="server_error",
                           code="model_unavailable")

    def load(self, served: ServedModel) -> None:
        """Load now, in this thread (start-up preloading: a lone model's in-process engine is then
        built on the main thread that will step it), or wait for a load already under way. Raises
        what the builder raised (the model is then `failed`): a server that cannot preload a model
        does not start."""
        if self._claim_load(served):
            error = self._load(served, log_failure=False)
            if error is not None:
                raise error
            return
        served.load_event.wait()
        if served.status == "failed":
            raise TesseraError(f"model {served.name!r} failed to load: {served.error}")

    def _start_load(self, served: ServedModel) -> None:
        if self._claim_load(served):
            threading.Thread(target=self._load, args=(served,), name=f"tessera-load-{served.name}",
                             daemon=True).start()

    def _claim_load(self, served: ServedModel) -> bool:
        """Mark `served` loading; False when it is loading or loaded already."""
        with self._lock:
            if served.status in ("loading", "ready"):
                return False
            if self.builder is None:
                raise APIError(503, f"Model {served.name!r} is not loaded.", type="server_error",
                               code="model_unavailable")
            served.status = "loading"
            served.error = None
            served.load_event.clear()
        return True

    def _load(self, served: ServedModel, log_failure: bool = True) -> Optional[Exception]:
        """Build the model's engine; a failure marks it `failed` and is returned (and logged
        with `log_failure`: nobody else will see it)."""
        assert self.builder is not None
        served.unloaded.wait()  # an unload still closing this model's loggers finishes first
        self._make_room(served)
        t0 = time.monotonic()
        logger.info("loading model %r (%s)", served.name, served.spec.model)
        try:
            engine = self.builder(served)
        except Exception as exc:  # noqa: BLE001 - reported to this model's requests, the server goes on
            if log_failure:
                logger.exception("model %r failed to load", served.name)
            with self._lock:
                served.status, served.error = "failed", f"{type(exc).__name__}: {exc}"
            served.load_event.set()
            return exc
        try:
            served.restore_adapters(engine)
        except Exception:  # noqa: BLE001 - the model serves; the adapters' own requests will say
            logger.exception("model %r: adapters loaded at run time could not be given again", served.name)
        with self._lock:
            served.engine, served.status = engine, "ready"
            served.loaded_at, served.last_used = time.time(), time.monotonic()
        served.load_event.set()
        logger.info("model %r ready in %.1f s", served.name, time.monotonic() - t0)
        return None

    def _make_room(self, incoming: ServedModel) -> None:
        """Unload least recently used idle models until `incoming` fits under max_loaded."""
        if self.max_loaded is None:
            return
        while True:
            with self._lock:
                loaded = [m for m in self.models if m.status in ("ready", "loading") and m is not incoming]
                if len(loaded) < self.max_loaded:
                    return
                now = time.monotonic()
                idle = [m for m in loaded if m.status == "ready" and not m.fixed and m.engine is not None
                        and m.engine.num_active() == 0 and not m.engine.restarting()
                        and now - m.last_used > RECENT_USE_S]
                victim = min(idle, key=lambda m: m.last_used, default=None)
            if victim is None:
                logger.warning("max_loaded_models %d reached and every loaded model is busy; loading %r anyway",
                               self.max_loaded, incoming.name)
                return
            self.unload(victim, reason=f"room for {incoming.name!r}")

    def unload(self, served: ServedModel, reason: str) -> None:
        with self._lock:
            if served.status != "ready" or served.fixed:
                return
            # "unloading" until the engine is gone and its loggers are closed: "unloaded" promises
            # the memory is free, and a load that starts meanwhile must not be clobbered below.
            engine, served.engine, served.status = served.engine, None, "unloading"
            served.load_event.clear()
            served.unloaded.clear()
        logger.info("unloading model %r (%s)", served.name, reason)
        if engine is not None:
            engine.shutdown()  # first, so its last steps' stats still reach the loggers the closer stops
        if self.closer is not None:
            self.closer(served)
        served.stats_consumer = None
        served.live = None
        # An engine in this process holds its model in reference cycles: free its weights now
        # rather than at the cyclic collector's next full pass, which may be much later.
        del engine
        gc.collect()
        with self._lock:
            if served.status == "unloading":
                served.status = "unloaded"
            served.keep_alive = served.spec.keep_alive  # a request's keep_alive lasts one loaded session
        served.unloaded.set()

    # -- keep_alive ---------------------------------------------------------------------------
    def start_reaper(self, interval_s: float = 1.0) -> None:
        """Unload models idle past their keep_alive, checked every `interval_s` on a thread."""
        if self._reaper is not None or not any(m.keep_alive is not None for m in self.models):
            return

        def run() -> None:
            while not self._stop.wait(interval_s):
                now = time.monotonic()
                for m in self.models:
                    ka = m.keep_alive
                    if ka is None or m.status != "ready" or m.engine is None:
                        continue
                    if m.engine.num_active() > 0 or m.engine.restarting():
                        m.last_used = now  # idle time counts from the end of the last request or restart
                    elif now - m.last_used > max(ka, RECENT_USE_S):  # (a request may be about to arrive)
                        self.unload(m, reason=f"idle for {ka:g} s (keep_alive)")

        self._reaper = threading.Thread(target=run, name="tessera-keep-alive", daemon=True)
        self._reaper.start()

    def set_keep_alive(self, served: ServedModel, seconds: Optional[float]) -> bool:
        """A request's keep_alive (Ollama's semantics): `served` unloads after `seconds` idle from
        now on (0: once this request is done; None: never). False for a model that cannot be
        unloaded (handed in built, or stepped on the main thread)."""
        if served.fixed or served.pinned or self.builder is None:
            return False
        served.keep_alive = seconds
        if seconds is not None:
            self.start_reaper()
        return True

    def shutdown(self) -> None:
        self._stop.set()
        for m in self.models:
            if m.engine is not None and not m.fixed:
                self.unload(m, reason="server shutdown")
