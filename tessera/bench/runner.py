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


async def _run_session(http: aiohttp.ClientSession, target: Target, session: Session,
                       results: list[RequestResult], bar: Optional[tqdm]) -> None:
    chat = session.chat or target.endpoint == "chat"
    model = session.model or target.model
    messages: list[dict[str, str]] = []
    if chat and session.system:
        messages.append({"role": "system", "content": session.system})
    for i, turn in enumerate(session.turns):
        if chat:
            messages.append({"role": "user", "content": turn.prompt})
            body = chat_body(model, list(messages), turn.max_tokens, target.temperature)
        else:
            body = completion_body(model, turn.prompt, turn.max_tokens, target.temperature)
        if turn.extra:
            body = {**body, "ignore_eos": False, **turn.extra}
        r = await stream_request(http, target.url(chat), body, chat=chat, headers=target.headers)
        r.session_id, r.turn = session.session_id, i
        results.append(r)
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
            return
        if chat:
            messages.append({"role": "assistant", "content": r.text})


def _client(target: Target, limit: int) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=target.request_timeout)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit), timeout=timeout)


def _bar(total: int, desc: str, show: bool) -> Optional[tqdm]:
    return tqdm(total=total, desc=desc, unit="req", leave=False, dynamic_ncols=True) if show else None


async def run_closed_loop(target: Target, sessions: Sequence[Session], concurrency: int,
                          progress: bool = True, desc: str = "") -> RunOutput:
    """`concurrency` workers, each sending its next session as soon as the last one finished."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
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


async def run_open_loop(target: Target, sessions: Sequence[Session], rate: float, seed: int,
                        max_concurrency: Optional[int] = None, progress: bool = True,
                        desc: str = "", drain_timeout: Optional[float] = None) -> RunOutput:
    """Sessions start at seeded Poisson arrival times, whether or not earlier ones finished.

    With `drain_timeout` (seconds), requests still unfinished that long after the last
    arrival are cancelled and counted as failed: an overloaded server cannot stretch a
    capacity probe without bound, and a slow arrival process (low rates spread the same
    number of requests over a longer span) never eats into the time its requests have.
    """
    arrivals = poisson_arrivals(len(sessions), rate, seed)
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
