"""Tool calls in a syntax that is not the model's own, and reasoning output, on a real packaged
model through `tessera serve` and the official openai client: qwen2.5-coder-0.5b served with
`--tool-call-parser pythonic` (the grammar makes it write `[f(a=...)]` calls), `--reasoning-parser
qwen3` and a `--chat-template` file whose generation prompt opens a think block unless the
request's `chat_template_kwargs` say `enable_thinking: false` (Qwen3's switch).
"""
from __future__ import annotations

import json
from typing import Iterator

import jsonschema
import openai
import pytest
from server_process import ServerProcess, running_server
from test_structured_output import collect_stream

pytestmark = pytest.mark.model

MODEL = "qwen2.5-coder-0.5b"
# ChatML with Qwen3's thinking switch; it renders no tools, so Tessera adds them (in the pythonic
# parser's words) as a system message.
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{% endif %}{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Iterator[tuple[ServerProcess, openai.OpenAI]]:
    folder = tmp_path_factory.mktemp("serve")
    (folder / "template.jinja").write_text(TEMPLATE)
    with running_server(folder / "server.log", "--max-num-seqs", "4", "--tool-call-parser", "pythonic",
                        "--reasoning-parser", "qwen3", "--chat-template", str(folder / "template.jinja"),
                        model=MODEL) as proc:
        yield proc, openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_pythonic_calls_forced_by_the_grammar_stream_like_the_whole(qwen, choice):
    _, client = qwen
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
              tools=[WEATHER, TIME], tool_choice=choice, temperature=0.8, seed=7, max_tokens=80,
              extra_body=NO_THINKING)
    # The prompt into the prefix cache first (see test_structured_output_real).
    client.chat.completions.create(**{**kw, "max_tokens": 1})
    whole = client.chat.completions.create(logprobs=True, **kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole.message
    raw = "".join(t.token for t in whole.logprobs.content).removesuffix("<|im_end|>")  # what the model wrote
    assert raw.strip().startswith(("[get_weather(", "[get_time(")) and raw.rstrip().endswith(")]"), raw
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    assert calls and all(n in SCHEMAS for n, _ in calls)
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])
    if isinstance(choice, dict):
        assert [n for n, _ in calls] == ["get_weather"]
    content, streamed, finish = collect_stream(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in streamed] == calls
    assert content == whole.message.content


def test_reasoning_comes_apart_in_whole_and_streamed_responses(qwen):
    """The template opened <think>; a regex holds the model to 'thoughts</think>answer' so the
    block closes within the budget, and the parser splits it."""
    _, client = qwen
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], temperature=0.8, seed=3,
              max_tokens=60,
              extra_body={"structured_outputs": {"regex": r"[A-Za-z ,.]{5,60}</think>\n\n[A-Za-z ,.!]{3,40}"}})
    client.chat.completions.create(**{**kw, "max_tokens": 1})
    whole = client.chat.completions.create(**kw).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning and whole.message.model_extra["reasoning"] == reasoning
    assert whole.message.content and "<think>" not in whole.message.content and "</think>" not in whole.message.content
    streamed_reasoning, streamed_content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            delta = chunk.choices[0].delta
            streamed_reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed_content += delta.content or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, whole.message.content)


def test_enable_thinking_false_reaches_the_template(qwen):
    _, client = qwen
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                       temperature=0.0, max_tokens=20,
                                       extra_body={**NO_THINKING,
                                                   "structured_outputs": {"regex": "[A-Za-z ,.!]{3,30}"}})
    message = r.choices[0].message
    assert message.content and message.model_extra.get("reasoning_content") is None  # the template closed the block
    # A variable the renderer owns cannot be set from a request.
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


def test_responses_and_messages_read_through_the_same_parsers(qwen):
    """The Responses and Messages APIs get the chat path's parser: pythonic calls forced by the
    grammar come back as function_call items / tool_use blocks, the think block the template
    opened as a reasoning item / thinking block, and the agents' thinking switches (effort
    "none", thinking disabled) reach the template."""
    import anthropic

    proc, _ = qwen
    oai = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=600)
    claude = anthropic.Anthropic(base_url=proc.url, api_key="unused", max_retries=0, timeout=600)
    ask = "What is the weather in Paris?"
    weather = WEATHER["function"]
    r = oai.responses.create(model=MODEL, input=ask, tools=[{"type": "function", **weather}], tool_choice="required",
                             reasoning={"effort": "none"}, max_output_tokens=80, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.output[0].type == "function_call" and calls[0].name == "get_weather", r.output
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])
    m = claude.messages.create(model=MODEL, max_tokens=80, messages=[{"role": "user", "content": ask}],
                               tools=[{"name": weather["name"], "description": weather["description"],
                                       "input_schema": weather["parameters"]}],
                               tool_choice={"type": "tool", "name": "get_weather"}, thinking={"type": "disabled"},
                               extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use" and m.content[0].type == "tool_use" and m.content[0].name == "get_weather"
    jsonschema.validate(m.content[0].input, SCHEMAS["get_weather"])

    hello = [{"role": "user", "content": "Say hello."}]
    r = oai.responses.create(model=MODEL, input=hello, max_output_tokens=12, temperature=0)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text.strip(), r.output
    kw = dict(model=MODEL, max_tokens=12, messages=hello, thinking={"type": "enabled", "budget_tokens": 1024},
              extra_body={"temperature": 0})
    whole = claude.messages.create(**kw)
    assert whole.content[0].type == "thinking" and whole.content[0].thinking == r.output[0].content[0].text
    with claude.messages.stream(**kw) as stream:
        assert stream.get_final_message().content == whole.content
