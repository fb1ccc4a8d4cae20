"""API keys, scopes, the route policy and per-key limits, on a live server over the scripted engine
core of fakes.py (a real uvicorn, real sockets, the real AsyncLLMEngine).

The route-table walk is the guard for later routes: every route of the app must have an entry in
ROUTE_SCOPES, and with keys configured each one but /health (and the browser pages' static shells)
answers 401 without a key and 403 with a key that lacks its scope.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import httpx
import pytest
from starlette.routing import Mount
from fakes import MODEL, FakeCore, serve_in_thread

from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.errors import ConfigError, TesseraError
from tessera.live_stats import LiveStats
from tessera.metrics import MetricFamilies
from tessera.server.app import create_app
from tessera.server.api_keys import (ADMIN, INFERENCE, METRICS, AccessSettings, ApiKey, describe_access, digest_of,
                                     keys_from_toml)
from tessera.server.auth import PUBLIC, UI, error_shape, is_loopback, route_scope
from tessera.server.ratelimit import FairShare, KeyLimiter, KeyMeter, TokenBucket, format_reset

ADMIN_KEY, INFERENCE_KEY, METRICS_KEY = "sk-admin-0123456789", "sk-inference-0123456789", "sk-metrics-0123456789"


def key(name: str, secret: str, *scopes: str, **limits) -> ApiKey:
    return ApiKey(name=name, sha256=digest_of(secret), scopes=frozenset(scopes or (INFERENCE,)), **limits)


STANDARD_KEYS = (key("ops", ADMIN_KEY, ADMIN), key("app", INFERENCE_KEY, INFERENCE),
                 key("prometheus", METRICS_KEY, METRICS))


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@dataclass
class Srv:
    url: str
    app: object
    core: FakeCore
    engine: AsyncLLMEngine
    families: MetricFamilies


@contextmanager
def keyed_server(keys=STANDARD_KEYS, *, core: Optional[FakeCore] = None, queue: Optional[int] = None,
                 beyond_loopback: bool = False, metrics_require_key: bool = False,
                 log_requests: bool = False, extra_route: bool = False) -> Iterator[Srv]:
    core = core or FakeCore()
    engine = AsyncLLMEngine(core.config, engine=core, max_num_queued_requests=queue)
    families = MetricFamilies()
    access = AccessSettings(keys=tuple(keys), metrics_require_key=metrics_require_key, log_requests=log_requests)
    app = create_app(engine, [MODEL, "alias"], metrics=families, access=access, beyond_loopback=beyond_loopback,
                     families=families, live=LiveStats(MODEL))
    if extra_route:
        @app.get("/v1/unlisted")
        async def unlisted() -> dict:
            return {"ok": True}
    try:
        with serve_in_thread(app) as url:
            yield Srv(url, app, core, engine, families)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def srv() -> Iterator[Srv]:
    with keyed_server(metrics_require_key=True) as s:
        yield s


# ----------------------------------------------------------------------------- the route table


def route_requests(app) -> list[tuple[str, str, str]]:
    """(method, concrete path, declared path) for every route of the app."""
    out = []
    for route in app.routes:
        path = re.sub(r"\{[^}]*\}", "x", route.path)
        if isinstance(route, Mount):
            out.append(("GET", path + "/tessera.css", route.path))
            continue
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method != "HEAD":
                out.append((method, path, route.path))
    return out


LACKING = {INFERENCE: METRICS_KEY, METRICS: INFERENCE_KEY, ADMIN: INFERENCE_KEY}
HOLDING = {INFERENCE: INFERENCE_KEY, METRICS: METRICS_KEY, ADMIN: ADMIN_KEY}


def policy_problems(app, url: str) -> list[str]:
    """Every way a route breaks the policy: no entry, open without a key, open to a key without
    its scope, or refused to a key with it."""
    problems = []
    with httpx.Client(base_url=url, timeout=10) as http:
        for method, path, declared in route_requests(app):
            needed = route_scope(declared)
            if needed is None:
                problems.append(f"{method} {declared}: no entry in ROUTE_SCOPES")
                continue
            anonymous = http.request(method, path)
            if needed in (PUBLIC, UI):
                if anonymous.status_code in (401, 403):
                    problems.append(f"{method} {declared} is {needed} but answered {anonymous.status_code}")
                continue
            if anonymous.status_code != 401 or anonymous.headers.get("www-authenticate") != "Bearer":
                problems.append(f"{method} {declared} without a key: {anonymous.status_code}")
            elif error_shape(path) == "openai" and anonymous.json()["error"]["code"] != "missing_api_key":
                problems.append(f"{method} {declared}: 401 body {anonymous.text}")
            lacking = http.request(method, path, headers=bearer(LACKING[needed]))
            if lacking.status_code != 403:
                problems.append(f"{method} {declared} with a key lacking {needed}: {lacking.status_code}")
            holding = http.request(method, path, headers=bearer(HOLDING[needed]))
            if holding.status_code in (401, 403):
                problems.append(f"{method} {declared} with a {needed} key: {holding.status_code} {holding.text}")
    return problems


@pytest.mark.slow
def test_every_route_has_a_policy_and_is_closed_without_a_key(srv):
    assert len(route_requests(srv.app)) >= 12
    assert policy_problems(srv.app, srv.url) == []


@pytest.mark.slow
def test_a_route_added_without_a_policy_fails_the_walk_and_is_closed():
    with keyed_server(extra_route=True, metrics_require_key=True) as s:
        problems = policy_problems(s.app, s.url)
        assert problems == ["GET /v1/unlisted: no entry in ROUTE_SCOPES"]
        # and meanwhile it is treated as an admin route, not left open
        assert httpx.get(f"{s.url}/v1/unlisted").status_code == 401
        assert httpx.get(f"{s.url}/v1/unlisted", headers=bearer(INFERENCE_KEY)).status_code == 403
        assert httpx.get(f"{s.url}/v1/unlisted", headers=bearer(ADMIN_KEY)).json() == {"ok": True}


def test_upcoming_routes_are_listed_with_their_api_error_shape():
    for path in ("/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{id}/cancel", "/v1/messages",
                 "/v1/messages/count_tokens", "/v1/embeddings", "/tokenize", "/detokenize", "/api/chat",
                 "/api/generate", "/api/embed", "/api/embeddings", "/api/tags", "/api/show", "/api/ps",
                 "/api/version"):
        assert route_scope(path) == INFERENCE, path
    assert route_scope("/api/pull") == route_scope("/api/delete") == route_scope("/v1/engine/replicas") == ADMIN
    assert error_shape("/v1/messages/count_tokens") == "anthropic" and error_shape("/api/chat") == "ollama"
    assert error_shape("/v1/messages-x") == error_shape("/v1/chat/completions") == "openai"


def test_each_api_gets_its_own_error_shape(srv):
    anthropic = httpx.post(f"{srv.url}/v1/messages", json={})
    assert anthropic.status_code == 401 and anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "authentication_error"
    ollama = httpx.post(f"{srv.url}/api/chat", json={}, headers={"x-api-key": "wrong"})
    assert ollama.status_code == 401 and set(ollama.json()) == {"error"} and isinstance(ollama.json()["error"], str)
    openai_shape = httpx.get(f"{srv.url}/v1/models", headers=bearer("sk-wrong")).json()["error"]
    assert openai_shape["code"] == "invalid_api_key" and openai_shape["type"] == "invalid_request_error"


def test_keys_are_accepted_as_bearer_or_x_api_key_and_unknown_paths_need_one(srv):
    assert httpx.get(f"{srv.url}/v1/models", headers={"x-api-key": INFERENCE_KEY}).status_code == 200
    assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"bearer {INFERENCE_KEY}"}).status_code == 200
    assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Basic {INFERENCE_KEY}"}).status_code == 401
    assert httpx.get(f"{srv.url}/v1/nothing-here").status_code == 401  # nothing learnt without a key
    assert httpx.get(f"{srv.url}/v1/nothing-here", headers=bearer(INFERENCE_KEY)).status_code == 404
    assert httpx.get(f"{srv.url}/health").status_code == 200
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
    done = httpx.post(f"{srv.url}/v1/completions", json=body, headers=bearer(INFERENCE_KEY))
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3


def test_admin_routes_are_off_beyond_loopback_without_an_admin_key():
    inference_only = (key("app", INFERENCE_KEY, INFERENCE),)
    assert any("admin endpoints" in line for line in describe_access(AccessSettings(inference_only), True))
    assert not any("admin endpoints" in line for line in describe_access(AccessSettings(STANDARD_KEYS), True))
    assert any("no API key" in line for line in describe_access(AccessSettings(), True))
    with keyed_server(inference_only, beyond_loopback=True) as s:
        for path in ("/v1/engine/stats", "/v1/engine/live"):
            assert httpx.get(f"{s.url}{path}", headers=bearer(INFERENCE_KEY)).status_code == 404
            assert httpx.get(f"{s.url}{path}").status_code == 404
        assert httpx.post(f"{s.url}/v1/engine/replicas", json={"replicas": 2}).status_code == 404
        assert httpx.get(f"{s.url}/v1/models", headers=bearer(INFERENCE_KEY)).status_code == 200
    with keyed_server((), beyond_loopback=True) as s:  # no keys at all: the API open, the admin routes off
        assert httpx.get(f"{s.url}/v1/models").status_code == 200
        assert httpx.get(f"{s.url}/v1/engine/stats").status_code == 404
    with keyed_server(()) as s:  # loopback without keys: as before, everything open
        assert httpx.get(f"{s.url}/v1/engine/stats").status_code == 200
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.2")


def test_a_key_uses_only_its_models(srv):
    limited = (key("coder", INFERENCE_KEY, INFERENCE, models=frozenset({"alias"})),
               key("other", ADMIN_KEY, INFERENCE, models=frozenset({"someone-else"})))
    with keyed_server(limited) as s:
        body = {"prompt": "hi", "max_tokens": 2}
        ok = httpx.post(f"{s.url}/v1/completions", json={**body, "model": "alias"}, headers=bearer(INFERENCE_KEY))
        assert ok.status_code == 200
        refused = httpx.post(f"{s.url}/v1/completions", json={**body, "model": MODEL}, headers=bearer(ADMIN_KEY))
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
        names = [m["id"] for m in httpx.get(f"{s.url}/v1/models", headers=bearer(INFERENCE_KEY)).json()["data"]]
        assert names == ["alias"]
        assert httpx.get(f"{s.url}/v1/models", headers=bearer(ADMIN_KEY)).json()["data"] == []


def test_request_ids_are_echoed_or_made(srv):
    given = httpx.get(f"{srv.url}/health", headers={"x-request-id": "trace-42:abc"})
    assert given.headers["x-request-id"] == "trace-42:abc"
    made = httpx.get(f"{srv.url}/v1/models").headers["x-request-id"]  # a 401 carries one too
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    insane = httpx.get(f"{srv.url}/health", headers={"x-request-id": "x" * 500}).headers["x-request-id"]
    assert insane != "x" * 500 and len(insane) == 32


def test_keys_and_prompts_stay_out_of_logs_and_metrics(srv, caplog):
    marker = "the-private-prompt-7f3a"
    with caplog.at_level(logging.DEBUG):
        httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": marker, "max_tokens": 2},
                   headers=bearer(INFERENCE_KEY))
        httpx.get(f"{srv.url}/v1/models", headers=bearer("sk-a-wrong-key-55"))
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "key=app" in logged  # the access line names the key
    for secret in (marker, INFERENCE_KEY, "sk-a-wrong-key-55", ADMIN_KEY):
        assert secret not in logged
    text = httpx.get(f"{srv.url}/metrics", headers=bearer(METRICS_KEY)).text
    assert 'tessera:api_key_requests_total{key_name="app",status="200"}' in text
    assert 'tessera:auth_failures_total{reason="invalid"}' in text
    assert re.search(r'tessera:api_key_tokens_total\{key_name="app",kind="generation"\} [1-9]', text)
    for secret in (INFERENCE_KEY, ADMIN_KEY, METRICS_KEY, digest_of(INFERENCE_KEY), marker):
        assert secret not in text


def test_log_requests_writes_prompts_only_when_asked(caplog):
    with keyed_server((), log_requests=True) as s, caplog.at_level(logging.INFO, logger="tessera.server.requests"):
        httpx.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "visible-prompt", "max_tokens": 2})
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "visible-prompt" in logged and "output=" in logged


# ----------------------------------------------------------------------------- keys and their settings


def test_keys_file(tmp_path: Path):
    f = tmp_path / "keys.toml"
    f.write_text(f'''
[[key]]
name = "alice"
sha256 = "{digest_of('sk-alice').upper()}"
scopes = ["inference"]
rpm = 60
tpm = 20000
max_concurrent = 4
models = ["coder"]

[[key]]
name = "ops"
sha256 = "{digest_of('sk-ops')}"
scopes = ["admin"]
''')
    alice, ops = keys_from_toml(f)
    assert (alice.rpm, alice.tpm, alice.max_concurrent, alice.models) == (60, 20000, 4, frozenset({"coder"}))
    assert alice.sha256 == digest_of("sk-alice") and alice.has(INFERENCE) and not alice.has(ADMIN)
    assert ops.has(INFERENCE) and ops.has(METRICS) and ops.models is None
    for bad, message in (('name = "x"\nsha256 = "abc"', "64 lowercase hex"),
                         (f'name = "x"\nsha256 = "{digest_of("a")}"\nscopes = ["root"]', "scopes"),
                         (f'name = "x"\nsha256 = "{digest_of("a")}"\nrpm = 0', "positive"),
                         (f'name = "x"\nsha256 = "{digest_of("a")}"\nkey = "plain"', "unknown keys"),
                         (f'name = "has space"\nsha256 = "{digest_of("a")}"', "letters")):
        f.write_text("[[key]]\n" + bad)
        with pytest.raises(TesseraError, match=message):
            keys_from_toml(f)
    with pytest.raises(ConfigError, match="used twice"):
        AccessSettings(keys=(key("a", "sk-1"), key("a", "sk-2")))
    with pytest.raises(ConfigError, match="same key"):
        AccessSettings(keys=(key("a", "sk-1"), key("b", "sk-1")))


def test_keys_from_the_command_line(tmp_path, monkeypatch):
    from tessera.cli import build_parser
    from tessera.server.config import ServingSpec

    f = tmp_path / "keys.toml"
    f.write_text(f'[[key]]\nname = "alice"\nsha256 = "{digest_of("sk-alice")}"\n')
    monkeypatch.setenv("TESSERA_API_KEY", "sk-from-env")
    args = build_parser().parse_args(["serve", "smollm2-135m", "--api-key", "sk-one", "--api-key", "sk-two",
                                      "--api-keys-file", str(f), "--metrics-require-key", "--allowed-origins",
                                      "https://a.example,https://b.example", "--timeout-header", "3"])
    spec = ServingSpec.from_args(args)
    assert [k.name for k in spec.access.keys] == ["api-key-1", "api-key-2", "env", "alice"]
    assert spec.access.keys[0].sha256 == digest_of("sk-one") and spec.access.keys[0].has(ADMIN)
    assert spec.access.metrics_require_key and spec.transport.timeout_header == 3.0
    assert spec.transport.allowed_origins == ("https://a.example", "https://b.example")
    assert "sk-one" not in repr(spec)  # only digests are kept


# ----------------------------------------------------------------------------- limits, unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_holds_a_rate_with_one_second_of_burst():
    clock = Clock()
    limiter = KeyLimiter("k", rpm=120, tpm=None, max_concurrent=None, clock=clock)
    admitted = 0
    for _ in range(1000):  # 10 s of attempts every 10 ms
        if limiter.admit() is None:
            admitted += 1
            limiter.release()
        clock.now += 0.01
    assert admitted == pytest.approx(2 + 2 * 10, abs=1)
    refusal = None
    while refusal is None:
        refusal = limiter.admit()
    assert refusal.limit == "rpm" and 0 < refusal.retry_after_s <= 0.5
    headers = dict(limiter.headers())
    assert headers[b"x-ratelimit-limit-requests"] == b"120" and headers[b"x-ratelimit-remaining-requests"] == b"0"
    assert format_reset(0.02) == "20ms" and format_reset(1.5) == "1.5s" and format_reset(360) == "6m0s"
    bucket = TokenBucket(60, 0.0)
    assert bucket.capacity == 1 and bucket.wait_for(1, 0.0) == 0


def test_tokens_are_charged_as_generated_against_a_reservation():
    clock = Clock()
    limiter = KeyLimiter("k", rpm=None, tpm=600, max_concurrent=2, clock=clock)  # 10 tokens/s, 10 of burst
    assert limiter.admit() is None
    meter = KeyMeter(limiter, FairShare(1, clock))  # reserves min(mean, burst) = 10 tokens
    assert limiter.tokens.level == 0
    assert limiter.admit().limit == "tpm"  # the bucket is spent until the reservation is returned or refilled

    class Out:
        def __init__(self, prompt, generated):
            self.prompt_token_ids = [0] * prompt
            self.outputs = [type("C", (), {"token_ids": [0] * generated})()]

    meter.observe("r", Out(4, 1))
    meter.observe("r", Out(4, 6))
    assert meter.charged == 10 and limiter.tokens.level == 0  # all of it from the reservation
    meter.observe("r", Out(4, 16))
    assert limiter.tokens.level == -10  # beyond it: a debt
    meter.settle(4, 16)
    assert limiter.tokens.level == -10 and limiter.tokens_per_request > 10
    assert limiter.admit().limit == "tpm"
    clock.now += 1.1  # 11 tokens later the debt is paid
    assert limiter.admit() is None


def test_fair_share_caps_one_key_only_while_the_queue_is_contended():
    clock = Clock()
    fair = FairShare(num_keys=2, clock=clock)
    engine = object()
    for i in range(6):  # alone, a key may take all but the last quarter (room for others' first requests)
        assert fair.enter("flood", engine, bound=8, num_queued=i) is None
    assert fair.enter("flood", engine, bound=8, num_queued=6).limit == "queue_share"
    assert fair.enter("calm", engine, bound=8, num_queued=6) is None  # a reserved place
    clock.now += 1
    assert fair.enter("flood", engine, bound=8, num_queued=7) is not None  # now its share is 8 // 2
    for _ in range(3):
        fair.leave("flood", engine)
    assert fair.queued("flood", engine) == 3
    assert fair.enter("flood", engine, bound=8, num_queued=4) is None
    assert fair.enter("flood", engine, bound=8, num_queued=5).limit == "queue_share"
    assert fair.enter("third", engine, bound=8, num_queued=5) is None  # three keys active: shares of 8 // 3
    for who in ("flood", "flood", "calm", "third"):
        fair.leave(who, engine)
    assert fair.queued("flood", engine) == 2
    # under half full (by the engine's count and by the places held here): no cap, even past the share
    assert fair.enter("flood", engine, bound=8, num_queued=2) is None
    assert fair.enter("flood", engine, bound=8, num_queued=2) is None
    assert fair.enter("flood", engine, bound=8, num_queued=2).limit == "queue_share"  # 4 places held: half full
    assert FairShare(num_keys=1, clock=clock).enter("solo", engine, bound=8, num_queued=7) is None


def test_fair_share_counts_a_burst_the_engine_has_not_seen_yet():
    """Requests take their place when routed, before the engine counts them: 24 arriving at once
    all see an empty engine queue, and the key is still held to all but the last quarter."""
    fair = FairShare(num_keys=2, clock=Clock())
    engine = object()
    admitted = sum(fair.enter("flood", engine, bound=8, num_queued=0) is None for _ in range(24))
    assert admitted == 6 and fair.queued("flood", engine) == 6
    assert fair.enter("calm", engine, bound=8, num_queued=0) is None


# ----------------------------------------------------------------------------- limits under load


async def _hammer(url: str, secret: str, seconds: float, workers: int, body: dict) -> dict:
    """Requests as fast as `workers` loops can send them for `seconds`: what got through."""
    stats = {"ok": 0, "tokens": 0, "429": 0, "codes": set(), "other": [], "latency": []}
    deadline = time.monotonic() + seconds

    async def worker(http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            start = time.monotonic()
            r = await http.post("/v1/completions", json=body, headers=bearer(secret))
            if r.status_code == 200 and time.monotonic() <= deadline:
                stats["ok"] += 1
                stats["tokens"] += r.json()["usage"]["total_tokens"]
                stats["latency"].append(time.monotonic() - start)
            elif r.status_code == 429:
                stats["429"] += 1
                assert int(r.headers["retry-after"]) >= 1
                stats["codes"].add(r.json()["error"]["code"])
                await asyncio.sleep(0.02)
            elif r.status_code != 200:
                stats["other"].append((r.status_code, r.text[:200]))

    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        await asyncio.gather(*(worker(http) for _ in range(workers)))
    return stats


@pytest.mark.slow
def test_two_keys_are_each_held_to_their_own_limits_under_one_load():
    """Keys with different RPM and TPM limits hammered at once: each gets its own limit (within
    10 % of rate x window + the one-second burst), and an unlimited key beside them is never
    refused."""
    keys = (key("rpm-small", "sk-r1", rpm=120), key("rpm-big", "sk-r2", rpm=480),
            key("tpm-small", "sk-t1", tpm=1200), key("tpm-big", "sk-t2", tpm=4800), key("free", "sk-free"))
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 8}  # 2 + 8 tokens a request
    window = 10.0
    with keyed_server(keys, core=FakeCore(max_num_seqs=32, num_blocks=256)) as s:
        async def load():
            return await asyncio.gather(*(_hammer(s.url, secret, window, workers, body) for secret, workers in (
                ("sk-r1", 3), ("sk-r2", 3), ("sk-t1", 3), ("sk-t2", 3), ("sk-free", 1))))

        r1, r2, t1, t2, free = asyncio.run(load())
        headers = httpx.post(f"{s.url}/v1/completions", json=body, headers=bearer("sk-free")).headers
        assert "x-ratelimit-limit-requests" not in headers  # an unlimited key gets none
    for stats in (r1, r2, t1, t2, free):
        assert stats["other"] == []
    assert r1["ok"] == pytest.approx(2 + 2 * window, rel=0.10), r1
    assert r2["ok"] == pytest.approx(8 + 8 * window, rel=0.10), r2
    assert t1["tokens"] == pytest.approx(20 + 20 * window, rel=0.10), t1
    assert t2["tokens"] == pytest.approx(80 + 80 * window, rel=0.10), t2
    assert min(r1["429"], r2["429"], t1["429"], t2["429"]) > 0
    assert r1["codes"] | r2["codes"] | t1["codes"] | t2["codes"] == {"rate_limit_exceeded"}
    assert free["429"] == 0 and free["ok"] > 20


def test_limit_headers_and_concurrency_cap():
    with keyed_server((key("k", "sk-k", rpm=600, tpm=60000, max_concurrent=1),),
                      core=FakeCore(step_s=0.05)) as s:
        body = {"model": MODEL, "prompt": "ab", "max_tokens": 8}
        ok = httpx.post(f"{s.url}/v1/completions", json=body, headers=bearer("sk-k"))
        assert ok.headers["x-ratelimit-limit-requests"] == "600" and ok.headers["x-ratelimit-limit-tokens"] == "60000"
        assert int(ok.headers["x-ratelimit-remaining-requests"]) >= 0 and ok.headers["x-ratelimit-reset-tokens"]

        async def two():
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=body, headers=bearer("sk-k"))
                                              for _ in range(2)))

        codes = sorted(r.status_code for r in asyncio.run(two()))
        assert codes == [200, 429]
        metrics = httpx.get(f"{s.url}/metrics").text
        assert 'tessera:api_key_rate_limited_total{key_name="k",limit="concurrency"} 1.0' in metrics


@pytest.mark.slow
def test_one_key_cannot_take_the_whole_queue():
    """A key flooding a contended model with 24 concurrent requests and a key sending 2 at a time:
    the flooding key is held to its share of the queue (429 queue_share_exceeded), the other one's
    requests are all admitted (without the share, the flood fills the queue and they get 429s)."""
    keys = (key("flood", "sk-flood"), key("calm", "sk-calm"))
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 4}
    with keyed_server(keys, core=FakeCore(step_s=0.03, max_num_seqs=2), queue=8) as s:
        async def load():
            return await asyncio.gather(_hammer(s.url, "sk-flood", 6.0, 24, body),
                                        _hammer(s.url, "sk-calm", 6.0, 2, body))

        flood, calm = asyncio.run(load())
        metrics = httpx.get(f"{s.url}/metrics").text
    assert flood["other"] == [] and calm["other"] == []
    assert "queue_share_exceeded" in flood["codes"] and 'limit="queue_share"' in metrics
    assert calm["429"] == 0 and calm["ok"] >= 5, (calm["codes"], calm["429"], flood["429"], flood["codes"])
