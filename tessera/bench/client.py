"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Works against any server that speaks the OpenAI streaming protocol (Tessera,
vLLM, llama.cpp server): Server-Sent Events, one JSON object per `data:` line,
ending with `data: [DONE]`. Output tokens are taken from the final usage chunk
(`stream_options.include_usage`) when the server sends one, otherwise counted as
content chunks (one token per chunk, which is what these servers send).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import aiohttp
import httpx


@dataclass
class RequestResult:
    """Timings of one request, all in seconds; `start` is on the runner's monotonic clock."""

    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)  # gaps between successive content chunks
    output_tokens: int = 0
    prompt_tokens: int = 0
    usage_reported: bool = False
    text: str = ""
    max_tokens: int = 0
    session_id: int = 0
    turn: int = 0
    status: int = 0  # HTTP status of the response (0: no response)
    model: str = ""  # the model asked for
    served_model: str = ""  # who answered: x-tessera-model, else the chunks' `model` field
    fallback_cause: str = ""  # x-tessera-fallback-cause when a fallback model answered

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def completion_body(model: str, prompt: str, max_tokens: int, temperature: float) -> dict[str, Any]:
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True},
        # Controlled output lengths: every server here honours ignore_eos.
        "ignore_eos": True,
    }


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int,
              temperature: float) -> dict[str, Any]:
    return {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }


def _chunk_text(payload: dict[str, Any], chat: bool) -> str:
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        return delta.get("content") or ""
    return choice.get("text") or ""


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], *,
                         chat: bool, headers: Optional[dict[str, str]] = None) -> RequestResult:
    """Send one streaming request and time it; errors are recorded, never raised."""
    result = RequestResult(max_tokens=int(body.get("max_tokens") or 0), model=str(body.get("model") or ""))
    chunks = 0
    last = None
    text_parts: list[str] = []
    start = time.perf_counter()
    result.start = start
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            result.status = resp.status
            result.served_model = resp.headers.get("x-tessera-model", "")
            result.fallback_cause = resp.headers.get("x-tessera-fallback-cause", "")
            if resp.status != 200:
                detail = (await resp.text())[:300].strip().replace("\n", " ")
                result.error = f"HTTP {resp.status}: {detail}"
                result.e2e = time.perf_counter() - start
                return result
            buffer = b""
            async for raw in resp.content.iter_any():
                now = time.perf_counter()
                buffer += raw
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event: lines
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    payload = json.loads(data)
                    if "error" in payload and not payload.get("choices"):
                        err = payload["error"]
                        raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    if not result.served_model and isinstance(payload.get("model"), str):
                        result.served_model = payload["model"]
                    usage = payload.get("usage")
                    if usage:
                        result.usage_reported = "completion_tokens" in usage
                        result.output_tokens = int(usage.get("completion_tokens") or 0)
                        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    piece = _chunk_text(payload, chat)
                    if not piece:
                        continue
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                    chunks += 1
                    text_parts.append(piece)
        result.e2e = time.perf_counter() - start
        if not result.usage_reported:
            result.output_tokens = chunks
        if chunks == 0:
            result.error = "stream ended without any output"
            return result
        result.text = "".join(text_parts)
        result.ok = True
    except Exception as exc:  # noqa: BLE001 - a benchmark records failures and goes on
        result.e2e = time.perf_counter() - start
        result.error = f"{type(exc).__name__}: {exc}".strip() if str(exc) else type(exc).__name__
    return result


def wait_for_health(url: str, proc: subprocess.Popen, log: str, timeout: float = 600) -> None:
    """Block until a server the caller started answers GET /health with 200 (benchmark scripts);
    raises if it exits or takes longer than `timeout` seconds (`log` is named in the error)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}, see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not ready after {timeout:g} s, see {log}")
        time.sleep(1)


def scrape_metric(url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets) on a server's /metrics."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def launch_server(model: str, port: int, log: Path, *flags: str) -> subprocess.Popen:
    """Start `tessera serve MODEL --port PORT FLAGS` (output to `log`) and return once /health is 200."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tessera", "serve", model, "--port", str(port), *flags],
                                stdout=f, stderr=subprocess.STDOUT)
    wait_for_health(f"http://127.0.0.1:{port}", proc, str(log))
    return proc


def stop_server(proc: subprocess.Popen, timeout: float = 120) -> int:
    """SIGTERM (the server drains) and its exit code; killed if it outlives `timeout` (a negative
    code then), so a stuck server never keeps the port from the next run."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
