"""The HTTP server's models, health, stats and metrics endpoints against a scripted engine core,
HTTP served while the engine steps, the access log, and the official openai client."""
from __future__ import annotations

import json
import logging
import re
import time

import httpx
import openai
import pytest
from fakes import MODEL, REPLY
from http_checks import post, scripted_server

srv = pytest.fixture(scope="module", name="srv")(scripted_server)  # one server per module


def test_models_health_stats_metrics(srv):
    schema = httpx.get(f"{srv.url}/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]
    refs = set(re.findall(r"#/components/schemas/(\w+)", json.dumps(schema)))
    assert "CompletionRequest" in refs and refs <= set(schema["components"]["schemas"])
    models = httpx.get(f"{srv.url}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL, "alias"]
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 256
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok", "models": {MODEL: "ready"}}
    stats = srv.stats()
    assert set(stats["scheduler"]) >= {"num_running", "num_waiting", "kv_cache_usage", "num_blocks_free"}
    r = httpx.get(f"{srv.url}/metrics")
    assert r.status_code == 200 and "admission_rejections_total" in r.text


def test_http_is_served_while_the_engine_steps(srv):
    srv.core.step_s = 0.3
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as client:
            started = time.monotonic()
            with client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}):
                time.sleep(0.05)  # the engine thread is now inside a 0.3 s step
                t0 = time.monotonic()
                assert client.get("/health").status_code == 200
                assert time.monotonic() - t0 < 0.2
            assert time.monotonic() - started < 5
    finally:
        srv.core.step_s = 0.005
    srv.wait_idle()


def test_access_log_line_per_request(srv, caplog):
    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "tessera.server.access" and "/v1/engine/stats" not in r.getMessage()]  # earlier tests

    with caplog.at_level(logging.INFO, logger="tessera.server.access"):
        post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        httpx.get(f"{srv.url}/v1/models")
        post(srv, "/v1/completions", {"prompt": "x", "model": "nope"})
        deadline = time.monotonic() + 5  # a line is written once its response has been sent: just after
        while len(lines()) < 3 and time.monotonic() < deadline:  # the client has read it
            time.sleep(0.01)
    seen = lines()
    assert len(seen) == 3, seen
    assert '"POST /v1/completions" 200' in seen[0] and "id=cmpl-" in seen[0]
    assert "prompt_tokens=1 completion_tokens=2" in seen[0]
    assert '"GET /v1/models" 200' in seen[1] and '"POST /v1/completions" 404' in seen[2]


def test_openai_client_against_fake_engine(srv):
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0)
    assert c.choices[0].text == REPLY[:4] and c.usage.total_tokens == 6
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=1)
    assert chat.choices[0].message.content == REPLY[:4]
    assert chat.choices[0].logprobs.content[0].top_logprobs[0].token == "H"
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == REPLY[:4]
    assert chunks[-1].usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", temperature=-3)
