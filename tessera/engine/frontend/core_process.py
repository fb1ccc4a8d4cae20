"""The engine-core process: one model's LLMEngine stepping on its own interpreter and cores.

Started by tessera/engine/frontend/core_client.py (multiprocessing, spawn). It connects
to two ZeroMQ sockets the API process bound: requests arrive on one (adds
with token ids already checked, aborts, shutdown), and after every step the
outputs go back on the other as deltas (tessera/engine/frontend/wire.py), with the
scheduler's stats, the step's IterationStats and the wait forecast. Nothing
here parses HTTP or JSON, and the API process never runs model code: each
side keeps its own GIL and cores, and a crash here (a fault in a kernel, the
OOM killer) ends only this model's requests.

Grammar constraints are compiled here, on a small thread pool, because the
compiled form is tied to this process's tokenizer state; an unsatisfiable one
is refused back (HTTP 400). The loop steps on the process's main thread
(where torch's OpenMP threads run fastest) and polls its socket without
waiting while requests run; idle, it blocks on the socket.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import zmq

from tessera.config import EngineConfig
from tessera.engine.errors import StepFailedError
from tessera.engine.frontend import wire
from tessera.engine.input_processor import PreparedRequest

logger = logging.getLogger("tessera")

IDLE_POLL_MS = 200  # how long an idle core blocks on its socket before checking its parent
INFO_INTERVAL_S = 1.0  # how often the KV-cache and cost-model figures ride along with a step
# How long a wait forecast is reused while the queue's counts stay as they were: the forecasts
# cost ~0.15 ms a step (binary searches over the cost model), a few % of a small model's decode
# step, and within one queue shape they move only with the decodes' context and the model's fit.
FORECAST_REUSE_S = 0.25


def run_engine_core(config_pickle: bytes, in_addr: str, out_addr: str, parent_pid: Optional[int],
                    log_level: str) -> None:
    """The process's entry point: build the engine, report Ready (or StartFailed), loop until
    Shutdown or, with `parent_pid`, until that process is gone (a Ray actor has no such parent:
    Ray ends it with its owner)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the API process, which drains then stops us
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s engine-core: %(message)s")
    logging.getLogger("tessera").setLevel(log_level.upper())
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(out_addr)
    enc = wire.encoder()
    try:
        from tessera.engine.llm_engine import LLMEngine

        config: EngineConfig = pickle.loads(config_pickle)
        engine = LLMEngine(config)
        engine.warm_up()
    except BaseException as exc:  # noqa: BLE001 - reported to the API process, which raises it there
        logger.exception("engine core failed to start")
        outbox.send(enc.encode(wire.StartFailed(f"{type(exc).__name__}: {exc}")))
        outbox.close(linger=2000)
        ctx.term()
        raise SystemExit(1) from None
    outbox.send(enc.encode(wire.Ready(os.getpid(), pickle.dumps(engine.config), engine.kv_capacity_tokens,
                                      engine.get_scheduler_stats(), _info(engine))))
    try:
        _CoreLoop(engine, inbox, outbox, parent_pid).run()
    finally:
        engine.close()
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()


def _info(engine) -> wire.EngineInfo:
    return wire.EngineInfo(engine.kv_cache_info(), engine.cost_model_stats())


