"""What the completion and chat handlers share: server state, running a request, SSE streaming.

A handler parses its request into engine prompts and SamplingParams, then
either `collect()`s the final outputs (non-streaming) or hands a renderer to
`stream()`. Both wait until every prompt has been admitted before answering,
so a full queue or a prompt that can never fit is an HTTP status, not an error
in the middle of a 200 stream.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Optional, Protocol, Union, runtime_checkable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tessera.engine.outputs import RequestOutput
from tessera.pooling_params import PoolingParams, cannot_embed, embeds_only
from tessera.sampling_params import SamplingParams
from tessera.server.media import MediaSettings
from tessera.server.auth import check_model, enter_queue
from tessera.server.errors import APIError, api_error_from, request_timeout, shutting_down
from tessera.server.generation import ClientDisconnected, DeadlineExceeded, Generation, ServerShuttingDown
from tessera.server.openai.response_models import PromptTokensDetails, UsageInfo
from tessera.server.model_router import NO_FALLBACK_HEADER, ModelRouter, Route
from tessera.server.served_model import ServedModel

if TYPE_CHECKING:
    from tessera.engine.frontend.protocols import ServingEngine
    from tessera.server.traffic import TrafficRecorder
    from tessera.slo import SLOSpec

# A stream whose first token has not come this many seconds after the request starts anyway, and
# sends keep-alives this often until it comes (Run.stream).
STREAM_START_S = 5.0
KEEPALIVE_S = 10.0
# nginx's "client closed request"; only ever seen in the access log, the client is gone.
CLIENT_CLOSED_REQUEST = 499
# JSON has no -inf; a token the model rules out gets this instead (as vLLM does).
MIN_LOGPROB = -9999.0


class ServerMetrics(Protocol):
    """What GET /metrics needs: the Prometheus text of every model served (tessera.metrics)."""

    def render(self) -> tuple[bytes, str]: ...


@runtime_checkable
class RejectionSink(Protocol):
    """Something counting a model's 429s (its PrometheusStatLogger, its LiveStats)."""

    def record_rejection(self) -> None: ...


@runtime_checkable
class HTTPRequestSink(Protocol):
    """Something counting HTTP requests by endpoint (tessera.metrics.MetricFamilies)."""

    def record_http_request(self, endpoint: str, method: str, status: int, seconds: float) -> None: ...


class LiveView(Protocol):
    """What the dashboard's endpoint needs from tessera.live_stats.LiveStats."""

    def record_rejection(self) -> None: ...

    def snapshot(self, seconds: Optional[int] = None, summary_s: int = 60) -> dict: ...


@dataclass
class ServerState:
    """Everything a handler needs, kept on app.state.tessera (one per app, never global)."""

    router: ModelRouter
    request_timeout: Optional[float] = None  # seconds; None or 0 = no deadline
    metrics: Optional[ServerMetrics] = None
    active_requests: int = 0
    started: float = field(default_factory=time.time)
    generations: set[Generation] = field(default_factory=set)  # running now, for shut_down()
    draining: bool = False  # shutting down: running requests finish, new ones get 503
    log_requests: bool = False  # prompts and outputs in the log (--log-requests)
    recorder: Optional[TrafficRecorder] = None  # --record-traffic
    slo: Optional[SLOSpec] = None  # checked against the live percentiles on /v1/engine/live
    media: MediaSettings = field(default_factory=MediaSettings)  # where images may come from, their limits

    @property
    def model_name(self) -> str:
        return self.router.default.name

    @property
    def engine(self) -> ServingEngine:
        """The first model's engine (the one engine of a single-model server)."""
        engine = self.router.default.engine
        if engine is None:
            raise APIError(503, f"Model {self.model_name!r} is not loaded.", type="server_error",
                           code="model_unavailable")
        return engine

    async def route(self, requested: Optional[str], request: Request, *, fallback: bool = True,
                    generates: bool = True) -> Route:
        """The loaded model that answers (fallback rules applied unless the request forbids it, or
        `fallback` is False: tokenizers and loads name one model). The request's API key must be
        allowed the model (checked before it loads); a request that `generates` gets a place in
        its key's fair share of the model's queue."""
        served, adapter = self.router.lookup(requested)
        check_model(request.scope, requested, adapter or served.name)  # an adapter is allowed by its own name
        forbid = request.headers.get(NO_FALLBACK_HEADER, "").strip().lower() in ("1", "true", "yes")
        route = await self.router.route(requested, allow_fallback=fallback and not forbid)
        if generates:
            enter_queue(request.scope, route.model.engine)
        return route

    def deadline(self) -> Optional[float]:
        return time.monotonic() + self.request_timeout if self.request_timeout else None

    def shut_down(self) -> None:
        """End every running request with a 503 (or a final error event) instead of cutting it off."""
        for generation in list(self.generations):
            generation.shut_down()

    def error(self, exc: BaseException, served: Optional[ServedModel] = None) -> APIError:
        err = api_error_from(exc)
        if err.status == 429:
            served = served or self.router.default
            for sink in (served.metrics, served.live):
                if sink is not None:
                    sink.record_rejection()
        return err


