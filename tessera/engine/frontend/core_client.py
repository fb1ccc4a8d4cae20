"""The API process's side of an engine-core process (`tessera serve --engine-process`).

`ProcessEngineCore` implements the EngineCore protocol that AsyncLLMEngine
drives, so the front end (admission, streams, watchdog, stats) is the same
whether the engine steps in this process or in its own. Here it only:
- tokenizes and checks requests (InputProcessor, with the tokenizer loaded
  without the weights) and sends token ids and parameters;
- turns each step's deltas back into the RequestOutputs callers expect
  (wire.OutputAssembler);
- keeps the last scheduler stats, wait forecast and KV/cost-model figures the
  core sent, for /v1/engine/stats and admission;
- notices the process dying (EngineCoreDiedError) and can start a new one.
vLLM V1 has the same split (API server process, EngineCore process, ZeroMQ);
see docs/ARCHITECTURE.md for what it buys on a 2-core CPU.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
from collections import deque
from typing import Optional, Union

import zmq

from tessera.config import EngineConfig
from tessera.engine.errors import EngineCoreDiedError, EngineCoreStepError, StepFailedError
from tessera.engine.frontend import wire
from tessera.engine.frontend.core_process import run_engine_core
from tessera.engine.input_processor import InputLimits, InputProcessor, PreparedRequest
from tessera.vision import ImageInput
from tessera.engine.outputs import RequestOutput
from tessera.engine.stats import IterationStats, LoadSnapshot, SchedulerStats
from tessera.errors import TesseraError
from tessera.models.adapters import AdapterSpec
from tessera.pooling_params import PoolingParams
from tessera.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger("tessera")

RESULT_POLL_MS = 20  # how often a wait for the core's next step looks at the process and new commands


class ProcessEngineCore:
    """An EngineCore whose engine runs in a child process; one per model.

    `wakeup` (AsyncLLMEngine's event) makes a wait for the core's next result return early
    when the front end has new commands to hand over.
    """

    def __init__(self, config: EngineConfig, *, log_level: str = "info",
                 wakeup: Optional[threading.Event] = None) -> None:
        from tessera.models.info import load_model_info
        from tessera.models.registry import resolve_model

        self.requested_config = config
        self.log_level = log_level
        self.wakeup = wakeup
        self.model_config, self.tokenizer = load_model_info(resolve_model(config.model))
        self._ctx = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="tessera-core-")
        self._enc = wire.encoder()
        self._dec = wire.output_decoder()
        self._send_lock = threading.Lock()
        self.restarts = 0
        self._closed = False
        self._generation = 0
        self.process: Optional[multiprocessing.process.BaseProcess] = None
        self._start()

    # -- process life ----------------------------------------------------------------------
    def _start(self) -> None:
        self._generation += 1
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # never drop or block an add: admission bounds the queue
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.RCVHWM, 0)
        in_addr, out_addr = self._bind(self._to_core, "in"), self._bind(self._from_core, "out")
        self._launch(pickle.dumps(self.requested_config), in_addr, out_addr)
        ready = self._wait_ready()
        self.pid = ready.pid
        self.config: EngineConfig = pickle.loads(ready.config)
        self.inputs = InputProcessor(self.tokenizer, InputLimits.for_engine(self.model_config, self.config,
                                                                            ready.kv_capacity_tokens))
        self.assembler = wire.OutputAssembler()
        self._stats = ready.scheduler
        self._info = ready.info
        self._forecast: Optional[tuple[float, float]] = None
        self._forecast_by_priority: tuple[tuple[int, float, float], ...] = ()
        self._forecast_prompt: Optional[tuple[float, float]] = None
        self._num_waiting = 0  # the core's waiting queue at its last result
        # What the core has not answered yet: messages sent vs applied by its last result (an abort
        # of the last request must still be seen to free its blocks), and adds it has not seen.
        self._sent = 0
        self._core_seen = 0
        self._core_idle = True
        self._unseen_adds: deque[int] = deque()
        logger.info("engine core for %s running as process %d", self.config.model, self.pid)

    def _bind(self, sock: zmq.Socket, direction: str) -> str:
        """Bind one of the two sockets; returns the address the core connects to (a Unix socket
        here; TCP for a core on another machine)."""
        addr = f"ipc://{self._dir}/{direction}-{self._generation}"
        sock.bind(addr)
        return addr

    def _launch(self, config_pickle: bytes, in_addr: str, out_addr: str) -> None:
        """Start the core (it connects to the two addresses and reports Ready)."""
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=run_engine_core, name=f"tessera-core-{self.requested_config.model}", daemon=True,
            args=(config_pickle, in_addr, out_addr, os.getpid(), self.log_level))
        self.process.start()

    def _exit_code(self) -> Optional[int]:
        return None if self.process is None else self.process.exitcode

    def _wait_ready(self) -> wire.Ready:
        while True:
            if self._from_core.poll(500):
                msg = self._dec.decode(self._from_core.recv())
                if isinstance(msg, wire.Ready):
                    return msg
                if isinstance(msg, wire.StartFailed):
                    self._stop_core(kill=False)
                    raise TesseraError(f"the engine core for {self.requested_config.model} could not start: "
                                       f"{msg.message}")
                continue
            if not self.alive:
                raise TesseraError(f"the engine core for {self.requested_config.model} exited with code "
                                   f"{self._exit_code()} while starting (see the log above)")

    def _close_sockets(self) -> None:
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)

    def restart(self) -> None:
        """Start a fresh engine core after the last one died (blocking: it loads the model)."""
        self._stop_core(kill=True)
        self._close_sockets()
        self.restarts += 1
        self._start()

    def _stop_core(self, kill: bool) -> None:
        """Make sure the core has exited (`kill`: at once; otherwise give it time to finish)."""
        if self.process is None:
            return
        if kill and self.process.is_alive():
            self.process.kill()
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)

    def close(self) -> None:
        """Ask the core to stop (it flushes its disk tier), then make sure it has."""
        if self._closed:
            return
        self._closed = True
        if self.alive:
            with self._send_lock:
                self._to_core.send(self._enc.encode(wire.Shutdown()))
        self._stop_core(kill=False)
        self._close_sockets()
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        self.process = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    # -- the EngineCore protocol -----------------------------------------------------------
    def prepare_request(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                        arrival_time: Optional[float] = None, add_special_tokens: bool = True,
                        pooling: Optional[PoolingParams] = None,
                        images: Optional[list[ImageInput]] = None) -> PreparedRequest:
        """Tokenize and check here; a constraint is compiled (and may be refused) in the core."""
        return self.inputs.process(request_id, prompt, params, arrival_time, add_special_tokens, pooling, images)

    def add_prepared(self, p: PreparedRequest) -> None:
        if p.request_id in self.assembler:
            raise InvalidRequestError(f"request id {p.request_id!r} is already in use")
        try:
            frame = self._enc.encode(wire.AddRequest(p))
        except (UnicodeEncodeError, OverflowError) as exc:  # lone surrogates, integers past 64 bits
            raise InvalidRequestError(f"the request cannot be passed to the engine: {exc}") from None
        self.assembler.add(p.request_id, p.prompt, p.prompt_token_ids)
        self._send_frame(frame)
        self._unseen_adds.append(self._sent)

    def add_lora(self, spec: AdapterSpec) -> None:
        self._send(wire.AddLoRA(spec))

    def remove_lora(self, name: str) -> None:
        self._send(wire.RemoveLoRA(name))

    def abort_request(self, request_id: str) -> None:
        if request_id in self.assembler:
            self.assembler.forget(request_id)
            self._send(wire.AbortRequests([request_id]))

    def _send(self, msg: wire.CoreRequest) -> None:
        self._send_frame(self._enc.encode(msg))

    def _send_frame(self, frame: bytes) -> None:
        with self._send_lock:
            self._to_core.send(frame, copy=False)
            self._sent += 1

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or messages whose effect the core has not reported yet."""
        return len(self.assembler) > 0 or self._sent > self._core_seen or not self._core_idle

    def num_waiting_requests(self) -> int:
        """The core's waiting queue as last reported, plus the adds it had not seen then."""
        return self._num_waiting + len(self._unseen_adds)

    def get_scheduler_stats(self) -> SchedulerStats:
        return self._stats

    def load_snapshot(self) -> LoadSnapshot:
        return LoadSnapshot()  # the forecast is computed in the core (see predict_wait)

    def predict_wait(self, snapshot: LoadSnapshot, prompt_tokens: int, priority: int = 0) -> Optional[float]:
        """The core's latest forecast for a newcomer of `prompt_tokens` and `priority` (`snapshot` is
        not needed)."""
        if self._forecast is None:
            return None
        base, per_token = self._forecast
        for p, b, t in self._forecast_by_priority:  # ascending: the last class at or below it
            if p > priority:
                break
            base, per_token = b, t
        return base + per_token * prompt_tokens

    def predict_prompt(self, prompt_tokens: int) -> Optional[float]:
        """The core's latest forecast of a prompt's own computation on an idle engine."""
        if self._forecast_prompt is None:
            return None
        base, per_token = self._forecast_prompt
        return base + per_token * prompt_tokens

    def cost_model_stats(self) -> dict:
        return self._info.cost_model_stats

    def kv_cache_info(self) -> dict:
        return self._info.kv_cache_info

    def warm_up(self) -> None:
        """The chat template's compilation, here where requests are tokenized (the core warmed
        up its own side before it reported Ready)."""
        self.tokenizer.warm_up()

    def step_with_stats(self) -> tuple[list[RequestOutput], Optional[IterationStats]]:
        """The core's next result: its step's outputs and stats. Returns ([], None) early when
        `wakeup` is set (commands to hand over); raises StepFailedError for requests a step or
        the core refused, EngineCoreDiedError if the process is gone."""

        while not self._from_core.poll(RESULT_POLL_MS):
            if not self.alive:
                raise EngineCoreDiedError(f"the engine-core process of {self.config.model} exited "
                                          f"(code {self._exit_code()})")
            if self.wakeup is not None and self.wakeup.is_set():
                self.wakeup.clear()
                return [], None
        msg = self._dec.decode(self._from_core.recv())
        if isinstance(msg, wire.RequestRefused):
            if msg.request_id not in self.assembler:
                return [], None  # aborted here meanwhile
            self.assembler.forget(msg.request_id)
            cause: Exception = InvalidRequestError(msg.message) if msg.invalid else EngineCoreStepError(msg.message)
            raise StepFailedError([msg.request_id], cause, errors={msg.request_id: cause})
        if not isinstance(msg, wire.StepResult):
            return [], None
        self._stats = msg.scheduler
        self._num_waiting = msg.num_waiting
        self._core_seen, self._core_idle = msg.seen, msg.idle
        while self._unseen_adds and self._unseen_adds[0] <= msg.seen:
            self._unseen_adds.popleft()
        self._forecast = msg.forecast
        self._forecast_by_priority = msg.forecast_by_priority
        self._forecast_prompt = msg.forecast_prompt
        if msg.info is not None:
            self._info = msg.info
        outputs = [out for out in (self.assembler.apply(d) for d in msg.outputs) if out is not None]
        if msg.failed:
            failed = [rid for rid in msg.failed if rid in self.assembler]
            for rid in failed:
                self.assembler.forget(rid)
            raise StepFailedError(failed, EngineCoreStepError(msg.failure or "the step failed"))
        return outputs, msg.iteration

    def in_flight(self) -> list[str]:
        return self.assembler.request_ids()

    def describe(self) -> dict:
        """For /v1/engine/stats: which process runs the engine, and how often it was restarted."""
        return {"engine_process": True, "pid": self.pid if self.alive else None, "alive": self.alive,
                "restarts": self.restarts}
