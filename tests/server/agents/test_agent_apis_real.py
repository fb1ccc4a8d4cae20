"""The Responses and Messages APIs on a real packaged model (qwen2.5-coder-0.5b) through
`tessera serve` and the official clients: an answer a small model gets right, a tool call it
makes on its own (tool_choice auto) with arguments that name what was asked, the tool's result
sent back, and a stream that is the whole response.
"""
from __future__ import annotations

import json
from typing import Iterator

import anthropic
import openai
import pytest
from agent_server import prompt_tokens
from server_process import ServerProcess, running_server

pytestmark = pytest.mark.model

MODEL = "qwen2.5-coder-0.5b"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
QUESTION = "What is the capital of France? Answer with one word."
ASK_WEATHER = "What is the weather like in Paris right now? Use the tool."


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("serve") / "server.log", "--max-num-seqs", "4", model=MODEL) as proc:
        yield proc


def test_responses_on_qwen(qwen):
    client = openai.OpenAI(base_url=f"{qwen.url}/v1", api_key="unused", max_retries=0, timeout=600)
    kw = dict(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0)
    client.responses.create(**{**kw, "max_output_tokens": 1})  # the prompt's blocks cached for both runs
    whole = client.responses.create(**kw)
    assert "Paris" in whole.output_text
    streamed = "".join(e.delta for e in client.responses.create(stream=True, **kw)
                       if e.type == "response.output_text.delta")
    assert streamed == whole.output_text

    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
              "parameters": WEATHER}]
    call = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=tools, max_output_tokens=60, temperature=0)
    calls = [item for item in call.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"], call.output
    assert "paris" in json.loads(calls[0].arguments)["city"].lower()
    answer = client.responses.create(
        model=MODEL, previous_response_id=call.id, tools=tools, max_output_tokens=40, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": json.dumps({"temperature_c": 21, "sky": "sunny"})}])
    assert answer.output_text and ("21" in answer.output_text or "sunny" in answer.output_text.lower())


def test_messages_on_qwen(qwen):
    client = anthropic.Anthropic(base_url=qwen.url, api_key="unused", max_retries=0, timeout=600)
    kw = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": QUESTION}],
              extra_body={"temperature": 0})
    client.messages.create(**{**kw, "max_tokens": 1})
    whole = client.messages.create(**kw)
    assert "Paris" in whole.content[0].text
    with client.messages.stream(**kw) as stream:
        assert stream.get_final_message().content[0].text == whole.content[0].text

    tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": ASK_WEATHER}]
    call = client.messages.create(model=MODEL, max_tokens=60, tools=tools, messages=ask,
                                  extra_body={"temperature": 0})
    assert call.stop_reason == "tool_use", call.content
    use = next(b for b in call.content if b.type == "tool_use")
    assert use.name == "get_weather" and "paris" in use.input["city"].lower()
    answer = client.messages.create(
        model=MODEL, max_tokens=40, tools=tools, extra_body={"temperature": 0},
        messages=ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in call.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]}])
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert "21" in text or "sunny" in text.lower()
    counted = client.messages.count_tokens(model=MODEL, tools=tools, messages=ask)
    assert counted.input_tokens == prompt_tokens(call.usage)
