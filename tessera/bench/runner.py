"""Drive a workload against a server: closed loop (fixed concurrency) or open loop (Poisson arrivals).

Closed loop answers "how fast with N users always waiting"; open loop answers "what
latency at R requests per second", which is how real traffic arrives and what a
capacity limit is stated in. In open loop the unit of arrival is a session: for
single-turn workloads that is a request, for multi-turn chat a conversation whose
turns then follow one another as soon as each reply is complete.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import aiohttp
from tqdm import tqdm

from tessera.bench.client import RequestResult, chat_body, completion_body, stream_request
from tessera.bench.datasets import Session


@dataclass(frozen=True)
class Target:
    """Where and how to send requests."""

    base_url: str
    model: str
    endpoint: str = "completions"  # "completions" or "chat" for single-turn workloads
    temperature: float = 0.0
    api_key: Optional[str] = None
    request_timeout: float = 600.0

    def url(self, chat: bool) -> str:
        base = self.base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        return base + ("/chat/completions" if chat else "/completions")

    @property
    def headers(self) -> Optional[dict[str, str]]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None


@dataclass
class RunOutput:
    results: list[RequestResult]
    duration: float  # first send → last completion, seconds
    started: float  # perf_counter() at the first send, to put request start times on the run's clock


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (seconds) of a seeded Poisson process; all zero for an infinite rate."""
    if rate <= 0:
        raise ValueError("request rate must be positive")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass
class _Conversation:
    """A session under way: the chat history so far and its next turn."""

    session: Session
    messages: list[dict[str, str]]
    turn: int = 0

    @staticmethod
    def start(session: Session, target: Target) -> "_Conversation":
        chat = session.chat or target.endpoint == "chat"
        messages = [{"role": "system", "content": session.system}] if chat and session.system else []
        return _Conversation(session, messages)

    @property
    def done(self) -> bool:
        return self.turn >= len(self.session.turns)


async def _run_turn(http: aiohttp.ClientSession, target: Target, conv: _Conversation,
                    results: list[RequestResult], bar: Optional[tqdm]) -> bool:
    """Send a conversation's next turn; False (and its remaining turns recorded as skipped) on failure."""
    session, i = conv.session, conv.turn
    turn = session.turns[i]
    chat = session.chat or target.endpoint == "chat"
    model = session.model or target.model
    if chat:
        conv.messages.append({"role": "user", "content": turn.prompt})
        body = chat_body(model, list(conv.messages), turn.max_tokens, target.temperature)
    else:
        body = completion_body(model, turn.prompt, turn.max_tokens, target.temperature)
    if turn.extra:
        body = {**body, "ignore_eos": False, **turn.extra}
    r = await stream_request(http, target.url(chat), body, chat=chat, headers=target.headers)
    r.session_id, r.turn = session.session_id, i
    results.append(r)
    conv.turn += 1
    if bar is not None:
        bar.update(1)
    if not r.ok:
        # The conversation cannot go on without the reply; count the rest as failed too.
        for j in range(i + 1, len(session.turns)):
            results.append(RequestResult(error="skipped: an earlier turn of its conversation failed",
                                         start=time.perf_counter(), max_tokens=session.turns[j].max_tokens,
                                         session_id=session.session_id, turn=j, model=model))
            if bar is not None:
                bar.update(1)
        conv.turn = len(session.turns)
        return False
    if chat:
        conv.messages.append({"role": "assistant", "content": r.text})
    return True


async def _run_session(http: aiohttp.ClientSession, target: Target, session: Session,
                       results: list[RequestResult], bar: Optional[tqdm]) -> None:
    conv = _Conversation.start(session, target)
    while not conv.done and await _run_turn(http, target, conv, results, bar):
        pass


def _client(target: Target, limit: int) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=target.request_timeout)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit), timeout=timeout)


def _bar(total: int, desc: str, show: bool) -> Optional[tqdm]:
    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True) if show else None


