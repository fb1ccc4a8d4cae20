"""Hostile bodies through the real server get a 4xx in each API's own error shape (Responses:
OpenAI's, Messages: Anthropic's), as do errors outside the body; a client leaving mid-stream
aborts its request, and an error after the headers went out ends each stream in its own shape."""
from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest
from agent_server import (ANTHROPIC_TOOLS, NAME, RESPONSES_TOOLS, USER, anthropic_client, openai_client, serve_tiny,
                          wait_idle)

from tessera.server.anthropic.protocol import MessageResponse
from tessera.server.anthropic.serving import MessageBuilder, MessagesStream
from tessera.server.errors import APIError
from tessera.server.responses.response_models import ResponseObject
from tessera.server.responses.serving import ResponseBuilder, ResponsesStream, ResponseStore
from tessera.server.tools import OutputParsing, output_parser

# The server over the tiny model and its clients, one of each per module.
server = pytest.fixture(scope="module", name="server")(serve_tiny)
oai = pytest.fixture(scope="module", name="oai")(openai_client)
claude = pytest.fixture(scope="module", name="claude")(anthropic_client)


# ----------------------------------------------------------------------------- errors


def check_openai_error(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]


def check_anthropic_error(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] in ("invalid_request_error", "not_found_error", "request_too_large")
    assert body["error"]["message"]


