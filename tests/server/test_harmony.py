"""gpt-oss's harmony format: the reader of its channels (analysis to reasoning, final and
commentary to content, messages to functions.NAME to tool calls) whole and cut at every point,
its grammar, its detection from the chat template, its stop tokens, the prompt the real gpt-oss
template renders for what the server builds, and one conversation through the server's three
APIs on a scripted engine.

tests/data/openai-gpt-oss-120b.jinja is OpenAI's gpt-oss chat template (Apache-2.0), as
llama.cpp ships it in models/templates/.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from fakes import ByteTokenizer, FakeCore, serve_in_thread
from test_output_parsers import accepts, run

from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.server.anthropic.protocol import MessagesRequest
from tessera.server.app import create_app
from tessera.server.openai.chat import chat_prompt_text
from tessera.server.openai.protocol import ChatCompletionRequest
from tessera.server.openai.tool_schemas import ChatTool, NamedToolChoice
from tessera.server.output_parsers import OutputParsing
from tessera.server.tools import tool_constraint
from tessera.tokenizer import Tokenizer

TEMPLATE = (Path(__file__).parent.parent / "data" / "openai-gpt-oss-120b.jinja").read_text()
HARMONY = OutputParsing().resolved(TEMPLATE)
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [ChatTool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}})]

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|>"
CALL_AFTER = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
              '{"city": "Paris", "days": 2}<|call|>')
# (output as gpt-oss writes it after the template's "<|start|>assistant", reasoning, content, calls)
CASES = [
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
     "The user wants the weather in Paris.", "It is sunny.", []),
    (ANALYSIS + CALL_AFTER, "The user wants the weather in Paris.", "",
     [("get_weather", {"city": "Paris", "days": 2})]),
    # a preamble (commentary without a recipient), then the recipient before the channel
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
     '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>',
     "The user wants the weather in Paris.", "Checking the forecast.", [("get_weather", {"city": "Oslo"})]),
    # a call straight away, its recipient first (the prompt ended with "<|start|>assistant")
    (' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": "Rome"}<|call|>',
     "", "", [("get_weather", {"city": "Rome"})]),
    # max_tokens inside the analysis: reasoning only
    ("<|channel|>analysis<|message|>Let me think about <|en", "Let me think about <|en", "", []),
    # the model leaves out <|start|>assistant before its next message; two analysis messages
    ("<|channel|>analysis<|message|>One.<|end|><|channel|>analysis<|message|>Two.<|end|>"
     "<|channel|>final<|message|>Done.", "One.\nTwo.", "Done.", []),
    # gpt-oss-20b's stray commentary channel before the analysis
    ("<|channel|>commentary<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Yes.<|return|>", "Hm.", "Yes.", []),
    # a call without a body still has arguments; a message to an unserved built-in tool is dropped
    ("<|channel|>commentary to=browser.search <|constrain|>json<|message|>{\"query\": \"x\"}<|end|>"
     "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|><|call|>",
     "", "", [("get_weather", {})]),
    # no harmony at all: the text is the answer
    ("Just text, no channels.", "", "Just text, no channels.", []),
]


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_harmony_goldens_whole_and_cut_everywhere(text, reasoning, content, calls):
    whole = run(HARMONY, [text])
    assert (whole["reasoning"], whole["content"]) == (reasoning, content)
    assert [(n, json.loads(a)) for n, a in whole["calls"]] == calls
    assert run(HARMONY, list(text)) == whole  # token by token (a character each)
    for i in range(1, len(text)):
        assert run(HARMONY, [text[:i], text[i:]]) == whole, i


def test_without_tools_or_reasoning_parser():
    """No tools offered: the reasoning parser alone (openai_gptoss) splits the channels and a call
    is dropped; --reasoning-parser none leaves the analysis in the content."""
    text = CASES[2][0]
    alone = OutputParsing(reasoning_parser="openai_gptoss")
    assert run(alone, [text], parse_tools=False) == {
        "reasoning": "The user wants the weather in Paris.", "content": "Checking the forecast.", "calls": []}
    assert run(HARMONY, [text], parse_tools=False)["calls"] == []
    plain = OutputParsing(tool_call_parser="openai", reasoning_parser="none")
    got = run(plain, [CASES[0][0]])
    assert got == {"reasoning": "", "content": "The user wants the weather in Paris.\n\nIt is sunny.", "calls": []}


def test_detection_stop_tokens_and_special_tokens():
    assert (HARMONY.tool_call_parser, HARMONY.reasoning_parser) == ("openai", "openai_gptoss")
    assert HARMONY.keeps_special_tokens(False) and HARMONY.keeps_special_tokens(True)
    other = OutputParsing().resolved("{% for m in messages %}<tool_call>{{ m.content }}{% endfor %}")
    assert (other.tool_call_parser, other.reasoning_parser) == ("hermes", "none")
    assert not other.keeps_special_tokens(True)
    # o200k_harmony's ends: <|return|> and <|call|> stop, <|end|> does not (it ends only a message)
    from tokenizers import Tokenizer as Backend, models

    backend = Backend(models.BPE())
    backend.add_special_tokens(["<|endoftext|>", "<|return|>", "<|end|>", "<|call|>", "<|im_end|>"])
    ids = {t: backend.token_to_id(t) for t in ("<|endoftext|>", "<|return|>", "<|end|>", "<|call|>", "<|im_end|>")}
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=list(ids.values()), chat_template=TEMPLATE,
                    special_tokens_map={})
    assert tok.eos_token_ids == [ids["<|endoftext|>"], ids["<|return|>"], ids["<|call|>"], ids["<|im_end|>"]]
    assert tok.end_of_generation([ids["<|end|>"], ids["<|im_end|>"]]) == [ids["<|end|>"], ids["<|im_end|>"]]


def test_grammar_holds_calls_to_the_tools():
    call = '<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    required = tool_constraint(TOOLS, "required", True, HARMONY, prompt="<|start|>assistant")
    named = tool_constraint(TOOLS, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}}), True, HARMONY)
    auto = tool_constraint(TOOLS, None, True, HARMONY)
    assert accepts(required, call) and accepts(named, call)
    assert accepts(auto, ANALYSIS + "<|start|>assistant" + call)
    assert accepts(auto, ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>")
    assert not accepts(required, call.replace("get_weather", "get_wether"))
    assert not accepts(required, call.replace('"city"', '"town"'))
    assert run(HARMONY, [call])["calls"] == [("get_weather", '{"city": "Paris"}')]


# ----------------------------------------------------------------------------- the template


def template_tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as Backend, models

    return Tokenizer(Backend(models.BPE()), bos_token_id=None, eos_token_ids=[], chat_template=TEMPLATE,
                     special_tokens_map={})


def render(body: dict) -> str:
    return chat_prompt_text(template_tokenizer(), HARMONY, ChatCompletionRequest.model_validate(body))


def test_the_gpt_oss_template_renders_what_the_server_builds():
    """reasoning_effort reaches the system message; an earlier call (arguments as JSON text, as
    OpenAI clients send them) is rendered as the model writes one, after its reasoning; two
    calls in one turn become one turn each, each followed by its result."""
    weather = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    clock = {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    prompt = render({"reasoning_effort": "high", "tools": [t.model_dump() for t in TOOLS], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Two tools.",
         "tool_calls": [weather, clock]},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    assert "Reasoning: high" in prompt and "# Instructions\n\nBe brief." in prompt
    assert "type get_weather = (_: {\ncity: string,\ndays?: number,\n}) => any;" in prompt
    assert prompt.endswith(
        "<|start|>user<|message|>Weather and time in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Two tools.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
        '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"noon"<|end|>'
        "<|start|>assistant")
    assert "Reasoning: medium" in render({"messages": [{"role": "user", "content": "hi"}]})  # the default
    # a tool without a description (the template would add None to a string)
    bare = render({"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "ping"}}]})
    assert "// \ntype ping = () => any;" in bare


def test_anthropic_thinking_is_the_turns_reasoning():
    body = MessagesRequest.model_validate({"max_tokens": 9, "output_config": {"effort": "low"}, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": ""},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain"}]}]})
    prompt = chat_prompt_text(template_tokenizer(), HARMONY, body.chat_request())
    assert "Reasoning: low" in prompt
    assert ("<|start|>assistant<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions."
            'get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>') in prompt
    # other templates leave earlier reasoning out, as before
    plain = OutputParsing(chat_template="{% for m in messages %}{{ m.reasoning_content }}|{% endfor %}")
    assert "Call it." not in chat_prompt_text(template_tokenizer(), plain.resolved(None), body.chat_request())


# ----------------------------------------------------------------------------- through the server

REPLY = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary"
         ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


class HarmonyByteTokenizer(ByteTokenizer):
    """The fake engine's bytes, with gpt-oss's template rendered as the real tokenizer does."""

    chat_template = TEMPLATE
    special_tokens_map: dict = {}
    name = "fake-gpt-oss"
    apply_chat_template = Tokenizer.apply_chat_template


@pytest.fixture(scope="module")
def gpt_oss():
    core = FakeCore(step_s=0.0005, max_model_len=4096, num_blocks=2048, tokenizer=HarmonyByteTokenizer(),
                    reply=REPLY)
    engine = AsyncLLMEngine(core.config, engine=core)
    try:
        with serve_in_thread(create_app(engine, ["gpt-oss"])) as url:
            yield url
    finally:
        engine.shutdown()


def test_a_tool_call_through_the_three_apis(gpt_oss):
    tools = [t.model_dump() for t in TOOLS]
    body = {"model": "gpt-oss", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
            "reasoning_effort": "low", "max_tokens": 400, "temperature": 0}
    whole = httpx.post(f"{gpt_oss}/v1/chat/completions", json=body, timeout=60).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Need the weather." and not choice["message"]["content"]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    with httpx.stream("POST", f"{gpt_oss}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Need the weather."
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["function"]["arguments"] == ""
    assert "".join(tc["function"].get("arguments") or "" for tc in calls) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    claude = httpx.post(f"{gpt_oss}/v1/messages", timeout=60, json={
        "model": "gpt-oss", "max_tokens": 400, "temperature": 0, "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"name": "get_weather", "input_schema": WEATHER}]}).json()
    assert [b["type"] for b in claude["content"]] == ["thinking", "tool_use"]
    assert claude["content"][0]["thinking"] == "Need the weather." and claude["stop_reason"] == "tool_use"
    assert claude["content"][1]["input"] == {"city": "Paris"}

    ollama = httpx.post(f"{gpt_oss}/api/chat", timeout=60, json={
        "model": "gpt-oss", "stream": False, "think": "high", "tools": tools, "options": {"temperature": 0},
        "messages": [{"role": "user", "content": "Weather in Paris?"}]}).json()
    message = ollama["message"]
    assert message["thinking"] == "Need the weather." and message["content"] == ""
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