class _CoreLoop:
    def __init__(self, engine, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: Optional[int]) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.enc = wire.encoder()
        self.dec = wire.request_decoder()
        self.compiles: dict[str, Future] = {}  # request id -> compiled grammar, for constrained requests
        self.pending: dict[str, PreparedRequest] = {}
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tessera-grammar")
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.last_info = time.monotonic()
        self.seen = 0  # messages applied
        self.reported = 0  # `seen` as of the last result sent
        self.forecast_key: Optional[tuple] = None  # the queue counts the last forecasts were made for
        self.forecast_at = 0.0
        self.forecasts: tuple = (None, (), None)

    def run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                timeout = 0 if busy else (5 if self.compiles else IDLE_POLL_MS)
                if self.poller.poll(timeout) and not self._drain_inbox():
                    return  # Shutdown
                self._add_compiled()
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    logger.error("the API process is gone; engine core exiting")
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                elif self.reported < self.seen and not self.compiles:
                    self._report()  # e.g. an abort of what had already finished: say we are idle
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _drain_inbox(self) -> bool:
        """Apply every queued message; False on Shutdown."""
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            msg = self.dec.decode(frame)
            self.seen += 1
            if isinstance(msg, wire.AddRequest):
                self._add(msg)
            elif isinstance(msg, wire.AbortRequests):
                for rid in msg.request_ids:
                    if self.compiles.pop(rid, None) is not None:
                        self.pending.pop(rid, None)
                    self.engine.abort_request(rid)
            elif isinstance(msg, wire.AddLoRA):
                self._add_lora(msg.spec)
            elif isinstance(msg, wire.RemoveLoRA):
                self.engine.remove_lora(msg.name)
            else:
                return False

    def _add_lora(self, spec) -> None:
        """Serve an adapter the API process checked; one refused here (this engine has no LoRA
        support, or a smaller rank limit) is only logged: the API process checked the same limits."""
        from tessera.errors import AdapterError

        try:
            self.engine.add_lora(spec)
        except AdapterError as exc:
            logger.error("%s", exc)

    def _add(self, msg: wire.AddRequest) -> None:
        prepared = msg.request
        constraint = prepared.params.structured_outputs
        if constraint is None:
            self._admit(prepared)
            return
        self.pending[prepared.request_id] = prepared
        self.compiles[prepared.request_id] = self.pool.submit(self._compile, constraint)

    def _compile(self, constraint) -> tuple[object, float]:
        t0 = time.perf_counter()
        return self.engine.structured.compile(constraint), time.perf_counter() - t0

    def _add_compiled(self) -> None:
        from tessera.sampling_params import InvalidRequestError

        for rid in [rid for rid, fut in self.compiles.items() if fut.done()]:
            fut = self.compiles.pop(rid)
            prepared = self.pending.pop(rid)
            try:
                prepared.grammar, prepared.grammar_compile_time = fut.result()
            except InvalidRequestError as exc:
                self._send(wire.RequestRefused(rid, str(exc), True))
                continue
            except Exception as exc:  # noqa: BLE001 - the compiler failing is this request's error, not ours
                logger.exception("compiling the constraint of %s failed", rid)
                self._send(wire.RequestRefused(rid, f"compiling the constraint failed: {exc}", False))
                continue
            self._admit(prepared)

    def _admit(self, prepared: PreparedRequest) -> None:
        from tessera.sampling_params import InvalidRequestError

        try:
            self.engine.add_prepared(prepared)
        except InvalidRequestError as exc:  # a duplicate id
            self._send(wire.RequestRefused(prepared.request_id, str(exc), True))

    def _step(self) -> None:

        engine = self.engine
        failed: list[str] = []
        failure: Optional[str] = None
        try:
            outputs, stats = engine.step_with_stats()
        except StepFailedError as exc:  # its requests were ended and freed; the core goes on
            outputs, stats = [], None
            failed, failure = exc.request_ids, f"{type(exc.cause).__name__}: {exc.cause}"
        self._report([wire.to_delta(o) for o in outputs], stats, failed, failure)

    def _report(self, outputs: Optional[list] = None, stats=None, failed: Optional[list[str]] = None,
                failure: Optional[str] = None) -> None:
        """Send a result: the step's outputs (if any) with the state the API process mirrors."""
        engine = self.engine
        forecast, by_priority, prompt = self._forecasts()
        info = None
        now = time.monotonic()
        if now - self.last_info >= INFO_INTERVAL_S:
            info, self.last_info = _info(engine), now
        idle = not engine.has_unfinished_requests() and not self.compiles
        self._send(wire.StepResult(outputs or [], engine.get_scheduler_stats(), stats, engine.num_waiting_requests(),
                                   forecast, failed or [], failure, info, self.seen, idle, by_priority, prompt))
        self.reported = self.seen

    def _forecasts(self) -> tuple:
        """(wait forecast, per priority class, a prompt's own time) for a newcomer, each linear in
        its prompt; reused for FORECAST_REUSE_S while the queue's counts are unchanged."""
        engine = self.engine
        snapshot = engine.load_snapshot()
        key = (snapshot.queued_prefill_tokens, snapshot.num_waiting, snapshot.num_decoding,
               snapshot.num_prefilling, snapshot.free_seq_slots, snapshot.waiting_by_priority,
               snapshot.best_priority_seen)
        now = time.monotonic()
        if key == self.forecast_key and now - self.forecast_at < FORECAST_REUSE_S:
            return self.forecasts
        base = engine.predict_wait(snapshot, 0)
        forecast, by_priority, prompt = None, [], None
        if base is not None:
            forecast = (base, (engine.predict_wait(snapshot, 1024) - base) / 1024)
            idle = engine.predict_prompt(0)
            prompt = (idle, (engine.predict_prompt(1024) - idle) / 1024)
            if engine.config.scheduling_policy == "priority":
                for p in (wire.NO_CLASS, *(c[0] for c in snapshot.waiting_by_priority)):
                    b = engine.predict_wait(snapshot, 0, p)
                    by_priority.append((p, b, (engine.predict_wait(snapshot, 1024, p) - b) / 1024))
        self.forecast_key, self.forecast_at = key, now
        self.forecasts = (forecast, tuple(by_priority), prompt)
        return self.forecasts

    def _send(self, msg) -> None:
        self.outbox.send(self.enc.encode(msg), copy=False)