HUGE = "lorem ipsum " * 200_000  # 2.4 MB of text: far past the 1024-token context
HOSTILE_RESPONSES = [
    {"input": 5}, {"input": None}, {"input": []}, {"input": [{"type": "computer_call", "id": "x"}]},
    {"input": [{"role": "wizard", "content": "hi"}]}, {"input": [{"type": "message", "role": "user"}]},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
    {"input": [{"type": "function_call_output", "call_id": "c", "output": 7}]},
    {"input": "hi", "max_output_tokens": "ten"}, {"input": "hi", "max_output_tokens": -1},
    {"input": "hi", "temperature": "hot"}, {"input": "hi", "temperature": 9.0}, {"input": "hi", "top_p": 2},
    {"input": "hi", "stream": "yes"},
    {"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]},
    {"input": "hi", "tools": RESPONSES_TOOLS * 2},
    {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
    {"input": "hi", "tool_choice": "required"}, {"input": "hi", "tool_choice": {"type": "function", "name": "nope"},
                                                 "tools": RESPONSES_TOOLS},
    {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
    {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
    {"input": "hi", "text": {"format": {"type": "yaml"}}},
    {"input": "hi", "text": {"format": {"type": "json_object"}}, "tools": RESPONSES_TOOLS},
    {"input": "hi", "previous_response_id": "resp_doesnotexist"}, {"input": "hi", "previous_response_id": 12},
    {"input": "hi", "background": True, "store": False}, {"input": "hi", "background": True, "stream": True},
    {"input": "hi", "model": "no-such-model"}, {"input": "hi", "metadata": {"k": 1}},
    {"input": HUGE}, {"input": [{"role": "user", "content": HUGE}]},
    {"input": "hi", "instructions": ["not", "a", "string"]},
    {"input": "hi", "reasoning": "high"}, {"input": "hi", "reasoning": {"effort": 3}},
    [1, 2], "just a string", None,
]
ANTHROPIC_BASE = {"model": NAME, "max_tokens": 5}
HOSTILE_MESSAGES = [
    {"messages": USER}, {"model": NAME, "max_tokens": 5}, {**ANTHROPIC_BASE, "messages": []},
    {**ANTHROPIC_BASE, "messages": "hi"}, {**ANTHROPIC_BASE, "max_tokens": "5", "messages": USER},
    {**ANTHROPIC_BASE, "max_tokens": 0, "messages": USER},
    {**ANTHROPIC_BASE, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
    {**ANTHROPIC_BASE, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                 "content": [{"type": "image", "source": {}}]}]}]},
    {**ANTHROPIC_BASE, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
    {**ANTHROPIC_BASE, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                 "input": {}}]}]},
    {**ANTHROPIC_BASE, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {**ANTHROPIC_BASE, "messages": USER, "temperature": 1.5}, {**ANTHROPIC_BASE, "messages": USER, "top_k": -3},
    {**ANTHROPIC_BASE, "messages": USER, "top_p": "x"}, {**ANTHROPIC_BASE, "messages": USER, "stop_sequences": "x"},
    {**ANTHROPIC_BASE, "messages": USER, "system": 7}, {**ANTHROPIC_BASE, "messages": USER, "stream": 1},
    {**ANTHROPIC_BASE, "messages": USER, "tools": [{"name": "f"}]},
    {**ANTHROPIC_BASE, "messages": USER, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool"}},
    {**ANTHROPIC_BASE, "messages": USER, "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "x"}},
    {**ANTHROPIC_BASE, "messages": USER, "tool_choice": {"type": "any"}},
    {**ANTHROPIC_BASE, "messages": USER, "tool_choice": {"type": "sometimes"}, "tools": ANTHROPIC_TOOLS},
    {**ANTHROPIC_BASE, "messages": USER, "model": "no-such-model"},
    {**ANTHROPIC_BASE, "messages": USER, "metadata": {"user_id": 5}},
    {**ANTHROPIC_BASE, "messages": USER, "thinking": {"type": "sometimes"}},
    {**ANTHROPIC_BASE, "messages": USER, "thinking": True},
    {**ANTHROPIC_BASE, "messages": [{"role": "user", "content": HUGE}]},
    [1, 2], "just a string", None,
]


GENERATION_FIELDS = {"max_tokens", "temperature", "top_k", "top_p", "stop_sequences", "stream", "metadata"}


@pytest.mark.parametrize("body", HOSTILE_RESPONSES, ids=lambda b: json.dumps(b)[:60])
def test_hostile_responses_bodies_get_a_4xx_in_openai_shape(server, body):
    check_openai_error(httpx.post(f"{server}/v1/responses", json=body, timeout=30))


@pytest.mark.parametrize("body", HOSTILE_MESSAGES, ids=lambda b: json.dumps(b)[:60])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_hostile_messages_bodies_get_a_4xx_in_anthropic_shape(server, body, path):
    if path.endswith("count_tokens") and isinstance(body, dict) and \
            {k: v for k, v in body.items() if k not in GENERATION_FIELDS} in ({"model": NAME, "messages": USER},
                                                                             {"messages": USER}):
        pytest.skip("count_tokens reads no sampling fields: this body is fine there")
    check_anthropic_error(httpx.post(f"{server}{path}", json=body, timeout=30,
                                     headers={"x-api-key": "k", "anthropic-version": "2023-06-01"}))


def test_errors_outside_the_body(server, claude):
    too_big = b'{"input": "' + b"x" * (17 * 2**20) + b'"}'
    r = httpx.post(f"{server}/v1/responses", content=too_big, timeout=60)
    assert r.status_code == 413
    check_openai_error(r)
    r = httpx.post(f"{server}/v1/messages", content=too_big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    for path, check in (("/v1/responses", check_openai_error), ("/v1/messages", check_anthropic_error)):
        check(httpx.post(f"{server}{path}", content=b"{not json", timeout=10))
    check_openai_error(httpx.get(f"{server}/v1/responses/resp_nope"))
    check_openai_error(httpx.post(f"{server}/v1/responses/resp_nope/cancel"))
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model=NAME, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    assert "text only" in exc.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=5, messages=USER)
    wait_idle(server)


def test_metrics_count_requests_per_endpoint(server, oai):
    oai.responses.create(model=NAME, input="hi", max_output_tokens=2)
    httpx.post(f"{server}/v1/messages", json={"model": NAME, "messages": USER}, timeout=10)
    text = httpx.get(f"{server}/metrics").text
    assert 'tessera:http_requests_total{endpoint="/v1/responses",method="POST",status="200"}' in text
    assert 'tessera:http_requests_total{endpoint="/v1/messages",method="POST",status="400"}' in text
    assert 'endpoint="/v1/responses/{response_id}"' in text  # the route, not every id


# ----------------------------------------------------------------------------- mid-stream failures


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": NAME, "input": "hi", "max_output_tokens": 600, "stream": True}),
    ("/v1/messages", {"model": NAME, "max_tokens": 600, "stream": True, "messages": USER}),
])
def test_a_client_leaving_mid_stream_aborts_its_request(server, path, body):
    body = {**body, "temperature": 1.0, "seed": 1}
    start = time.monotonic()
    whole = httpx.post(f"{server}{path}", json={**body, "stream": False}, timeout=60).json()
    whole_s = time.monotonic() - start
    assert whole["usage"]["output_tokens"] > 150  # this seed runs long, so the stream below is cut early
    with httpx.stream("POST", f"{server}{path}", json=body, timeout=30) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 12:
                break
    left = time.monotonic()
    wait_idle(server)  # aborted and its blocks freed, well before its tokens would have run out
    assert time.monotonic() - left < whole_s / 2



def test_streams_fail_in_their_own_shape():
    """An error after the headers went out: Responses ends with response.failed, Messages with an
    `error` event in Anthropic's shape."""
    err = APIError(504, "too slow", type="timeout_error", code="request_timeout")
    builder = ResponseBuilder(ResponseObject(id="resp_x", model="m"))
    stream = ResponsesStream(builder, output_parser(OutputParsing(), False), None, ResponseStore())
    events = stream.start() + stream.error(err)
    failed = json.loads(events[-1].split("data: ", 1)[1])
    assert events[-1].startswith("event: response.failed\n")
    assert failed["response"]["status"] == "failed" and failed["response"]["error"] == {
        "code": "request_timeout", "message": "too slow"}
    assert failed["sequence_number"] == 2
    m = MessagesStream(MessageBuilder(MessageResponse(id="msg_x", model="m")),
                       output_parser(OutputParsing(), False), [])
    (event,) = m.error(err)
    assert event == 'event: error\ndata: {"type": "error", "error": {"type": "timeout_error", "message": ' \
                    '"too slow"}}\n\n'
