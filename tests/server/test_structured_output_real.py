"""Structured output and tool calls on a real packaged model through `tessera serve` and the
official openai client: qwen2.5-coder-0.5b, one batch of 16 seeded requests with
different JSON schemas at temperature 0.8 (benchmarks/schema_validity.py is the full-size sweep), forced tool calls, streaming against whole
responses, and the client's `parse()` helper with a pydantic model.
"""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_process import ServerProcess, running_server
from test_structured_output import collect_stream

from tessera.bench.datasets import random_json_schema

pytestmark = pytest.mark.model

MODEL = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Iterator[tuple[ServerProcess, openai.OpenAI]]:
    with running_server(tmp_path_factory.mktemp("serve") / "server.log", "--max-num-seqs", "16", model=MODEL) as proc:
        yield proc, openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0,
                                   timeout=900)  # 16 x 400 tokens take minutes on a 2-core AVX2 host


# One batch of the server's 16 sequences: every kind of field random_json_schema writes (nested
# objects, arrays, enums, bounded strings and numbers, optional fields) appears in these.
SCHEMA_CASES = 16


def test_seeded_schemas_at_temperature_08_all_validate(qwen):
    _, client = qwen
    rng = random.Random(15)
    cases = [random_json_schema(rng) for _ in range(SCHEMA_CASES)]

    def ask(i: int):
        schema, text = cases[i]
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Describe something as JSON with: {text}."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                   "strict": True}},
            temperature=0.8, seed=i, max_tokens=400)
        return schema, r.choices[0]

    with ThreadPoolExecutor(16) as pool:  # a batch of 16 decodes in little more time than one of 8
        results = list(pool.map(ask, range(SCHEMA_CASES)))
    for schema, choice in results:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_json_is_the_whole_response(qwen):
    _, client = qwen
    schema, text = random_json_schema(random.Random(99))
    kw = dict(model=MODEL, messages=[{"role": "user", "content": f"Describe something as JSON with: {text}."}],
              response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
              temperature=0.8, seed=5, max_tokens=300)
    # The prompt's blocks into the prefix cache first, so both requests compute the same tail: in
    # bfloat16 a prompt computed whole and one computed after cached blocks go through matrix
    # products of other shapes, and a seeded sample can part (it did on an AVX512-BF16 host).
    client.chat.completions.create(**{**kw, "max_tokens": 1})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    content, calls, finish = collect_stream(client.chat.completions.create(stream=True, **kw))
    assert (content, calls, finish) == (whole, [], "stop")
    jsonschema.validate(json.loads(whole), schema)


class Person(BaseModel):
    name: str
    age: int
    hobbies: list[str]


def test_parse_helper_with_a_pydantic_model(qwen):
    _, client = qwen
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                      response_format=Person, temperature=0.8, seed=3, max_tokens=200)
    assert isinstance(r.choices[0].message.parsed, Person)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto"])
def test_tool_calls_validate_and_streaming_agrees(qwen, choice):
    _, client = qwen
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
              tools=[WEATHER, TIME], tool_choice=choice, temperature=0.8, seed=7, max_tokens=120)
    whole = client.chat.completions.create(**kw)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls", message
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls]
    assert calls[0][0] == "get_weather"
    jsonschema.validate(calls[0][1], WEATHER["function"]["parameters"])

    content, streamed, finish = collect_stream(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in streamed] == calls
    assert content == message.content


def test_tool_result_turn_and_metrics(qwen):
    proc, client = qwen
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=60)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    metrics = httpx.get(f"{proc.url}/metrics").text
    assert 'tessera:structured_output_requests_total{kind="json",model_name=' in metrics
    assert 'tessera:structured_output_requests_total{kind="structural_tag",model_name=' in metrics
