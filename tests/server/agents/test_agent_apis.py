"""OpenAI's Responses API and Anthropic's Messages API through the real server (uvicorn over an
AsyncLLMEngine on a tiny random model), driven by the official `openai` and `anthropic` clients
and by raw HTTP for what a client would never send.

A random model writes garbage, which is what these tests want: the shapes, the event order, the
stream against the whole response for the same seed, the tool constraint (a forced call must
name a declared tool with arguments that validate), the conversation store, and that hostile
bodies get a 4xx in each API's own error shape.
"""
from __future__ import annotations

import json
import time
from typing import Iterator

import anthropic
import httpx
import jsonschema
import openai
import pytest
from fakes import serve_in_thread
from tiny_model import CHAT_TEMPLATE, make_tiny_model

from tessera.config import EngineConfig
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.metrics import MetricFamilies
from tessera.server.app import create_app
from tessera.server.errors import APIError
from tessera.server.anthropic.serving import MessageBuilder, MessagesStream
from tessera.server.anthropic.protocol import MessageResponse
from tessera.server.responses.protocol import ResponseObject
from tessera.server.openai.response_models import UsageInfo
from tessera.server.responses.serving import ResponseBuilder, ResponsesStream, ResponseStore, StoredResponse
from tessera.server.model_router import ModelRouter
from tessera.server.served_model import ModelSpec, ServedModel
from tessera.server.tools import OutputParsing, ParsedCall, ParserEvent, output_parser