async def run_closed_loop(target: Target, sessions: Sequence[Session], concurrency: int,
                          progress: bool = True, desc: str = "",
                          max_active_conversations: Optional[int] = None) -> RunOutput:
    """`concurrency` workers, each sending its next session as soon as the last one finished.

    With `max_active_conversations` (multi-turn), up to that many conversations are under way at
    once and the workers take their turns round-robin (vLLM's multi-turn benchmark's option of
    the same name): a conversation's next turn waits behind the other active conversations' turns,
    as a user's does while they read and type, so its KV cache may be evicted in between."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if max_active_conversations is not None:
        return await _run_interleaved(target, sessions, concurrency, max_active_conversations, progress, desc)
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    results: list[RequestResult] = []
    bar = _bar(sum(s.num_requests for s in sessions), desc or f"concurrency {concurrency}", progress)

    async def worker(http: aiohttp.ClientSession) -> None:
        while True:
            try:
                s = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await _run_session(http, target, s, results, bar)

    async with _client(target, concurrency) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(min(concurrency, len(sessions)))))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return RunOutput(results, duration, start)


async def _run_interleaved(target: Target, sessions: Sequence[Session], concurrency: int, max_active: int,
                           progress: bool, desc: str) -> RunOutput:
    if max_active < 1:
        raise ValueError("max active conversations must be at least 1")
    waiting = deque(sessions)
    ready: deque[_Conversation] = deque()  # under way, next turn not in flight
    active = 0
    changed = asyncio.Event()
    results: list[RequestResult] = []
    bar = _bar(sum(s.num_requests for s in sessions), desc or f"concurrency {concurrency}", progress)

    def activate() -> None:
        nonlocal active
        while active < max_active and waiting:
            ready.append(_Conversation.start(waiting.popleft(), target))
            active += 1

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal active
        while True:
            while not ready:
                if active == 0 and not waiting:
                    return
                changed.clear()
                await changed.wait()
            conv = ready.popleft()
            if await _run_turn(http, target, conv, results, bar) and not conv.done:
                ready.append(conv)  # behind the other active conversations
            else:
                active -= 1
                activate()
            changed.set()

    activate()
    async with _client(target, concurrency) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return RunOutput(results, duration, start)


async def run_open_loop(target: Target, sessions: Sequence[Session], rate: float, seed: int,
                        max_concurrency: Optional[int] = None, progress: bool = True,
                        desc: str = "", drain_timeout: Optional[float] = None,
                        arrivals: Optional[Sequence[float]] = None) -> RunOutput:
    """Sessions start at seeded Poisson arrival times (or the given `arrivals`, offsets in seconds,
    one per session: a replayed trace), whether or not earlier ones finished.

    With `drain_timeout` (seconds), requests still unfinished that long after the last
    arrival are cancelled and counted as failed: an overloaded server cannot stretch a
    capacity probe without bound, and a slow arrival process (low rates spread the same
    number of requests over a longer span) never eats into the time its requests have.
    """
    if arrivals is None:
        arrivals = poisson_arrivals(len(sessions), rate, seed)
    elif len(arrivals) != len(sessions):
        raise ValueError("need one arrival time per session")
    time_limit = None if drain_timeout is None else (arrivals[-1] if arrivals else 0.0) + drain_timeout
    results: list[RequestResult] = []
    bar = _bar(sum(s.num_requests for s in sessions), desc or f"rate {rate:g}/s", progress)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def launch(http: aiohttp.ClientSession, s: Session, at: float, t0: float) -> None:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            await _run_session(http, target, s, results, bar)
        else:
            async with gate:
                await _run_session(http, target, s, results, bar)

    async with _client(target, max_concurrency or 0) as http:
        start = time.perf_counter()
        tasks = [asyncio.create_task(launch(http, s, at, start)) for s, at in zip(sessions, arrivals)]
        _, pending = await asyncio.wait(tasks, timeout=time_limit)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    done = {(r.session_id, r.turn) for r in results}
    for s in sessions:
        for i, turn in enumerate(s.turns):
            if (s.session_id, i) not in done:
                results.append(RequestResult(error=f"unfinished {drain_timeout:g} s after the last arrival "
                                                   f"(time limit {time_limit:.0f} s)",
                                             start=start + duration, max_tokens=turn.max_tokens,
                                             session_id=s.session_id, turn=i, model=s.model or target.model))
    return RunOutput(results, duration, start)
