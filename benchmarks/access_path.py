"""The CPU the access path costs, measured in-process (no model, no sockets), to read beside
access_overhead.sh's end-to-end numbers when the machine is too noisy for a 2 % difference:

- per request: AccessControl over a trivial ASGI app, with no keys and with ten keys (the client's
  with every limit set, so digests, scope lookup, buckets, headers and metrics all run);
- per generated token: KeyMeter.observe (the charge of each streamed output).

    PYTHONPATH=. python benchmarks/access_path.py
"""
from __future__ import annotations

import asyncio
import statistics
import time

from fastapi import FastAPI

from tessera.metrics import MetricFamilies
from tessera.server.api_keys import ADMIN, AccessSettings, ApiKey, digest_of
from tessera.server.auth import AccessControl
from tessera.server.ratelimit import FairShare, KeyLimiter, KeyMeter


async def _inner(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def _per_request(middleware: AccessControl, app: FastAPI, headers: list, n: int) -> float:
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message) -> None:
        pass

    start = time.perf_counter()
    for _ in range(n):
        await middleware({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
                          "app": app, "query_string": b"", "root_path": ""}, receive, send)
    return (time.perf_counter() - start) / n


def main() -> None:
    from tessera.server.app import create_app  # the real route table
    from tessera.server.model_router import ModelRouter
    from tessera.server.served_model import ModelSpec, ServedModel

    app = create_app(router=ModelRouter([ServedModel(ModelSpec("m", "m"))]))
    keys = tuple(ApiKey(f"other-{i}", digest_of(f"sk-other-{i}")) for i in range(9)) + (
        ApiKey("bench", digest_of("sk-bench"), frozenset({ADMIN}), rpm=10**6, tpm=10**9, max_concurrent=1000,
               models=frozenset({"m"})),)
    content = (b"content-type", b"application/json")
    for name, settings, headers in (("no keys", AccessSettings(), [content]),
                                    ("10 keys, limits", AccessSettings(keys), [(b"authorization", b"Bearer sk-bench"),
                                                                               content])):
        middleware = AccessControl(_inner, settings, families=MetricFamilies())
        runs = [asyncio.run(_per_request(middleware, app, headers, 3000)) for _ in range(5)]
        print(f"{name}: {statistics.median(runs) * 1e6:.1f} us per request (median of 5 x 3000)")

    meter = KeyMeter(KeyLimiter("bench", 10**6, 10**9, 1000), FairShare(10))

    class Completion:
        token_ids: list[int] = []

    class Output:
        prompt_token_ids = [0] * 100
        outputs = [Completion()]

    output, n = Output(), 100_000
    start = time.perf_counter()
    for _ in range(n):
        Completion.token_ids.append(0)
        meter.observe("r", output)
    print(f"KeyMeter.observe: {(time.perf_counter() - start) / n * 1e6:.2f} us per generated token")


if __name__ == "__main__":
    main()