def check_task(engine: ServingEngine, name: str, embed: bool) -> None:
    """Refuse (400) a generation request to a model that only embeds and an embedding request to
    one that cannot, before anything is tokenized (a chat template's absence would say less)."""
    if embed and engine.config.pooler_for(engine.model_config) is None:
        raise cannot_embed(name)
    if not embed and not engine.model_config.is_causal:
        raise embeds_only(name)


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isinf(value) or math.isnan(value) else max(value, MIN_LOGPROB)


def usage_of(finals: dict[int, RequestOutput]) -> UsageInfo:
    """The request's usage: each prompt counted once (its `n` choices share it), and of those
    tokens the ones the prefix cache served when the engine first scheduled it (a preempted and
    recomputed prompt still reports that first hit, as vLLM's `num_cached_tokens` does)."""
    prompt = sum(len(out.prompt_token_ids) for out in finals.values())
    completion = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    cached = sum(out.num_cached_tokens for out in finals.values())
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def record_usage(request: Request, usage: UsageInfo) -> None:
    """For the access log line."""
    request.state.usage = usage


@dataclass
class Run:
    """One API request about to go to the engine."""

    state: ServerState
    request: Request
    route: Route
    prompts: list[Union[str, list[int]]]
    params: SamplingParams
    request_id: str
    # Re-tokenizes the prompts for another model's engine, so a request its model refuses at
    # admission (queue full, forecast wait) can go to the fallback; None: no second chance.
    reprompt: Optional[Callable[[ServingEngine], list[Union[str, list[int]]]]] = None
    # False for work that outlives its HTTP request (a background response): a disconnect then
    # aborts nothing; the deadline, a cancel and shutdown still do.
    watch_client: bool = True
    pooling: Optional[PoolingParams] = None  # embedding inputs rather than prompts to generate from
    headers: dict[str, str] = field(default_factory=dict)  # said in the response besides the route's
    images: list[ImageInput] = field(default_factory=list)  # the (one) prompt's images, in order

    @property
    def engine(self) -> ServingEngine:
        engine = self.route.model.engine
        if engine is None:  # unloaded between routing and now
            raise APIError(503, f"Model {self.route.model.name!r} was unloaded; retry.", type="server_error",
                           code="model_unavailable")
        if self.pooling is not None and self.route.adapter is not None:
            raise APIError(400, f"`{self.route.adapter}` is a LoRA adapter: embeddings do not take LoRA "
                                f"adapters; ask the base model `{self.route.model.name}`.", param="model")
        check_task(engine, self.route.model.name, embed=self.pooling is not None)
        return engine

    def generation(self, restartable: bool = False) -> Generation:
        self.request.state.request_id = self.request_id
        return Generation(self.engine, self.request if self.watch_client else None, self.prompts, self.params,
                          self.request_id, self.state.deadline(), self.state.generations, restartable=restartable,
                          log_requests=self.state.log_requests, pooling=self.pooling,
                          lora_name=self.route.adapter, images=self.images)

    def error(self, exc: BaseException) -> APIError:
        return self.state.error(exc, self.route.model)

    async def _fall_back(self, exc: BaseException) -> bool:
        """After `exc` refused the request at admission: move it to the model's fallback if its
        rule covers that refusal (queue_full, queue_wait); False if it does not."""
        from tessera.engine.errors import PredictedWaitError, QueueFullError

        if not isinstance(exc, QueueFullError) or self.reprompt is None:
            return False
        cause = "queue_wait" if isinstance(exc, PredictedWaitError) else "queue_full"
        route = await self.state.router.fall_back(self.route, cause)
        if route is None:
            return False
        self.route = route
        self.prompts = self.reprompt(self.engine)
        return True

    def json(self, body: dict) -> Response:
        """A whole response, saying which model answered."""
        return JSONResponse(body, headers=self._response_headers())

    def _response_headers(self) -> dict[str, str]:
        """The route's headers and this request's, with values made printable ASCII: some carry
        what the client sent (a hosted tool's type, a model name), and HTTP takes neither
        characters beyond latin-1 nor line breaks there (non-ASCII and control characters go as
        Python escapes)."""
        return {k: v if v.isascii() and v.isprintable() else v.encode("unicode_escape").decode("ascii")
                for k, v in {**self.route.headers(), **self.headers}.items()}

    def _note(self, outcome: str) -> None:
        """Why the request ended early, for the access log line."""
        self.request.state.outcome = outcome

    def _record(self, status: int, finals: Optional[dict[int, RequestOutput]] = None, *, stream: bool,
                error: Optional[str] = None) -> None:
        """Hand the ended request to --record-traffic's writer thread, when the server records."""
        if self.state.recorder is None:
            return
        from tessera.server.traffic import note_request

        note_request(self.state.recorder, arrival=getattr(self.request.state, "received_at", time.time()),
                     endpoint="chat" if self.request.url.path.endswith("/chat/completions") else "completions",
                     model=self.route.reported, engine=self.route.model.engine, prompts=self.prompts,
                     params=self.params, stream=stream, status=status, finals=finals, error=error)

    def _timeout_error(self) -> APIError:
        return request_timeout(self.state.request_timeout or 0.0)

    async def collect(self) -> Union[dict[int, RequestOutput], Response]:
        """Final output per prompt index, or the response to send instead (client gone)."""
        finals: dict[int, RequestOutput] = {}
        try:
            async with self.generation(restartable=True) as gen:
                async for index, output in gen.outputs():
                    if output.finished:
                        finals[index] = output
        except ClientDisconnected:
            self._note("client disconnected; aborted")
            self._record(CLIENT_CLOSED_REQUEST, finals, stream=False, error="client_disconnected")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except DeadlineExceeded:
            self._note("timed out; aborted")
            raise self._recorded(self._timeout_error(), finals, stream=False)
        except ServerShuttingDown:
            self._note("server shutting down; aborted")
            raise self._recorded(shutting_down(), finals, stream=False)
        except Exception as exc:
            if await self._fall_back(exc):
                return await self.collect()
            raise self._recorded(self.error(exc), finals, stream=False) from exc
        self._record(200, finals, stream=False)
        return finals

    def _recorded(self, err: APIError, finals: dict[int, RequestOutput], *, stream: bool) -> APIError:
        self._record(err.status, finals, stream=stream, error=str(err.code or err.type))
        return err

    async def stream(self, renderer: StreamRenderer, framing: Optional[StreamFraming] = None) -> Response:
        """A streamed response once every prompt is admitted, else the error response; `framing`
        is the API's (server-sent events by default).

        Admission refusals (a full queue, a prompt that can never fit) come at once, as an HTTP
        status. A prompt whose first token takes longer than STREAM_START_S (an agent's 10-30k
        tokens on a CPU take minutes) gets its stream started anyway, the API's opening events
        and then its keep-alives every KEEPALIVE_S: clients that hear nothing for a few minutes
        give up and send the request again (Claude Code does), which only queues it twice."""
        framing = framing or SSE
        gen = self.generation()
        await gen.__aenter__()
        outputs = gen.outputs()
        first: list[tuple[int, RequestOutput]] = []
        pending: Optional[asyncio.Future] = None
        try:
            admitted: set[int] = set()
            started = time.monotonic()
            while len(admitted) < len(self.prompts):
                pending = asyncio.ensure_future(outputs.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=max(0.0, STREAM_START_S - (time.monotonic() - started)))
                if not done:
                    break  # a long prefill: the stream starts, the output follows when it comes
                index, output = pending.result()
                pending = None
                admitted.add(index)
                first.append((index, output))
        except BaseException as exc:
            await gen.close()
            if isinstance(exc, ClientDisconnected):
                self._note("client disconnected before the first token; aborted")
                self._record(CLIENT_CLOSED_REQUEST, stream=True, error="client_disconnected")
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            if isinstance(exc, DeadlineExceeded):
                self._note("timed out before the first token; aborted")
                return framing.error_response(self._recorded(self._timeout_error(), {}, stream=True))
            if isinstance(exc, ServerShuttingDown):
                self._note("server shutting down; aborted")
                return framing.error_response(self._recorded(shutting_down(), {}, stream=True))
            if isinstance(exc, Exception):
                if await self._fall_back(exc):
                    renderer.model = self.route.reported
                    return await self.stream(renderer, framing)
                return framing.error_response(self._recorded(self.error(exc), {}, stream=True))
            raise
        return StreamingResponse(self._events(gen, outputs, first, pending, renderer, framing),
                                 media_type=framing.media_type,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          **self._response_headers()})

    async def _events(self, gen: Generation, outputs: AsyncIterator[tuple[int, RequestOutput]],
                      first: list[tuple[int, RequestOutput]], pending: Optional[asyncio.Future],
                      renderer: StreamRenderer, framing: StreamFraming) -> AsyncIterator[str]:
        """The stream's events: `first` (the outputs that came before it started), then the
        output awaited as `pending` (if it started before every prompt's first output), with
        keep-alives while it is awaited, then the rest."""
        finals: dict[int, RequestOutput] = {}
        status, error = 200, None  # for --record-traffic
        try:
            renderer.admitted([output for _, output in first])
            for event in renderer.start():
                yield event
            while True:
                for index, output in first:
                    if output.finished:
                        finals[index] = output
                    for event in renderer.render(index, output):
                        yield event
                first = []
                if pending is None:
                    break
                done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
                if not done:
                    for event in renderer.keepalive() if framing is SSE else []:
                        yield event
                    continue
                first, pending = [pending.result()], None
            async for index, output in outputs:
                if output.finished:
                    finals[index] = output
                for event in renderer.render(index, output):
                    yield event
            usage = usage_of(finals)
            record_usage(self.request, usage)
            for event in renderer.finish(usage):
                yield event
        except (ClientDisconnected, asyncio.CancelledError) as exc:  # our listener or Starlette's saw it first
            self._note("client disconnected mid-stream; aborted")
            status, error = CLIENT_CLOSED_REQUEST, "client_disconnected"
            if isinstance(exc, asyncio.CancelledError):
                raise
        except DeadlineExceeded:
            self._note("timed out mid-stream; aborted")
            err = self._timeout_error()
            status, error = err.status, "timeout"
            for event in renderer.error(err):
                yield event
        except ServerShuttingDown:
            self._note("server shutting down; aborted")
            status, error = 503, "server_shutting_down"
            for event in renderer.error(shutting_down()):
                yield event
        except Exception as exc:
            err = self.error(exc)
            status, error = err.status, str(err.code or err.type)
            for event in renderer.error(err):
                yield event
        finally:
            if pending is not None:
                pending.cancel()
            await gen.close()
            self._record(status, finals, stream=True, error=error)


