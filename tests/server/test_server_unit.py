"""The HTTP server against a scripted engine core: every endpoint, format and error path, in seconds.

The real AsyncLLMEngine (its thread, queue bound and abort path) runs over a
small fake LLMEngine whose "model" writes a fixed reply byte by byte, so the
expected text of every request is known exactly. A real uvicorn server runs
in a background thread, so client disconnects are real socket closes.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from typing import Iterator, Optional

import httpx
import openai
import pytest
import uvicorn

from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.sampling_params import SamplingParams
from tessera.server.app import create_app
from tessera.server.launch import DrainingServer
from fakes import MODEL, REPLY, FakeCore, Server, live_server, serve_in_thread

@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    with live_server() as s:
        yield s


def post(srv: Server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=10, **kw)


def sse_events(response: httpx.Response) -> list:
    """Parse an SSE body strictly: only `data: ...` events separated by blank lines; [DONE] stays a str."""
    text = response.text
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def assert_error(r: httpx.Response, status: int, *needles: str, param: Optional[str] = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle.lower() in err["message"].lower(), err
    if param is not None:
        assert err["param"] == param, err
    return err


# ----------------------------------------------------------------------------- completions


def test_completion_text_usage_and_ids(srv):
    r = post(srv, "/v1/completions", {"model": MODEL, "prompt": "Say hi", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and abs(body["created"] - time.time()) < 60
    assert body["choices"] == [{"index": 0, "text": REPLY[:5], "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}


def test_completion_defaults_to_16_tokens_and_any_served_name(srv):
    body = post(srv, "/v1/completions", {"model": "alias", "prompt": "x", "temperature": 0}).json()
    assert body["choices"][0]["text"] == REPLY[:16] and body["model"] == "alias"
    body = post(srv, "/v1/completions", {"prompt": "x", "temperature": 0, "max_tokens": 100}).json()
    assert body["choices"][0]["text"] == REPLY and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(REPLY) + 1  # the EOS counts


def test_completion_prompt_forms_and_n(srv):
    ids = list(b"abc")
    for prompt, num_prompts, prompt_tokens in [("abc", 1, 3), (["ab", "abcd"], 2, 6), (ids, 1, 3),
                                               ([ids, ids[:1]], 2, 4)]:
        body = post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0, "n": 2}).json()
        assert [c["index"] for c in body["choices"]] == list(range(2 * num_prompts))
        assert all(c["text"] == REPLY[:3] for c in body["choices"])
        assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 6 * num_prompts,
                                 "total_tokens": prompt_tokens + 6 * num_prompts}


def test_completion_stop_ignore_eos_and_echo(srv):
    body = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 50, "temperature": 0,
                                         "stop": ["fake", "zzz"]}).json()
    assert body["choices"][0]["text"] == "Hello from the "
    assert (body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]) == ("stop", "fake")
    body = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 40, "temperature": 0,
                                         "ignore_eos": True}).json()
    assert body["choices"][0]["text"].startswith(REPLY + " ") and body["usage"]["completion_tokens"] == 40
    body = post(srv, "/v1/completions", {"prompt": "Q:", "max_tokens": 2, "temperature": 0, "echo": True}).json()
    assert body["choices"][0]["text"] == "Q:He"


def test_completion_seeded_sampling_is_deterministic(srv):
    req = {"prompt": "x", "max_tokens": 12, "temperature": 1.0, "seed": 7, "n": 3}
    a = [c["text"] for c in post(srv, "/v1/completions", req).json()["choices"]]
    b = [c["text"] for c in post(srv, "/v1/completions", req).json()["choices"]]
    assert a == b and len(set(a)) == 3  # the same per index, different across the n samples


def test_completion_logprobs_format(srv):
    body = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0, "logprobs": 2}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["H", "e", "l"] and lp["token_logprobs"] == [-1.0, -1.0, -1.0]
    assert lp["text_offset"] == [0, 1, 2]
    assert lp["top_logprobs"][0] == {"H": -1.0, "a": -2.0}
    body = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1, "temperature": 0, "logprobs": 0}).json()
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"H": -1.0}]  # the sampled token is always there


def test_completion_stream_sse_format(srv):
    r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0, "stream": True, "n": 2,
                                      "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" and "usage" in c for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {"prompt_tokens": 1, "completion_tokens": 8,
                                                                     "total_tokens": 9}
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == REPLY[:4]
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert all(c["usage"] is None for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_key(srv):
    r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0, "stream": True,
                                      "logprobs": 1})
    chunks = sse_events(r)[:-1]
    assert all("usage" not in c for c in chunks)
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == ["H", "e", "l"] and offsets == [0, 1, 2]


# ----------------------------------------------------------------------------- chat


def test_chat_completion(srv):
    r = post(srv, "/v1/chat/completions", {"model": MODEL, "temperature": 0, "max_completion_tokens": 5,
                                           "max_tokens": 1,
                                           "messages": [{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY[:5]}
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["logprobs"] is None
    prompt = len("<|system|>Be brief.\n<|user|>Hi\n<|assistant|>")
    assert body["usage"] == {"prompt_tokens": prompt, "completion_tokens": 5, "total_tokens": prompt + 5}


def test_chat_without_max_tokens_runs_to_eos(srv):
    body = post(srv, "/v1/chat/completions", {"temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
    assert body.json()["choices"][0]["message"]["content"] == REPLY


def test_chat_logprobs_format(srv):
    body = post(srv, "/v1/chat/completions", {"temperature": 0, "max_tokens": 2, "logprobs": True,
                                              "top_logprobs": 2, "messages": [{"role": "user", "content": "Hi"}]})
    content = body.json()["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "H", "logprob": -1.0, "bytes": [72],
                          "top_logprobs": [{"token": "H", "logprob": -1.0, "bytes": [72]},
                                           {"token": "a", "logprob": -2.0, "bytes": [97]}]}
    assert [c["token"] for c in content] == ["H", "e"]
    body = post(srv, "/v1/chat/completions", {"temperature": 0, "max_tokens": 1, "logprobs": True,
                                              "messages": [{"role": "user", "content": "Hi"}]})
    assert body.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_chat_stream_role_first_then_content_then_finish(srv):
    r = post(srv, "/v1/chat/completions", {"temperature": 0, "max_tokens": 3, "stream": True, "n": 2,
                                           "stream_options": {"include_usage": True},
                                           "messages": [{"role": "user", "content": "Hi"}]})
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert [c["delta"] for c in mine[1:-1]] == [{"content": ch} for ch in REPLY[:3]]
        assert all(c["finish_reason"] is None for c in mine[:-1])


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("content,needle", [(b"{not json", "not valid JSON"), (b"", "not valid JSON"),
                                            (b"[1, 2]", "JSON object"), (b'"text"', "JSON object")])
def test_malformed_body_is_400(srv, content, needle):
    r = httpx.post(f"{srv.url}/v1/completions", content=content, headers={"content-type": "application/json"})
    err = assert_error(r, 400, needle)
    assert err["type"] == "invalid_request_error"


def test_json_body_is_read_whatever_the_content_type(srv):
    r = httpx.post(f"{srv.url}/v1/completions", content=b'{"prompt": "x", "max_tokens": 2, "temperature": 0}',
                   headers={"content-type": "application/x-www-form-urlencoded"})  # what curl -d sends
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "He"


@pytest.mark.parametrize("body,param", [
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "stream": "maybe"}, "stream"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options"),
    ({}, "prompt"),
])
def test_wrong_types_are_400_with_param(srv, body, param):
    assert_error(post(srv, "/v1/completions", body), 400, param=param)


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n must be"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({"prompt": ["a", ""]}, "empty"),
    ({"prompt": [[]]}, "empty"),
    ({"prompt": [1, 99999]}, "token ids"),
    ({"prompt": "x", "max_tokens": 100000}, "context length"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
])
def test_out_of_range_values_are_400(srv, body, needle):
    err = assert_error(post(srv, "/v1/completions", body), 400, needle)
    assert err["type"] == "invalid_request_error"


def test_range_error_names_its_param(srv):
    assert_error(post(srv, "/v1/completions", {"prompt": "x", "top_p": 2}), 400, "top_p", param="top_p")


@pytest.mark.parametrize("body,needle", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "'text' field"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "content must be"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "chat template"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "logprobs"),
    ({"messages": [{"content": "hi"}]}, "role"),
])
def test_bad_chat_requests_are_400(srv, body, needle):
    assert_error(post(srv, "/v1/chat/completions", body), 400, needle)


def test_unknown_model_is_404(srv):
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
        err = assert_error(post(srv, path, {**body, "model": "gpt-9"}), 404, param="model")
        assert err["message"] == "The model `gpt-9` does not exist." and err["code"] == "model_not_found"


def test_unknown_fields_are_ignored(srv):
    r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 0, "best_of": 3,
                                      "logit_bias": {"1": 2}, "suffix": "?", "frobnicate": [1]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "He"


def test_unknown_route_and_method_are_openai_errors(srv):
    assert_error(httpx.get(f"{srv.url}/v1/nothing"), 404)
    assert_error(httpx.get(f"{srv.url}/v1/completions"), 405)


def test_unexpected_engine_error_is_500_and_server_stays_up(srv):
    err = assert_error(post(srv, "/v1/completions", {"prompt": "raise a bug"}), 500, "a bug in the engine")
    assert err["type"] == "server_error"
    r = post(srv, "/v1/completions", {"prompt": "raise a bug", "stream": True})
    assert_error(r, 500)
    assert post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
    assert httpx.get(f"{srv.url}/health").status_code == 200


# ----------------------------------------------------------------------------- models, health, stats, metrics


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


# ----------------------------------------------------------------------------- backpressure, deadlines, disconnects


def test_queue_full_is_429_then_recovers():
    core = FakeCore(step_s=0.02, max_num_seqs=1)
    with live_server(core, max_num_queued_requests=2) as s:
        async def flood() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as client:
                reqs = [client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": i % 2 == 0})
                        for i in range(12)]
                return await asyncio.gather(*reqs)

        responses = asyncio.run(flood())
        statuses = [r.status_code for r in responses]
        assert statuses.count(429) >= 5 and statuses.count(200) >= 2, statuses
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                err = assert_error(r, 429, "queue full")
                assert err["code"] == "queue_full"
        assert s.metrics.rejections == statuses.count(429)
        s.wait_idle()
        ok = [post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code for _ in range(3)]
        assert ok == [200, 200, 200]


def test_forecast_wait_past_the_deadline_is_429_at_once():
    core = FakeCore(step_s=0.02, forecast_wait_s=32.4)
    with live_server(core, request_timeout=10) as s:
        for stream in (False, True):
            t0 = time.monotonic()
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": stream},
                           timeout=30)
            assert time.monotonic() - t0 < 2  # refused now, not after the 10 s timeout
            err = assert_error(r, 429, "forecast wait")
            assert err["code"] == "queue_wait_exceeds_deadline"
            assert r.headers["retry-after"] == "23"  # 32.4 s forecast - 10 s deadline, rounded up
        assert s.metrics.rejections == 2
        assert not core.waiting and not core.running and core.free_blocks == core.num_blocks
        core.forecast_wait_s = 3.0  # under the deadline: served
        assert post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_max_queue_wait_refuses_what_would_wait_longer():
    core = FakeCore(step_s=0.02, forecast_wait_s=4.2)
    with live_server(core, max_queue_wait=1.5) as s:  # no request deadline: the server's own bound
        r = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 5})
        err = assert_error(r, 429, "max-queue-wait")
        assert err["code"] == "queue_wait_exceeds_deadline" and r.headers["retry-after"] == "3"
        core.forecast_wait_s = 1.0
        assert post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_request_timeout_non_stream_and_stream():
    core = FakeCore(step_s=0.05)
    with live_server(core, request_timeout=0.4) as s:
        started = time.monotonic()
        r = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 200, "ignore_eos": True})
        assert time.monotonic() - started < 2
        err = assert_error(r, 504, "timeout")
        assert (err["type"], err["code"]) == ("timeout_error", "request_timeout")
        s.wait_idle()

        r = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200,
                                             "ignore_eos": True, "stream": True})
        assert r.status_code == 200
        events = sse_events(r)
        assert events[-1] != "[DONE]" and events[-1]["error"]["code"] == "request_timeout"
        assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events[:-1])
        s.wait_idle()
        assert post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_twenty_streams_cut_midway_free_everything():
    core = FakeCore(step_s=0.01, max_num_seqs=8, num_blocks=400)

    async def cut(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"stream {i}", "max_tokens": 150, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            received = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    received += 1
                    if received == 3:
                        break  # leaving the block closes the connection mid-stream
        return received

    with live_server(core) as s:
        async def main() -> list[int]:
            async with httpx.AsyncClient(base_url=s.url, timeout=30) as client:
                results = await asyncio.gather(*(cut(client, i) for i in range(20)))
                # While the cut streams are aborted, a request on another connection is still served whole.
                r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "temperature": 0})
                assert r.json()["choices"][0]["text"] == REPLY[:3]
                return results

        started = time.monotonic()
        assert asyncio.run(main()) == [3] * 20
        stats = s.wait_idle(timeout=5)
        assert stats["scheduler"]["kv_cache_usage"] == 0
        assert len(core.aborted) == 20
        assert time.monotonic() - started < 10  # 20 x 150 tokens would take much longer unaborted


def test_non_streaming_client_disconnect_aborts():
    core = FakeCore(step_s=0.02)
    with live_server(core) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True},
                       timeout=0.3)
        s.wait_idle(timeout=2)  # 200 steps of 20 ms would take 4 s
        assert len(core.aborted) == 1


def test_dead_engine_gives_503():
    core = FakeCore(fail_after_steps=3)
    with live_server(core) as s:
        r = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 20, "temperature": 0, "stream": True})
        events = sse_events(r)  # two tokens, then the crash
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == REPLY[:2]
        assert events[-1]["error"]["code"] == "engine_dead"
        r = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 20})
        err = assert_error(r, 503)
        assert err["code"] == "engine_dead"
        health = httpx.get(f"{s.url}/health")
        assert_error(health, 503, "engine")
        assert_error(post(s, "/v1/completions", {"prompt": "x"}), 503)
        assert httpx.get(f"{s.url}/v1/models").status_code == 200  # the HTTP side is still up


class DyingCore(FakeCore):
    """A core that dies on its own (as a process core's process can) and is restarted in place."""

    def __init__(self) -> None:
        super().__init__()
        self.dead = False
        self.restarts = 0

    @property
    def alive(self) -> bool:
        return not self.dead

    def restart(self) -> None:
        self.dead, self.restarts = False, self.restarts + 1

    def describe(self) -> dict:
        return {"engine_process": True, "pid": 4242, "restarts": self.restarts}


def test_the_front_end_asks_the_core_protocol_not_its_kind():
    """A core of a kind AsyncLLMEngine has never heard of: it reports where it runs through
    `describe()`, and dying while idle (`alive` False) gets it `restart()`ed, then it serves."""
    core = DyingCore()
    engine = AsyncLLMEngine(core.config, engine=core)
    try:
        assert engine.core_info() == {"engine_process": True, "pid": 4242, "restarts": 0}
        core.dead = True
        deadline = time.monotonic() + 5
        while core.restarts == 0:
            assert time.monotonic() < deadline, "the idle core's death was not noticed"
            time.sleep(0.01)
        assert engine.core_info()["restarts"] == 1

        async def one() -> str:
            text = ""
            async for out in engine.generate("hi", SamplingParams(max_tokens=5, temperature=0), "after"):
                text = out.outputs[0].text
            return text

        assert asyncio.run(one()) == REPLY[:5]
        engine.check_health()
    finally:
        engine.shutdown()


def test_shutdown_drains_then_ends_running_requests_cleanly():
    """SIGTERM: new requests get 503 at once, a short request still finishes, and what runs past
    --shutdown-timeout ends with a final error event / 503 rather than a cut connection."""
    core = FakeCore(step_s=0.02)
    engine = AsyncLLMEngine(core.config, engine=core)
    app = create_app(engine, [MODEL])
    server = DrainingServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5),
                            app.state.tessera, shutdown_timeout=0.6)
    results: dict[str, object] = {}

    def stream(url: str) -> None:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True,
                                                      "stream": True}, timeout=10)
        results["stream"] = sse_events(r)

    def whole(url: str) -> None:
        results["whole"] = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 200,
                                                                     "ignore_eos": True}, timeout=10)

    def short(url: str) -> None:
        results["short"] = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 5,
                                                                     "ignore_eos": True}, timeout=10)

    try:
        with serve_in_thread(app, server) as url:
            clients = [threading.Thread(target=f, args=(url,)) for f in (stream, whole, short)]
            for t in clients:
                t.start()
            deadline = time.monotonic() + 10
            while len(core.running) + len(core.waiting) + ("short" in results) < 3:  # all admitted first
                assert time.monotonic() < deadline
                time.sleep(0.005)
            started = time.monotonic()
            server.drain()
            assert_error(httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10), 503, "shutting down")
            assert_error(httpx.get(f"{url}/health"), 503, "shutting down")
            for t in clients:
                t.join(10)
            assert time.monotonic() - started < 3
        assert results["short"].status_code == 200  # finished within the drain
        events = results["stream"]
        assert events[-1]["error"]["code"] == "server_shutting_down" and len(events) > 2
        assert_error(results["whole"], 503, "shutting down")
        deadline = time.monotonic() + 2
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)  # the engine thread takes the aborts at its next step
        assert len(core.aborted) == 2 and core.free_blocks == core.num_blocks
    finally:
        engine.shutdown()


def test_a_slow_first_token_starts_the_stream_with_keepalives(monkeypatch):
    """A prompt whose first token takes longer than STREAM_START_S: the stream starts (role chunk)
    and keep-alive comments come until the token does; refusals still come as a status."""
    from tessera.server import serving

    monkeypatch.setattr(serving, "STREAM_START_S", 0.2)
    monkeypatch.setattr(serving, "KEEPALIVE_S", 0.1)
    core = FakeCore(step_s=0.6)
    with live_server(core) as s:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True, "temperature": 0}
        r = post(s, "/v1/chat/completions", body)
        assert r.status_code == 200
        blocks = r.text.split("\n\n")
        assert blocks[0].startswith("data: ") and json.loads(blocks[0][6:])["choices"][0]["delta"]["role"]
        assert blocks[1] == ": keep-alive"  # before the first token's chunk
        content = [json.loads(b[6:]) for b in blocks if b.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in content if c["choices"]) == REPLY[:2]
        assert blocks[-2] == "data: [DONE]"
        assert_error(post(s, "/v1/completions", {"prompt": "x", "max_tokens": 10**6, "stream": True}), 400,
                     "context length")
        s.wait_idle()
