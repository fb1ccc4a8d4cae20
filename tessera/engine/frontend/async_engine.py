"""The engine loop on a thread apart from the HTTP event loop, fed and drained from asyncio (what
it drives and serves, as protocols: protocols.py).

The HTTP event loop never runs model code and the engine loop never waits
on the network: requests cross over through a command queue, outputs come
back through one asyncio.Queue per request. Tokenization and validation run
in the caller, so a bad request is refused before it reaches the engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable, Iterable, Optional, Union

from tessera.config import EngineConfig
from tessera.engine.errors import (
    EngineCoreDiedError, EngineDeadError, EngineStepError, PredictedWaitError, QueueFullError, StepFailedError,
)
from tessera.engine.frontend.protocols import CoreFactory, EngineCore, StatLogger, make_engine_core
from tessera.engine.input_processor import PreparedRequest
from tessera.vision import ImageInput
from tessera.engine.outputs import RequestOutput
from tessera.engine.stats import SchedulerStats
from tessera.models.adapters import AdapterSpec, read_adapter
from tessera.pooling_params import PoolingParams
from tessera.sampling_params import SamplingParams

logger = logging.getLogger("tessera")


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in puts:
        q.put_nowait(item)


class AsyncLLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        max_num_queued_requests: Optional[int] = None,
        stat_loggers: Iterable[StatLogger] = (),
        stats_sink=None,
        engine: Optional[EngineCore] = None,
        start_thread: bool = True,
        step_timeout: Optional[float] = None,
        max_queue_wait: Optional[float] = None,
        engine_process: bool = False,
        log_level: str = "info",
        core_factory: Optional[CoreFactory] = None,
    ) -> None:
        """`start_thread=False` leaves the loop to the caller's `run_until()`: `tessera serve`
        runs it on the main thread, where torch's OpenMP threads measured about 1.4x faster
        per step than from a secondary thread on this 2-core machine. The core is `engine` if
        given, else `core_factory(config, wakeup)` (the server's choice, see make_engine_core),
        else an in-process LLMEngine, or with `engine_process` one in a process of its own (this
        object then only feeds it)."""
        self._wakeup = threading.Event()
        if engine is None:
            if core_factory is None:
                engine = make_engine_core(config, self._wakeup, engine_process=engine_process, log_level=log_level)
            else:
                engine = core_factory(config, self._wakeup)
        self.engine: EngineCore = engine
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.max_num_queued_requests = max_num_queued_requests
        self.stat_loggers = list(stat_loggers)
        self.stats_sink = stats_sink  # object with put(scheduler_stats, iteration_stats), e.g. StatsConsumer
        self._commands: "queue.SimpleQueue[tuple[str, object]]" = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Adapters the core serves, by name: --lora-modules (the core read them too) and those added since.
        self._loras: dict[str, AdapterSpec] = {
            m.name: read_adapter(m.name, m.path, self.model_config, self.config.max_lora_rank)
            for m in self.config.lora_modules}
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._pending_by_priority: dict[int, int] = {}  # adds not yet in the core, per priority
        self._num_waiting = 0
        self._stats = self.engine.get_scheduler_stats()
        self._snapshot = self.engine.load_snapshot()
        self._dead: Optional[BaseException] = None
        self._restarting: Optional[str] = None  # why the engine core is being restarted, while it is
        # Watchdog: a step running longer than this makes the engine unhealthy (/health 503, new
        # requests refused) until it returns; None = no watchdog.
        self.step_timeout = step_timeout
        # Admission by forecast: a request whose prompt the step-cost model expects to wait longer
        # than this is refused at once (429), so what is admitted keeps its latency under overload.
        self.max_queue_wait = max_queue_wait
        self._step_started: Optional[float] = None
        self._stop = False
        self._loop_exited = False
        self._thread: Optional[threading.Thread] = None
        if start_thread:
            self._thread = threading.Thread(target=self._loop, name="tessera-engine", daemon=True)
            self._thread.start()

    # -- caller side --------------------------------------------------------------
    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if self._restarting is not None:
            raise EngineDeadError(f"{self._restarting}; restarting it")
        if self._loop_exited:
            raise EngineDeadError("engine loop is not running")
        started = self._step_started
        if started is not None and self.step_timeout is not None:
            running = time.monotonic() - started
            if running > self.step_timeout:
                raise EngineDeadError(f"an engine step has been running for {running:.0f} s, past the "
                                      f"{self.step_timeout:g} s watchdog (--engine-step-timeout)")

    def get_scheduler_stats(self) -> SchedulerStats:
        return self._stats

    def num_active(self) -> int:
        """Requests in flight through generate() (waiting, running or being admitted)."""
        with self._lock:
            return len(self._streams) + self._pending_adds

    def restarting(self) -> bool:
        """Whether a new engine-core process is being started after the last one died (a model
        in that state is busy, not idle: keep_alive must not unload it meanwhile)."""
        return self._restarting is not None

    def num_queued(self, priority: Optional[int] = None) -> int:
        """Requests waiting; with `priority` under the priority policy, only those ahead of a
        newcomer of that priority (its class and higher ones): the queue bound is per class."""
        with self._lock:
            if priority is None or self.config.scheduling_policy != "priority":
                return self._pending_adds + self._num_waiting
            pending = sum(n for p, n in self._pending_by_priority.items() if p <= priority)
            return pending + sum(w for p, _, w in self._stats.requests_by_priority if p <= priority)

    def predicted_wait(self, prompt_tokens: int = 0, priority: int = 0) -> Optional[float]:
        """Forecast of the seconds a request of `prompt_tokens` (and `priority`) arriving now waits
        for its prompt."""
        return self.engine.predict_wait(self._snapshot, prompt_tokens, priority)

    def cost_model_stats(self) -> dict:
        return self.engine.cost_model_stats()

    def kv_cache_info(self) -> dict:
        return self.engine.kv_cache_info()

    async def prepare(self, prompt: Union[str, list[int]], params: SamplingParams, request_id: str,
                      add_special_tokens: bool = True, pooling: Optional[PoolingParams] = None,
                      images: Optional[list[ImageInput]] = None) -> PreparedRequest:
        """Tokenize and check a request (in the caller: a bad one never reaches the engine)."""
        if pooling is not None:
            return self.engine.prepare_request(request_id, prompt, params, add_special_tokens=add_special_tokens,
                                               pooling=pooling, **({"images": images} if images else {}))
        # images only when there are some: cores of text models (and test fakes) take no such argument
        extra = {"images": images} if images else {}
        if params.structured_outputs is not None:  # compiling a grammar may take a while: not on the event loop
            return await asyncio.to_thread(self.engine.prepare_request, request_id, prompt, params,
                                           add_special_tokens=add_special_tokens, **extra)
        return self.engine.prepare_request(request_id, prompt, params, add_special_tokens=add_special_tokens, **extra)

    async def generate(
        self,
        prompt: Union[str, list[int]],
        params: SamplingParams,
        request_id: str,
        add_special_tokens: bool = True,
        deadline_s: Optional[float] = None,
        prepared: Optional[PreparedRequest] = None,
        restartable: bool = False,
        pooling: Optional[PoolingParams] = None,
        lora_name: Optional[str] = None,
        extend_deadline: Optional[Callable[[float], None]] = None,
        images: Optional[list[ImageInput]] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iterator early aborts the request.

        `deadline_s`: seconds the request may take in all, besides its prompt's own computation:
        the step-cost model forecasts both the wait for the work ahead of it and its prompt's
        computation on an idle engine; the second goes to `extend_deadline` (the caller's timer)
        and the first, past `deadline_s`, is refused at once with PredictedWaitError (a retry
        later may fit; a long prompt is given its time rather than cut after minutes of work).
        `prepared`: the request already tokenized by `prepare` (a replica router reads its tokens).
        `restartable`: the caller reads only the final output; a ReplicaSet may then rerun the
        request elsewhere after its replica died mid-way (one engine has nowhere to: ignored).
        `pooling`: an embedding request (vLLM's pooling task): its prompt is computed in one step
        and its one output carries the vector. The queue bound is the caller's to check once for
        a batch of inputs (one API request), not once per input: an embedding request of 256
        texts would otherwise fill a 128-request queue by itself.
        """
        self.check_health()
        if prepared is None:
            prepared = await self.prepare(prompt, params, request_id, add_special_tokens, pooling, images)
        if lora_name is not None:
            prepared = dataclasses.replace(prepared, lora_name=lora_name)
        prompt_tokens = len(prepared.prompt_token_ids) * params.n
        wait = self.predicted_wait(prompt_tokens, params.priority)
        own = self.engine.predict_prompt(prompt_tokens)
        if deadline_s is not None and wait is not None:
            ahead = wait - (own or 0.0)
            if ahead > deadline_s:
                raise PredictedWaitError(
                    f"the forecast wait for the work ahead of this request is {ahead:.1f} s, past its "
                    f"{deadline_s:.0f} s deadline; retry later", retry_after=ahead - deadline_s)
            if own and extend_deadline is not None:
                extend_deadline(own)
        if self.max_queue_wait is not None and wait is not None and wait > self.max_queue_wait:
            raise PredictedWaitError(
                f"the forecast wait for this request's prompt is {wait:.1f} s, past the server's "
                f"--max-queue-wait of {self.max_queue_wait:g} s; retry later", retry_after=wait - self.max_queue_wait)
        limit = self.max_num_queued_requests
        if limit is not None and prepared.pooling is None and self.num_queued(params.priority) >= limit:
            raise QueueFullError(f"the server has {limit} requests waiting; retry later")
        with self._lock:
            self._pending_adds += 1
            self._pending_by_priority[params.priority] = self._pending_by_priority.get(params.priority, 0) + 1
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        self._send("add", prepared)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    def warm_up(self) -> None:
        self.engine.warm_up()

    async def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def shutdown(self) -> None:
        self._stop = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.engine.close()

    def add_lora(self, spec: AdapterSpec) -> None:
        """Serve a LoRA adapter (checked by models.lora.read_adapter) from the next step on; kept
        here too, so a restarted core is given it again."""
        self._loras[spec.name] = spec
        self._send("add_lora", spec)

    def remove_lora(self, name: str) -> None:
        self._loras.pop(name, None)
        self._send("remove_lora", name)

    def lora_adapters(self) -> list[AdapterSpec]:
        return list(self._loras.values())

    def _send(self, kind: str, payload: object) -> None:
        self._commands.put((kind, payload))
        self._wakeup.set()

    # -- engine loop side ---------------------------------------------------------
    def _deliver(self, request_id: str, item: object) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """Hand each item to its caller's queue: one wake-up of each caller's event loop for all
        of a step's outputs (each wake-up is a write to the loop's self-pipe and a context
        switch, and a step of 32 streams made 32)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:  # the caller's loop is closed
                pass

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                assert isinstance(payload, PreparedRequest)
                with self._lock:
                    self._pending_adds -= 1
                    priority = payload.params.priority
                    left = self._pending_by_priority.pop(priority, 0) - 1
                    if left > 0:
                        self._pending_by_priority[priority] = left
                if payload.request_id not in self._streams:
                    continue  # its caller already left
                try:
                    self.engine.add_prepared(payload)
                except Exception as e:  # duplicate id or similar: tell that caller only
                    self._deliver(payload.request_id, e)
            elif kind == "abort":
                self.engine.abort_request(str(payload))
            elif kind == "add_lora":
                self.engine.add_lora(payload)
            elif kind == "remove_lora":
                self.engine.remove_lora(str(payload))

    def _restart_core(self, exc: BaseException) -> None:
        """The engine core died: fail what it was running, start a new one (health 503
        meanwhile); if that fails too (or the core cannot restart), the engine is dead."""
        core = self.engine
        lost = core.in_flight()
        logger.error("%s; failing its %d request(s) and restarting it", exc, len(lost))
        self._restarting = str(exc)
        err = EngineDeadError(f"{exc}; the request was lost")
        for rid in lost:
            self._deliver(rid, err)
        core.restart()
        for spec in list(self._loras.values()):
            core.add_lora(spec)
        self._stats = core.get_scheduler_stats()
        self._snapshot = core.load_snapshot()
        with self._lock:
            self._num_waiting = 0
        self._restarting = None
        logger.info("engine core restarted")

    def core_info(self) -> dict:
        """Where the engine runs, for /v1/engine/stats."""
        return self.engine.describe()

    def run_until(self, done: Callable[[], bool]) -> None:
        """Run the engine loop in the calling thread until `done()` or shutdown()."""
        self._loop(done)

    def _loop(self, done: Optional[Callable[[], bool]] = None) -> None:
        try:
            while not self._stop and not (done is not None and done()):
                self._drain_commands()
                with self._lock:
                    self._num_waiting = self.engine.num_waiting_requests()
                if not self.engine.has_unfinished_requests():
                    self._step_started = None
                    if not self.engine.alive:  # died while idle
                        self._restart_core(EngineCoreDiedError("the engine core exited while idle"))
                        continue
                    self._stats = self.engine.get_scheduler_stats()
                    self._snapshot = self.engine.load_snapshot()
                    self._wakeup.wait(timeout=0.2)
                    self._wakeup.clear()
                    continue
                if self._step_started is None:  # kept across a remote core's early returns: the watchdog
                    self._step_started = time.monotonic()  # measures time without a result
                try:
                    outputs, it_stats = self.engine.step_with_stats()
                except StepFailedError as exc:  # its requests were ended; tell their callers, go on
                    self._step_started = None
                    for rid in exc.request_ids:
                        self._deliver(rid, exc.errors.get(rid) or EngineStepError(
                            f"the engine step running this request failed ({type(exc.cause).__name__}: "
                            f"{exc.cause}); the request was ended"))
                    self._stats = self.engine.get_scheduler_stats()
                    self._snapshot = self.engine.load_snapshot()
                    continue
                except Exception as exc:
                    if not isinstance(exc, EngineCoreDiedError):
                        raise
                    self._step_started = None
                    self._restart_core(exc)
                    continue
                if it_stats is None and not outputs:
                    continue  # a remote core had no result yet; new commands are waiting
                self._step_started = None
                with self._lock:  # before the outputs: a caller seeing a first token sees its request left the queue
                    self._num_waiting = self.engine.num_waiting_requests()
                self._deliver_all([(out.request_id, out) for out in outputs])
                self._stats = self.engine.get_scheduler_stats()
                self._snapshot = self.engine.load_snapshot()
                if self.stats_sink is not None:
                    self.stats_sink.put(self._stats, it_stats)
                for sl in self.stat_loggers:
                    sl.record(self._stats, it_stats)
        except KeyboardInterrupt:
            raise  # the caller (serve) drains and stops; the engine itself is fine
        except BaseException as e:  # keep the reason for /health, fail every waiter
            logger.exception("engine loop died")
            self._dead = e
            self._loop_exited = True
            err = EngineDeadError(f"engine loop died: {e!r}")
            for rid in list(self._streams):
                self._deliver(rid, err)
        else:
            self._loop_exited = self._stop
