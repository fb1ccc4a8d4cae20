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
from typing import TYPE_CHECKING, AsyncIterator, Optional, Protocol, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tessera.engine.outputs import RequestOutput
from tessera.sampling_params import SamplingParams
from tessera.server.errors import APIError, api_error_from, model_not_found, request_timeout, shutting_down
from tessera.server.generation import ClientDisconnected, DeadlineExceeded, Generation, ServerShuttingDown
from tessera.server.protocol import UsageInfo

if TYPE_CHECKING:
    from tessera.engine.async_engine import AsyncLLMEngine

# nginx's "client closed request"; only ever seen in the access log, the client is gone.
CLIENT_CLOSED_REQUEST = 499
# JSON has no -inf; a token the model rules out gets this instead (as vLLM does).
MIN_LOGPROB = -9999.0


class ServerMetrics(Protocol):
    """What the server needs from tessera.metrics.PrometheusStatLogger."""

    def record_rejection(self) -> None: ...

    def render(self) -> tuple[bytes, str]: ...


class LiveView(Protocol):
    """What the dashboard's endpoint needs from tessera.live_stats.LiveStats."""

    def record_rejection(self) -> None: ...

    def snapshot(self, seconds: Optional[int] = None, summary_s: int = 60) -> dict: ...


@dataclass
class ServerState:
    """Everything a handler needs, kept on app.state.tessera (one per app, never global)."""

    engine: AsyncLLMEngine
    model_names: list[str]
    request_timeout: Optional[float] = None  # seconds; None or 0 = no deadline
    metrics: Optional[ServerMetrics] = None
    live: Optional[LiveView] = None  # recent per-second stats for /dashboard
    active_requests: int = 0
    started: float = field(default_factory=time.time)
    generations: set[Generation] = field(default_factory=set)  # running now, for shut_down()
    draining: bool = False  # shutting down: running requests finish, new ones get 503

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, requested: Optional[str]) -> str:
        """The name to report back; 404 for a model this server does not serve."""
        if requested is None or requested == "":
            return self.model_name
        if requested not in self.model_names:
            raise model_not_found(requested)
        return requested

    def deadline(self) -> Optional[float]:
        return time.monotonic() + self.request_timeout if self.request_timeout else None

    def shut_down(self) -> None:
        """End every running request with a 503 (or a final error event) instead of cutting it off."""
        for generation in list(self.generations):
            generation.shut_down()

    def error(self, exc: BaseException) -> APIError:
        err = api_error_from(exc)
        if err.status == 429:
            for sink in (self.metrics, self.live):
                if sink is not None:
                    sink.record_rejection()
        return err


def clamp_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isinf(value) or math.isnan(value) else max(value, MIN_LOGPROB)


def usage_of(finals: dict[int, RequestOutput]) -> UsageInfo:
    prompt = sum(len(out.prompt_token_ids) for out in finals.values())
    completion = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def record_usage(request: Request, usage: UsageInfo) -> None:
    """For the access log line."""
    request.state.usage = usage


@dataclass
class Run:
    """One API request about to go to the engine."""

    state: ServerState
    request: Request
    prompts: list[Union[str, list[int]]]
    params: SamplingParams
    request_id: str

    def generation(self) -> Generation:
        self.request.state.request_id = self.request_id
        return Generation(self.state.engine, self.request, self.prompts, self.params, self.request_id,
                          self.state.deadline(), self.state.generations)

    def _note(self, outcome: str) -> None:
        """Why the request ended early, for the access log line."""
        self.request.state.outcome = outcome

    def _timeout_error(self) -> APIError:
        return request_timeout(self.state.request_timeout or 0.0)

    async def collect(self) -> Union[dict[int, RequestOutput], Response]:
        """Final output per prompt index, or the response to send instead (client gone)."""
        finals: dict[int, RequestOutput] = {}
        try:
            async with self.generation() as gen:
                async for index, output in gen.outputs():
                    if output.finished:
                        finals[index] = output
        except ClientDisconnected:
            self._note("client disconnected; aborted")
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except DeadlineExceeded:
            self._note("timed out; aborted")
            raise self._timeout_error()
        except ServerShuttingDown:
            self._note("server shutting down; aborted")
            raise shutting_down()
        except Exception as exc:
            raise self.state.error(exc) from exc
        return finals

    async def stream(self, renderer: StreamRenderer) -> Response:
        """A text/event-stream response once every prompt is admitted, else the error response."""
        gen = self.generation()
        await gen.__aenter__()
        outputs = gen.outputs()
        first: list[tuple[int, RequestOutput]] = []
        try:
            admitted: set[int] = set()
            while len(admitted) < len(self.prompts):
                index, output = await outputs.__anext__()
                admitted.add(index)
                first.append((index, output))
        except BaseException as exc:
            await gen.close()
            if isinstance(exc, ClientDisconnected):
                self._note("client disconnected before the first token; aborted")
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            if isinstance(exc, DeadlineExceeded):
                self._note("timed out before the first token; aborted")
                return self._timeout_error().response()
            if isinstance(exc, ServerShuttingDown):
                self._note("server shutting down; aborted")
                return shutting_down().response()
            if isinstance(exc, Exception):
                return self.state.error(exc).response()
            raise
        return StreamingResponse(self._events(gen, outputs, first, renderer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, gen: Generation, outputs: AsyncIterator[tuple[int, RequestOutput]],
                      first: list[tuple[int, RequestOutput]], renderer: StreamRenderer) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        try:
            for event in renderer.start():
                yield event
            for index, output in first:
                if output.finished:
                    finals[index] = output
                for event in renderer.render(index, output):
                    yield event
            async for index, output in outputs:
                if output.finished:
                    finals[index] = output
                for event in renderer.render(index, output):
                    yield event
            usage = usage_of(finals)
            record_usage(self.request, usage)
            for event in renderer.finish(usage):
                yield event
            yield "data: [DONE]\n\n"
        except (ClientDisconnected, asyncio.CancelledError) as exc:  # our listener or Starlette's saw it first
            self._note("client disconnected mid-stream; aborted")
            if isinstance(exc, asyncio.CancelledError):
                raise
        except DeadlineExceeded:
            self._note("timed out mid-stream; aborted")
            yield self._timeout_error().sse_event()
        except ServerShuttingDown:
            self._note("server shutting down; aborted")
            yield shutting_down().sse_event()
        except Exception as exc:
            yield self.state.error(exc).sse_event()
        finally:
            await gen.close()


class StreamRenderer(Protocol):
    """Turns engine outputs into one endpoint's SSE events ("data: {...}\\n\\n" strings)."""

    def start(self) -> list[str]: ...

    def render(self, prompt_index: int, output: RequestOutput) -> list[str]: ...

    def finish(self, usage: UsageInfo) -> list[str]: ...


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"