NAME = "tiny"
LIGHT = {"type": "object", "properties": {"room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
         "required": ["room", "on"], "additionalProperties": False}
RESPONSES_TOOLS = [{"type": "function", "name": "set_light", "description": "Switch a light", "parameters": LIGHT}]
ANTHROPIC_TOOLS = [{"name": "set_light", "description": "Switch a light", "input_schema": LIGHT}]
STORE_SIZE = 8


def tiny_engine(folder, max_model_len: int = 1024) -> AsyncLLMEngine:
    from tessera.models.loader import load_model

    config = EngineConfig(model=str(folder), dtype="float32", max_model_len=max_model_len, max_num_seqs=8,
                          kv_cache_memory=max(4, max_model_len // 256) * 2**20)
    return AsyncLLMEngine(config, engine=LLMEngine(config, loaded=load_model(folder, "float32")))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    engine = tiny_engine(make_tiny_model(tmp_path_factory.mktemp("tiny-agents") / "llama", max_positions=1024))
    try:
        with serve_in_thread(create_app(engine, [NAME], metrics=MetricFamilies(),
                                        max_stored_responses=STORE_SIZE)) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=60)


def wait_idle(url: str) -> None:
    """Every request's KV blocks back in the pool (nothing leaked, nothing still running)."""
    deadline = time.monotonic() + 20
    while True:
        s = httpx.get(f"{url}/v1/engine/stats").json()["scheduler"]
        if s["num_running"] == s["num_waiting"] == 0 and s["kv_cache_usage"] == 0:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def without_ids(value):
    """A response with the parts that differ between two runs (ids, times) blanked."""
    if isinstance(value, dict):
        return {k: "*" if k in ("id", "call_id", "created_at", "item_id") else without_ids(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


# ----------------------------------------------------------------------------- Responses


def test_responses_create_whole(oai):
    r = oai.responses.create(model=NAME, input="hello there", instructions="Be brief.", max_output_tokens=12,
                             temperature=1.0, extra_body={"seed": 3})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == NAME
    assert r.status in ("completed", "incomplete")
    assert r.status != "incomplete" or r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.output_text == r.output[0].content[0].text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 12


def responses_events(oai, **kw) -> list:
    return list(oai.responses.create(stream=True, **kw))


@pytest.mark.parametrize("tools", [False, True])
def test_responses_stream_concatenates_to_the_whole_response(oai, tools):
    kw = dict(model=NAME, input="lights in the hall please", max_output_tokens=60, temperature=1.0,
              extra_body={"seed": 11})
    if tools:
        kw.update(tools=RESPONSES_TOOLS, tool_choice="required", max_output_tokens=200)
    whole = oai.responses.create(**kw)
    events = responses_events(oai, **kw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == f"response.{whole.status}"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    # Deltas put together as a client does give the whole response's items.
    text, args = {}, {}
    for e in events:
        if e.type == "response.output_text.delta":
            text[e.output_index] = text.get(e.output_index, "") + e.delta
        elif e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    for i, item in enumerate(whole.output):
        if item.type == "message":
            assert text[i] == item.content[0].text
        else:
            assert args.get(i, "") == item.arguments
    done = [e.item for e in events if e.type == "response.output_item.done"]
    final = events[-1].response
    assert without_ids(final.model_dump()["output"]) == without_ids(whole.model_dump()["output"])
    assert [d.model_dump() for d in done] == final.model_dump()["output"]
    assert final.usage == whole.usage
    if tools:  # a call first; text may follow it
        calls = [item for item in whole.output if item.type == "function_call"]
        assert whole.output[0].type == "function_call"
        for item in calls:
            assert item.name == "set_light" and item.call_id.startswith("call_")
            jsonschema.validate(json.loads(item.arguments), LIGHT)
        assert "response.function_call_arguments.done" in types


def test_responses_stream_helper_accumulates(oai):
    """The SDK's stream manager checks the lifecycle (created first, items added before their
    deltas, every item done before completed) and puts the response together."""
    schema = {"type": "object", "properties": {"c": {"enum": ["a", "b"]}}, "required": ["c"],
              "additionalProperties": False}
    kw = dict(model=NAME, input="hi", max_output_tokens=200, temperature=1.0, extra_body={"seed": 5},
              text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}})
    with oai.responses.stream(**kw) as stream:  # the grammar ends the output: a completed response
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text)["c"] in ("a", "b")
    assert final.output_text == oai.responses.create(**kw).output_text


def test_two_turns_with_previous_response_id(oai, server):
    first = oai.responses.create(model=NAME, input="my name is Ada", max_output_tokens=8, temperature=0)
    second = oai.responses.create(model=NAME, input="what is my name?", previous_response_id=first.id,
                                  max_output_tokens=8, temperature=0)
    alone = oai.responses.create(model=NAME, input="what is my name?", max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    # The second prompt holds the first turn (its input and its answer) before the new input.
    assert second.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens + \
        alone.usage.input_tokens - 8  # less the template's per-conversation head, counted once
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert oai.responses.retrieve(second.id).model_dump() == second.model_dump()
    # Instructions are not carried over: a third turn costs the same with or without them upstream.
    third = oai.responses.create(model=NAME, input="and?", previous_response_id=second.id, max_output_tokens=1,
                                 temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    wait_idle(server)


def test_function_call_round_trip(oai):
    call = oai.responses.create(model=NAME, input="switch the kitchen light on", tools=RESPONSES_TOOLS,
                                tool_choice={"type": "function", "name": "set_light"}, max_output_tokens=200,
                                temperature=0.7, extra_body={"seed": 2})
    calls = [item for item in call.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["set_light"]
    jsonschema.validate(json.loads(calls[0].arguments), LIGHT)
    result = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"ok": true}'}]
    # Stateful: the store holds the call; stateless: the client sends the call back itself.
    after = oai.responses.create(model=NAME, input=result, previous_response_id=call.id, tools=RESPONSES_TOOLS,
                                 max_output_tokens=10, temperature=0)
    resent = oai.responses.create(model=NAME, input=[{"role": "user", "content": "switch the kitchen light on"},
                                                     calls[0].model_dump(exclude_none=True), *result],
                                  tools=RESPONSES_TOOLS, max_output_tokens=10, temperature=0)
    assert after.status in ("completed", "incomplete") and resent.status in ("completed", "incomplete")
    assert after.usage.input_tokens == resent.usage.input_tokens  # the same prompt either way
    assert after.model_dump()["output"] and without_ids(after.model_dump()["output"]) == \
        without_ids(resent.model_dump()["output"])


def test_store_get_delete_cancel(oai, server):
    r = oai.responses.create(model=NAME, input="hi", max_output_tokens=4)
    assert oai.responses.retrieve(r.id).id == r.id
    with pytest.raises(openai.BadRequestError, match="background"):
        oai.responses.cancel(r.id)
    oai.responses.delete(r.id)
    for call in (lambda: oai.responses.retrieve(r.id), lambda: oai.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError) as exc:
            call()
        assert exc.value.body["code"] == "response_not_found"
    unstored = oai.responses.create(model=NAME, input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(model=NAME, input="hi", previous_response_id=unstored.id)
    assert exc.value.body["code"] == "previous_response_not_found"


def test_background_response_polls_and_cancels(oai, server):
    queued = oai.responses.create(model=NAME, input="hi", max_output_tokens=16, background=True, temperature=0)
    assert queued.status in ("queued", "in_progress") and queued.background
    deadline = time.monotonic() + 30
    while (done := oai.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens > 0
    assert done.output_text == oai.responses.create(model=NAME, input="hi", max_output_tokens=16,
                                                    temperature=0).output_text
    long = oai.responses.create(model=NAME, input="hi", max_output_tokens=900, background=True, temperature=1.0)
    cancelled = oai.responses.cancel(long.id)
    assert cancelled.status in ("cancelled", "completed", "incomplete")
    assert oai.responses.retrieve(long.id).status == cancelled.status  # over, whichever way it ended
    wait_idle(server)


def test_store_is_bounded():
    store = ResponseStore(max_responses=3, max_bytes=10**6)
    entries = [StoredResponse(ResponseObject(id=f"resp_{i}", model="m"), [{"role": "user", "content": "x"}])
               for i in range(5)]
    for e in entries[:3]:
        store.put(e)
    store.get("resp_0")  # a continued conversation is kept over an older one
    for e in entries[3:]:
        store.put(e)
    assert [rid for rid in ("resp_0", "resp_1", "resp_2", "resp_3", "resp_4") if store.get(rid)] == \
        ["resp_0", "resp_3", "resp_4"]
    small = ResponseStore(max_responses=100, max_bytes=2 * entries[0].size())
    for e in entries:
        small.put(e)
    assert len(small) == 2 and small.get("resp_4") is not None


# ----------------------------------------------------------------------------- Messages


def test_messages_create(claude):
    m = claude.messages.create(model=NAME, max_tokens=12, system="Be brief.",
                               messages=[{"role": "user", "content": "hello"}], metadata={"user_id": "u1"},
                               extra_body={"seed": 4, "temperature": 1.0, "top_k": 50, "top_p": 0.9})
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == NAME
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in m.content] in ([], ["text"])
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 12


@pytest.mark.parametrize("tools", [False, True])
def test_messages_stream_is_the_whole_message(claude, tools):
    kw = dict(model=NAME, max_tokens=60, messages=[{"role": "user", "content": "lights in the hall"}],
              extra_body={"seed": 8, "temperature": 1.0})
    if tools:
        kw.update(tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, max_tokens=300)
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert without_ids(final.model_dump()) == without_ids(whole.model_dump())
    raw = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                   "content_block_stop", "message_delta", "message_stop")]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert raw.count("content_block_start") == raw.count("content_block_stop") == len(whole.content)
    if tools:
        # A call first; text may follow it, and may run to max_tokens.
        assert whole.stop_reason in ("tool_use", "max_tokens") and whole.content[0].type == "tool_use"
        for block in whole.content:
            if block.type == "tool_use" and (block is not whole.content[-1] or whole.stop_reason == "tool_use"):
                assert block.name == "set_light" and block.id.startswith("toolu_")
                jsonschema.validate(block.input, LIGHT)


def test_messages_raw_stream_has_ping_and_typed_events(server):
    body = {"model": NAME, "max_tokens": 5, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", f"{server}/v1/messages", json=body,
                      headers={"x-api-key": "k", "anthropic-version": "2023-06-01"}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert [d["type"] for d in datas] == names  # every event's type on its event: line too
    assert not any("[DONE]" in line for line in lines)
    assert datas[0]["message"]["usage"]["output_tokens"] == 0 and datas[0]["message"]["content"] == []


def test_tool_use_round_trip(claude):
    first = claude.messages.create(model=NAME, max_tokens=200, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "tool", "name": "set_light"},
                                   messages=[{"role": "user", "content": "kitchen light on"}],
                                   extra_body={"seed": 3, "temperature": 0.7})
    assert first.stop_reason == "tool_use"
    use = first.content[-1]
    assert use.type == "tool_use" and use.name == "set_light"
    jsonschema.validate(use.input, LIGHT)
    conversation = [{"role": "user", "content": "kitchen light on"},
                    {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "done"},
                                                 {"type": "text", "text": "thanks"}]}]
    after = claude.messages.create(model=NAME, max_tokens=10, tools=ANTHROPIC_TOOLS, messages=conversation,
                                   extra_body={"temperature": 0})
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    count = claude.messages.count_tokens(model=NAME, tools=ANTHROPIC_TOOLS, messages=conversation)
    assert count.input_tokens == after.usage.input_tokens
    assert count.input_tokens > first.usage.input_tokens  # the call and its result are in the prompt


def test_count_tokens_matches_usage(claude):
    kw = dict(model=NAME, system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
              messages=[{"role": "user", "content": [{"type": "text", "text": "count me"}]}])
    counted = claude.messages.count_tokens(**kw).input_tokens
    assert counted == claude.messages.create(max_tokens=1, **kw).usage.input_tokens > 0


def test_stop_sequences_and_max_tokens(claude):
    greedy = {"temperature": 0}
    text = claude.messages.create(model=NAME, max_tokens=40, messages=[{"role": "user", "content": "go"}],
                                  extra_body=greedy).content[0].text
    stop = text[5:7]
    assert stop.strip()
    m = claude.messages.create(model=NAME, max_tokens=40, messages=[{"role": "user", "content": "go"}],
                               stop_sequences=[stop], extra_body=greedy)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    short = claude.messages.create(model=NAME, max_tokens=1, messages=[{"role": "user", "content": "go"}],
                                   extra_body=greedy)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 1


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
USER = [{"role": "user", "content": "hi"}]
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


REASONED = [ParserEvent("reasoning", text="The user wants "), ParserEvent("reasoning", text="a light."),
            ParserEvent("content", text="On it."), ParserEvent("call", call=ParsedCall(id="call_1", name="set_light")),
            ParserEvent("args", text='{"room": "hall", '), ParserEvent("args", text='"on": true}')]


def sse_payloads(events: list[str]) -> list[dict]:
    return [json.loads(e.split("data: ", 1)[1]) for e in events]


def test_reasoning_becomes_a_reasoning_item_and_a_thinking_block():
    """What a reasoning parser's events turn into: a reasoning item before the message and the
    call (Responses), a thinking block streamed as thinking_delta (Messages)."""
    usage = UsageInfo(prompt_tokens=3, completion_tokens=9, total_tokens=12)
    rb = ResponseBuilder(ResponseObject(id="resp_x", model="m"))
    events = sse_payloads(rb.start() + rb.feed(REASONED) + rb.end("stop", usage))
    out = rb.response.model_dump(mode="json")["output"]
    assert [item["type"] for item in out] == ["reasoning", "message", "function_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "The user wants a light."}]
    assert out[1]["content"][0]["text"] == "On it." and out[2]["arguments"] == '{"room": "hall", "on": true}'
    assert [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"] == \
        ["The user wants ", "a light."]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == out
    assert [e["sequence_number"] for e in events] == list(range(len(events)))

    mb = MessageBuilder(MessageResponse(id="msg_x", model="m"))
    events = sse_payloads(mb.start() + mb.feed(REASONED) + mb.end(("tool_use", None), usage))
    content = mb.message.model_dump(mode="json")["content"]
    assert content == [{"type": "thinking", "thinking": "The user wants a light.", "signature": ""},
                       {"type": "text", "text": "On it."},
                       {"type": "tool_use", "id": "toolu_1", "name": "set_light",
                        "input": {"room": "hall", "on": True}}]
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == ["thinking_delta", "thinking_delta", "text_delta", "input_json_delta", "input_json_delta"]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts[2] == {"type": "tool_use", "id": "toolu_1", "name": "set_light", "input": {}}


# ----------------------------------------------------------------------------- reasoning, through the server

# A template that opens the think block unless the request switches thinking off (then it closes
# an empty one, as Qwen3's does for enable_thinking=false), served with the qwen3 reasoning parser.
THINK_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
THINKER = "tiny-thinker"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> Iterator[str]:
    """A server whose model's output is read by the qwen3 reasoning parser under THINK_TEMPLATE
    (the --chat-template flag lands in the model's OutputParsing; the parser is detected from the
    template's enable_thinking switch, as for Qwen3's own). The
    random model never writes </think>: with thinking on its whole output is reasoning, with it
    off its whole output is the answer."""
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-thinker") / "llama", max_positions=1024)
    engine = tiny_engine(folder)
    parsing = OutputParsing(chat_template=THINK_TEMPLATE)
    spec = ModelSpec(THINKER, str(folder), parsing=parsing)
    try:
        with serve_in_thread(create_app(router=ModelRouter([ServedModel(spec, engine)]))) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.mark.parametrize("effort", [None, "high", "none"])
def test_responses_reasoning_item_from_the_reasoning_parser(thinker, effort):
    oai = openai.OpenAI(base_url=f"{thinker}/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=THINKER, input="why is the sky blue?", max_output_tokens=24, temperature=1.0,
              extra_body={"seed": 6})
    if effort is not None:
        kw["reasoning"] = {"effort": effort}
    whole = oai.responses.create(**kw)
    thinking = effort != "none"
    assert [item.type for item in whole.output] == (["reasoning"] if thinking else ["message"])
    if thinking:
        (part,) = whole.output[0].content
        assert part.type == "reasoning_text" and part.text and whole.output_text == ""
    else:
        assert whole.output_text  # no reasoning item: the answer is the message
    assert (whole.reasoning.effort if whole.reasoning is not None else None) == effort  # echoed
    events = list(oai.responses.create(stream=True, **kw))
    final = events[-1].response
    assert without_ids(final.model_dump()["output"]) == without_ids(whole.model_dump()["output"])
    deltas = "".join(e.delta for e in events if e.type == ("response.reasoning_text.delta" if thinking
                                                          else "response.output_text.delta"))
    assert deltas == (whole.output[0].content[0].text if thinking else whole.output_text)
    assert final.usage == whole.usage
    # The same parser factory reads chat completions: the reasoning apart, as reasoning_content.
    chat = httpx.post(f"{thinker}/v1/chat/completions", timeout=60, json={
        "model": THINKER, "messages": [{"role": "user", "content": "why is the sky blue?"}], "max_tokens": 24,
        "temperature": 1.0, "seed": 6,
        "chat_template_kwargs": None if effort is None else {"enable_thinking": thinking,
                                                            "reasoning_effort": effort}}).json()
    message = chat["choices"][0]["message"]
    if thinking:
        assert message["reasoning_content"] == whole.output[0].content[0].text and message["content"] == ""
    else:
        assert "reasoning_content" not in message and message["content"] == whole.output_text


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"},
                                      {"type": "disabled"}, None])
def test_messages_thinking_block_from_the_reasoning_parser(thinker, thinking):
    claude = anthropic.Anthropic(base_url=thinker, api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=THINKER, max_tokens=24, messages=[{"role": "user", "content": "why is the sky blue?"}],
              extra_body={"seed": 9, "temperature": 1.0})
    if thinking is not None:
        kw["thinking"] = thinking
    whole = claude.messages.create(**kw)
    on = thinking is None or thinking["type"] != "disabled"  # the template's default is on
    assert [b.type for b in whole.content] == (["thinking"] if on else ["text"])
    assert (whole.content[0].thinking if on else whole.content[0].text)
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert without_ids(final.model_dump()) == without_ids(whole.model_dump())
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == ({"thinking_delta"} if on else {"text_delta"})
    assert "".join(d.thinking if on else d.text for d in deltas) == \
        (whole.content[0].thinking if on else whole.content[0].text)
    # The prompt is the one the setting renders: count_tokens agrees with usage either way.
    counted = claude.messages.count_tokens(**{k: v for k, v in kw.items() if k not in ("max_tokens", "extra_body")})
    assert counted.input_tokens == whole.usage.input_tokens


def test_thinking_settings_reach_the_template():
    from tessera.server.anthropic.protocol import MessagesRequest
    from tessera.server.responses.protocol import ResponsesRequest

    def messages(thinking):
        return MessagesRequest.model_validate({"max_tokens": 5, "messages": USER, "thinking": thinking}) \
            .chat_request().chat_template_kwargs

    assert messages({"type": "enabled", "budget_tokens": 2048}) == {"enable_thinking": True}
    assert messages({"type": "disabled"}) == {"enable_thinking": False}
    assert messages(None) is None

    def responses(reasoning):
        return ResponsesRequest.model_validate({"input": "hi", "reasoning": reasoning}).chat_request(
            [{"role": "user", "content": "hi"}]).chat_template_kwargs

    assert responses({"effort": "low", "summary": "auto"}) == {"enable_thinking": True, "reasoning_effort": "low"}
    assert responses({"effort": "none"}) == {"enable_thinking": False, "reasoning_effort": "none"}
    assert responses({"summary": "auto"}) is None and responses(None) is None
