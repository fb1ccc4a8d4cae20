"""The engine's LoRA adapters: which are served, which are in memory, loading off the step loop.

An adapter is served once `add` is given its checked spec (models/adapters.py). Its values are
read on a worker thread when a request first needs them, so a step never waits on a file: the
scheduler admits only requests whose adapter is loaded (`ready`), the others wait. At most
`lora_cache_size` adapters stay in memory; the least recently used one that no unfinished request
needs is dropped to make room, and read again when asked for. `remove` stops serving an adapter
at once (new requests are refused) while its running requests finish with its weights.

Everything but the worker's read runs on the engine's loop thread.
"""
from __future__ import annotations

import logging
import queue
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Optional

from tessera.errors import AdapterError
from tessera.models.adapters import AdapterSpec
from tessera.models.lora_weights import LoRAWeights

logger = logging.getLogger("tessera")

Loader = Callable[[AdapterSpec], LoRAWeights]


class LoRAManager:
    def __init__(self, capacity: int, loader: Loader) -> None:
        self.capacity = capacity
        self.loader = loader
        self.specs: dict[str, AdapterSpec] = {}  # served adapters by name
        self.loaded: OrderedDict[str, LoRAWeights] = OrderedDict()  # in memory, least recently used first
        self.failed: dict[str, str] = {}  # adapters whose last load failed: why
        self._loading: set[str] = set()
        self._done: "queue.SimpleQueue[tuple[str, AdapterSpec, Optional[LoRAWeights], Optional[str]]]" = \
            queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-lora-load")

    # -- what is served ----------------------------------------------------------------------
    def add(self, spec: AdapterSpec) -> None:
        """Serve `spec` under its name; the same file again changes nothing, another file under a
        served name replaces it (its weights are read again)."""
        old = self.specs.get(spec.name)
        self.specs[spec.name] = spec
        self.failed.pop(spec.name, None)
        if old is not None and old.digest != spec.digest:
            self.loaded.pop(spec.name, None)

    def remove(self, name: str) -> bool:
        """Stop serving `name` (requests already running with it finish); False if not served."""
        return self.specs.pop(name, None) is not None

    def salt(self, name: str) -> str:
        spec = self.specs.get(name)
        if spec is None:
            raise AdapterError(f"the LoRA adapter {name!r} is not served here")
        return spec.digest

    # -- loading ---------------------------------------------------------------------------
    def ready(self) -> frozenset[str]:
        """Adapters whose weights are in memory (one no longer served stays only while requests
        that started with it remain: a preempted one must be able to resume)."""
        return frozenset(self.loaded)

    def want(self, names: Iterable[str], in_use: set[str]) -> None:
        """Collect finished loads, and start loading the adapters `names` that are served but not
        in memory. `in_use`: adapters unfinished requests hold (never dropped for room)."""
        self._collect(in_use)
        for name in names:
            spec = self.specs.get(name)
            if spec is None or name in self.loaded or name in self._loading or name in self.failed:
                continue
            self._loading.add(name)
            self._pool.submit(self._load, spec)

    def _load(self, spec: AdapterSpec) -> None:
        try:
            self._done.put((spec.name, spec, self.loader(spec), None))
        except Exception as exc:  # reported on the loop thread; the requests for it are refused
            logger.exception("loading LoRA adapter %r failed", spec.name)
            self._done.put((spec.name, spec, None, str(exc)))

    def _collect(self, in_use: set[str]) -> None:
        while True:
            try:
                name, spec, weights, error = self._done.get_nowait()
            except queue.Empty:
                break
            self._loading.discard(name)
            if self.specs.get(name) is not spec:
                continue  # removed or replaced while it loaded
            if weights is None:
                self.failed[name] = error or "unknown error"
                continue
            self.loaded[name] = weights
            logger.info("LoRA adapter %r loaded (rank %d, %.1f MiB)", name, weights.rank, weights.nbytes() / 2**20)
        for name in [n for n in self.loaded if n not in self.specs and n not in in_use]:
            del self.loaded[name]  # no longer served, and its last requests have finished
        while len(self.loaded) > self.capacity:
            idle = next((n for n in self.loaded if n not in in_use), None)
            if idle is None:
                break
            del self.loaded[idle]

    @property
    def loading(self) -> bool:
        return bool(self._loading)

    def weights(self, name: str) -> LoRAWeights:
        """An in-memory adapter's weights (the runner's lookup), marked most recently used."""
        self.loaded.move_to_end(name)
        return self.loaded[name]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
