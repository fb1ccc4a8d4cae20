"""One HTTP request's engine work, guarded by its deadline and its client's connection.

A request may hold several engine requests (one per prompt of a batch). Each
runs in its own task that drains `engine.generate` into one queue; a listener
puts a marker there when the client disconnects, and a timer when the deadline
passes. The handler then waits on that single queue, so leaving early for any
reason is one code path: cancel the tasks, which closes the engine iterators,
which aborts the engine requests and frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Optional, Union

import anyio
from starlette.requests import Request

from tessera.engine.outputs import RequestOutput
from tessera.pooling_params import PoolingParams
from tessera.sampling_params import SamplingParams
from tessera.server.auth import request_key
from tessera.vision import ImageInput

request_logger = logging.getLogger("tessera.server.requests")

if TYPE_CHECKING:
    from tessera.engine.frontend.protocols import ServingEngine


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was complete."""


class DeadlineExceeded(Exception):
    """The request ran past the server's --request-timeout."""


class ServerShuttingDown(Exception):
    """The server is stopping and ended the request rather than cut its connection."""


_DISCONNECTED = object()
_TIMED_OUT = object()
_ENDED = object()
_SHUTDOWN = object()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has already been read, so the only message left to receive is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Generation:
    """Runs `prompts` through the engine; iterate `outputs()` for (prompt index, RequestOutput).

    Use as `async with Generation(...) as gen:`; leaving the block, however it is
    left, aborts whatever is still running.
    """

    def __init__(self, engine: ServingEngine, request: Optional[Request], prompts: list[Union[str, list[int]]],
                 params: SamplingParams, request_id: str, deadline: Optional[float] = None,
                 live: Optional[set[Generation]] = None, restartable: bool = False,
                 log_requests: bool = False, pooling: Optional[PoolingParams] = None,
                 lora_name: Optional[str] = None, images: Optional[list[ImageInput]] = None) -> None:
        """`deadline` is a time.monotonic() value; `request` None means nobody watches the connection;
        `live` is the server's set of running generations, which this one joins while it runs;
        `restartable`: only final outputs are read (not streamed), so the engine may rerun a prompt
        from scratch on another replica if the one running it dies. `log_requests`: write the prompts,
        settings and outputs to the log (--log-requests; never otherwise); `pooling`: the prompts are
        embedding inputs (each one final output with its vector); `lora_name`: the LoRA adapter they
        run through (None: the base model); `images`: the (one) prompt's images, in order."""
        self.engine = engine
        self.request = request
        self.prompts = prompts
        self.params = params
        self.request_id = request_id
        self.deadline = deadline
        self.live = live if live is not None else set()
        self.restartable = restartable
        self.log_requests = log_requests
        grant = request_key(request.scope) if request is not None else None
        self.meter = grant[1] if grant is not None else None  # charges the key's tokens as they come
        self.pooling = pooling
        self.lora_name = lora_name
        self.images = images or []
        self._queue: asyncio.Queue = asyncio.Queue()
        self._drains: list[asyncio.Task] = []
        self._watcher: Optional[asyncio.Task] = None
        self._timer: Optional[asyncio.TimerHandle] = None
        self._granted = 0.0  # seconds added to the deadline for the prompts' own computation

    def engine_request_id(self, index: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{index}"

    async def __aenter__(self) -> Generation:
        self.live.add(self)
        if self.log_requests:
            for i, prompt in enumerate(self.prompts):
                request_logger.info("request %s: prompt=%r params=%s", self.engine_request_id(i), prompt, self.params)
        for i, prompt in enumerate(self.prompts):
            self._drains.append(asyncio.create_task(self._drain(i, prompt), name=self.engine_request_id(i)))
        if self.request is not None:
            self._watcher = asyncio.create_task(self._watch_client(self.request))
        self._arm()
        return self

    def _arm(self) -> None:
        """(Re)start the timer that ends the generation at its deadline, plus what was granted."""
        if self.deadline is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, self.deadline + self._granted - time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(delay, self._stop, _TIMED_OUT)

    def _extend(self, seconds: float) -> None:
        """The engine's forecast of a prompt's own computation: the deadline moves by the longest
        of the prompts' (they run side by side), so a long prompt is not cut for being long."""
        if seconds > self._granted:
            self._granted = seconds
            if self._timer is not None:
                self._arm()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Abort what is still running and wait until the engine has been told (idempotent)."""
        self.live.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        tasks = self._drains + ([self._watcher] if self._watcher is not None else [])
        for task in tasks:
            task.cancel()
        # Shielded: this also runs while our own task is being cancelled (client gone mid-stream).
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)

    def shut_down(self) -> None:
        """End this request now with ServerShuttingDown (the server is stopping)."""
        self._stop(_SHUTDOWN)

    def _stop(self, reason: object) -> None:
        """Abort the engine requests now, whether or not anyone still reads the queue.

        The reader may be gone already (a stream cancelled before its first byte), so the
        disconnect and the deadline do not wait for it to call close().
        """
        for task in self._drains:
            task.cancel()
        self._queue.put_nowait(reason)

    async def _drain(self, index: int, prompt: Union[str, list[int]]) -> None:
        try:
            deadline_s = None if self.deadline is None else self.deadline - time.monotonic()
            # lora_name, extend_deadline and images only when needed: engines (and test fakes) without
            # adapters, deadlines or a vision model take no such arguments
            extra: dict = {} if self.lora_name is None else {"lora_name": self.lora_name}
            if deadline_s is not None:
                extra["extend_deadline"] = self._extend
            if self.images:
                extra["images"] = self.images
            async with contextlib.aclosing(
                    self.engine.generate(prompt, self.params, self.engine_request_id(index),
                                         deadline_s=deadline_s, restartable=self.restartable,
                                         pooling=self.pooling, **extra)) as stream:
                async for output in stream:
                    if self.meter is not None:
                        self.meter.observe(self.engine_request_id(index), output)
                    if self.log_requests and output.finished:
                        request_logger.info("request %s: output=%r", self.engine_request_id(index),
                                            [c.text for c in output.outputs])
                    self._queue.put_nowait((index, output))
            self._queue.put_nowait((index, _ENDED))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported to the handler, which decides the status
            self._queue.put_nowait((index, exc))

    async def _watch_client(self, request: Request) -> None:
        await _wait_for_disconnect(request)
        self._stop(_DISCONNECTED)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs as they come, until every prompt has finished.

        Raises the engine's error for a prompt (InvalidRequestError, QueueFullError, ...),
        ClientDisconnected, DeadlineExceeded or ServerShuttingDown.
        """
        running = set(range(len(self.prompts)))
        while running:
            item = await self._queue.get()
            if item is _DISCONNECTED:
                raise ClientDisconnected()
            if item is _TIMED_OUT:
                raise DeadlineExceeded()
            if item is _SHUTDOWN:
                raise ServerShuttingDown()
            index, output = item
            if isinstance(output, BaseException):
                raise output
            if output is _ENDED:
                if index in running:
                    raise RuntimeError(f"the engine ended request {self.engine_request_id(index)} "
                                       "without a final output")
                continue
            if output.finished:
                running.discard(index)
            yield index, output
