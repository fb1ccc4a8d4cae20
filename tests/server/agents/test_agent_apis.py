"""OpenAI's Responses API and Anthropic's Messages API through the real server (uvicorn over an
AsyncLLMEngine on a tiny random model), driven by the official `openai` and `anthropic` clients
and by raw HTTP for what a client would never send.

A random model writes garbage, which is what these tests want: the shapes, the event order, the
stream against the whole response for the same seed, the tool constraint (a forced call must
name a declared tool with arguments that validate), and the conversation store. Hostile bodies
and failures are in test_agent_errors.py, reasoning in test_agent_reasoning.py; the server and
its clients come from agent_server.py.
"""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from agent_server import (ANTHROPIC_TOOLS, LIGHT, NAME, RESPONSES_TOOLS, anthropic_client, merged_cache, openai_client,
                          prompt_tokens, serve_tiny, wait_idle, without_ids)

from tessera.server.responses.response_models import ResponseObject
from tessera.server.responses.serving import ResponseStore, StoredResponse

# The server over the tiny model and its clients, one of each per module.
server = pytest.fixture(scope="module", name="server")(serve_tiny)
oai = pytest.fixture(scope="module", name="oai")(openai_client)
claude = pytest.fixture(scope="module", name="claude")(anthropic_client)


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
    assert merged_cache(final)["usage"] == merged_cache(whole)["usage"]
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
    assert without_ids(merged_cache(final)) == without_ids(merged_cache(whole))
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
    assert count.input_tokens == prompt_tokens(after.usage)
    assert count.input_tokens > prompt_tokens(first.usage)  # the call and its result are in the prompt


def test_count_tokens_matches_usage(claude):
    kw = dict(model=NAME, system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
              messages=[{"role": "user", "content": [{"type": "text", "text": "count me"}]}])
    counted = claude.messages.count_tokens(**kw).input_tokens
    assert counted == prompt_tokens(claude.messages.create(max_tokens=1, **kw).usage) > 0


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