@dataclass(frozen=True)
class StreamFraming:
    """How an API frames a stream: its media type, and its error as a whole response when the
    request fails before the stream's first byte (once under way, the renderer's `error` events
    end it)."""

    media_type: str
    error_response: Callable[[APIError], Response]


# OpenAI's (and Anthropic's): server-sent events.
SSE = StreamFraming("text/event-stream", APIError.response)


class StreamRenderer(Protocol):
    """Turns engine outputs into one endpoint's SSE events ("data: {...}\\n\\n" strings).

    `error`'s default is OpenAI's chat and completions streams' (one data line); the Responses
    and Messages streams fail with typed events of their own."""

    model: str  # the `model` of every chunk (changed if a fallback model takes the request over)

    def admitted(self, first: list[RequestOutput]) -> None:
        """Told, before `start`, the first output of each prompt that had one by then (none when
        a long prefill started the stream early): what the opening events may say of a prompt
        beyond its text, such as how much of it the prefix cache served."""

    def start(self) -> list[str]: ...

    def render(self, prompt_index: int, output: RequestOutput) -> list[str]: ...

    def finish(self, usage: UsageInfo) -> list[str]: ...

    def error(self, err: APIError) -> list[str]:
        """The events that end the stream when `err` stops it after its headers were sent."""
        return [err.sse_event()]

    def keepalive(self) -> list[str]:
        """What is sent while a long prompt's first token is awaited: an SSE comment, which
        parsers skip (Messages sends Anthropic's `ping` events, Responses `response.in_progress`)."""
        return [": keep-alive\n\n"]


DONE = "data: [DONE]\n\n"


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"
