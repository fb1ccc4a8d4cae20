"""An engine without a model, for server tests that must know every output exactly.

FakeCore is a small LLMEngine whose "model" writes a fixed reply byte by byte (REPLY, then EOS),
under the real AsyncLLMEngine (its thread, queue bound and abort path); serve_in_thread runs an
app on a real uvicorn server in a background thread, so client disconnects are real socket closes.
"""
from __future__ import annotations

import random
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional
import httpx
import uvicorn
from tessera.config import EngineConfig, ModelConfig
from tessera.engine.stats import LoadSnapshot
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.input_processor import PreparedRequest
from tessera.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tessera.engine.stats import IterationStats, SchedulerStats
from tessera.sampling_params import InvalidRequestError, SamplingParams
from tessera.server.app import create_app

MODEL = "fake-model"
EOS = 256
REPLY = "Hello from the fake engine."  # greedy output, then EOS
ALPHABET = "abcdefghijklmnopqrstuvwxyz "


# ----------------------------------------------------------------------------- a scripted engine core


class ByteTokenizer:
    """One token per UTF-8 byte, plus EOS."""

    eos_token_ids = [EOS]
    bos_token_id = None
    vocab_size = 257
    chat_template = "a template that renders no tools"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bounded(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> list[int]:
        return self.encode(text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return "</s>" if token_id == EOS else self.decode([token_id])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None) -> str:
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unknown role {m['role']}")  # what a jinja template's raise_exception does
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


@dataclass
class _Child:
    index: int
    rng: Optional[random.Random]
    out: CompletionOutput
    emitted_tokens: int = 0
    emitted_logprobs: int = 0
    emitted_text: int = 0


@dataclass
class _Req:
    prepared: PreparedRequest
    children: list[_Child]
    blocks: int = 0
    steps: int = 0

    @property
    def finished(self) -> bool:
        return all(c.out.finished for c in self.children)


@dataclass
class FakeCore:
    """What AsyncLLMEngine needs of LLMEngine: greedy sampling writes REPLY then EOS; sampling with
    temperature > 0 picks letters with a per-sample RNG seeded from (seed, index); logprobs are -1 for
    the chosen token. KV blocks are reserved for prompt + max_tokens at admission, so usage is exact."""

    step_s: float = 0.005
    max_model_len: int = 256
    block_size: int = 16
    num_blocks: int = 64
    max_num_seqs: int = 4
    fail_after_steps: Optional[int] = None  # the loop dies on this step (EngineDeadError)
    forecast_wait_s: Optional[float] = None  # what predict_wait answers (None: no cost model)
    own_prompt_s: float = 0.0  # what predict_prompt answers (of it, the prompt's own computation)
    hold: Optional[threading.Event] = None  # a step waits for it (a test decides when work moves on)
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    reply: str = REPLY  # what greedy sampling writes before EOS
    waiting: list[_Req] = field(default_factory=list)
    running: list[_Req] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    num_steps: int = 0
    # LoRA: the engine config's flags; adapters given by add_lora; the adapter of each request added
    # (its greedy reply is then "[name] " + reply, so a test sees which adapter answered)
    enable_lora: bool = False
    lora_modules: tuple = ()
    loras: dict = field(default_factory=dict)
    lora_requests: dict[str, Optional[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.config = EngineConfig(model=MODEL, max_model_len=self.max_model_len, block_size=self.block_size,
                                   max_num_seqs=self.max_num_seqs, enable_lora=self.enable_lora,
                                   lora_modules=self.lora_modules)
        self.model_config = ModelConfig(architecture="llama", vocab_size=257, hidden_size=8, intermediate_size=8,
                                        num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, name=MODEL)
        self.free_blocks = self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def prepare_request(self, request_id: str, prompt, params: SamplingParams, arrival_time=None,
                        add_special_tokens: bool = True) -> PreparedRequest:
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("prompt must not be empty")
            if prompt == "raise a bug":
                raise RuntimeError("a bug in the engine")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            if any(not 0 <= t < 257 for t in ids):
                raise InvalidRequestError("prompt token ids must be integers in [0, 257)")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise InvalidRequestError(f"This model's maximum context length is {self.max_model_len} tokens")
        if params.n * self.blocks_for(len(ids) + max_tokens) > self.num_blocks:
            raise InvalidRequestError("prompt plus max_tokens can never fit the KV cache")
        return PreparedRequest(request_id, text, ids, params, max_tokens, arrival_time or time.time())

    def add_lora(self, spec) -> None:
        self.loras[spec.name] = spec

    def remove_lora(self, name: str) -> None:
        self.loras.pop(name, None)

    def add_prepared(self, p: PreparedRequest) -> None:
        self.lora_requests[p.request_id] = getattr(p, "lora_name", None)
        children = []
        for i in range(p.params.n):
            rng = None
            if not p.params.greedy:
                rng = random.Random(f"{p.params.seed}-{i}") if p.params.seed is not None else random.Random()
            logprobs = [] if p.params.logprobs is not None else None
            children.append(_Child(i, rng, CompletionOutput(index=i, logprobs=logprobs)))
        self.waiting.append(_Req(p, children))

    def abort_request(self, request_id: str) -> None:
        for queue in (self.waiting, self.running):
            for r in list(queue):
                if r.prepared.request_id == request_id:
                    queue.remove(r)
                    self.free_blocks += r.blocks
                    self.aborted.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting_requests(self) -> int:
        return len(self.waiting)

    def load_snapshot(self) -> LoadSnapshot:
        return LoadSnapshot(num_waiting=len(self.waiting))

    def predict_wait(self, snapshot: LoadSnapshot, prompt_tokens: int, priority: int = 0) -> Optional[float]:
        return self.forecast_wait_s

    def predict_prompt(self, prompt_tokens: int) -> Optional[float]:
        return None if self.forecast_wait_s is None else self.own_prompt_s

    def cost_model_stats(self) -> dict:
        return {}

    def kv_cache_info(self) -> dict:
        return {"dtype": "float32", "tokens": 0}

    def close(self) -> None:
        pass

    def warm_up(self) -> None:
        pass

    @property
    def alive(self) -> bool:
        return True

    def restart(self) -> None:
        raise RuntimeError("a fake core does not restart")

    def in_flight(self) -> list[str]:
        return [r.prepared.request_id for r in self.waiting + self.running]

    def describe(self) -> dict:
        return {"engine_process": False, "pid": None}

    def get_scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              kv_cache_usage=1 - self.free_blocks / self.num_blocks,
                              num_blocks_total=self.num_blocks, num_blocks_free=self.free_blocks)

    def _next_token(self, req: _Req, child: _Child) -> int:
        produced = len(child.out.token_ids)
        if child.rng is None:
            lora = getattr(req.prepared, "lora_name", None)
            reply = (self.reply if lora is None else f"[{lora}] {self.reply}").encode()
            if produced < len(reply):
                return reply[produced]
            return ord(" ") if req.prepared.params.ignore_eos else EOS
        return ord(child.rng.choice(ALPHABET))

    def step_with_stats(self) -> tuple[list[RequestOutput], IterationStats]:
        self.num_steps += 1
        if self.fail_after_steps is not None and self.num_steps >= self.fail_after_steps:
            raise RuntimeError("simulated engine crash")
        time.sleep(self.step_s)
        if self.hold is not None:
            self.hold.wait(timeout=60)
        while self.waiting and len(self.running) < self.max_num_seqs:
            p = self.waiting[0].prepared
            need = p.params.n * self.blocks_for(len(p.prompt_token_ids) + p.max_tokens)
            if need > self.free_blocks:
                break
            req = self.waiting.pop(0)
            req.blocks, self.free_blocks = need, self.free_blocks - need
            self.running.append(req)
        stats = IterationStats(timestamp=time.time())
        outputs = []
        for req in list(self.running):
            for child in req.children:
                if not child.out.finished:
                    self._advance(req, child)
                    stats.num_generation_tokens += 1
            outputs.append(self._output(req))
            if req.finished:
                self.running.remove(req)
                self.free_blocks += req.blocks
        return outputs, stats

    def _advance(self, req: _Req, child: _Child) -> None:
        params, out = req.prepared.params, child.out
        token = self._next_token(req, child)
        out.token_ids.append(token)
        if out.logprobs is not None:
            top = [(token, self.tokenizer.token_text(token), -1.0)]
            top += [(t, self.tokenizer.token_text(t), -2.0 - k) for k, t in enumerate(range(97, 97 + 20))
                    if t != token]
            out.logprobs.append(TokenLogprob(token, self.tokenizer.token_text(token), -1.0,
                                             top[:params.logprobs]))
        if token == EOS and not params.ignore_eos:
            out.finish_reason, out.stop_reason = "stop", EOS
            return
        if token in params.stop_token_ids:
            out.finish_reason, out.stop_reason = "stop", token
            return
        out.text += self.tokenizer.decode([token])
        for s in params.stop:
            pos = out.text.find(s)
            if pos >= 0:
                out.text = out.text[:pos]
                out.finish_reason, out.stop_reason = "stop", s
                return
        if len(out.token_ids) >= req.prepared.max_tokens:
            out.finish_reason = "length"

    def _output(self, req: _Req) -> RequestOutput:
        outs = []
        for c in req.children:
            out = c.out
            out.delta_text, c.emitted_text = out.text[c.emitted_text:], len(out.text)
            out.delta_token_ids, c.emitted_tokens = out.token_ids[c.emitted_tokens:], len(out.token_ids)
            if out.logprobs is not None:
                out.delta_logprobs, c.emitted_logprobs = out.logprobs[c.emitted_logprobs:], len(out.logprobs)
            outs.append(CompletionOutput(index=out.index, text=out.text, token_ids=list(out.token_ids),
                                         delta_text=out.delta_text, delta_token_ids=out.delta_token_ids,
                                         logprobs=None if out.logprobs is None else list(out.logprobs),
                                         delta_logprobs=out.delta_logprobs, finish_reason=out.finish_reason,
                                         stop_reason=out.stop_reason))
        p = req.prepared
        return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, outs, finished=req.finished)


class CountingMetrics:
    def __init__(self) -> None:
        self.rejections = 0

    def record_rejection(self) -> None:
        self.rejections += 1

    def render(self) -> tuple[bytes, str]:
        return f"tessera:admission_rejections_total {self.rejections}\n".encode(), "text/plain; version=0.0.4"


# ----------------------------------------------------------------------------- a live server


@dataclass
class Server:
    url: str
    core: FakeCore
    engine: AsyncLLMEngine
    metrics: CountingMetrics

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/v1/engine/stats").json()

    def wait_idle(self, timeout: float = 5.0) -> dict:
        """Stats once nothing runs, waits or holds KV blocks, and no HTTP request is in flight."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            s = stats["scheduler"]
            if (s["num_running"], s["num_waiting"], s["num_blocks_free"], stats["server"]["active_requests"]) == \
                    (0, 0, s["num_blocks_total"], 0):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle: {stats}")
            time.sleep(0.02)


@contextmanager
def serve_in_thread(app, server: Optional[uvicorn.Server] = None) -> Iterator[str]:
    """Run `app` under uvicorn on a free port in a daemon thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = server or uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive()
        sock.close()


@contextmanager
def live_server(core: Optional[FakeCore] = None, *, max_num_queued_requests: Optional[int] = None,
                request_timeout: Optional[float] = None, max_queue_wait: Optional[float] = None) -> Iterator[Server]:
    core = core or FakeCore()
    engine = AsyncLLMEngine(core.config, engine=core, max_num_queued_requests=max_num_queued_requests,
                            max_queue_wait=max_queue_wait)
    metrics = CountingMetrics()
    app = create_app(engine, [MODEL, "alias"], request_timeout=request_timeout, metrics=metrics)
    try:
        with serve_in_thread(app) as url:
            yield Server(url, core, engine, metrics)
    finally:
        engine.shutdown()


def fake_engine(step_s: float = 0.005, max_num_seqs: int = 4, queue: Optional[int] = None,
                forecast: Optional[float] = None, hold: Optional[threading.Event] = None) -> AsyncLLMEngine:
    """An AsyncLLMEngine over a FakeCore, as a router's model."""
    core = FakeCore(step_s=step_s, max_num_seqs=max_num_seqs, forecast_wait_s=forecast, hold=hold)
    return AsyncLLMEngine(core.config, engine=core, max_num_queued_requests=queue)
