"""Tool-call and reasoning parsers on the syntax each model family writes: whole, split at every
character boundary, fed one character at a time and cut at random points, the events always
add up to the whole-text parse (argument deltas to valid JSON equal to it); and each parser's
grammar accepts that syntax and refuses a call to an undeclared tool or with bad arguments."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.errors import ConfigError
from tessera.server.output_parsers import OutputParsing, detect_tool_parser, output_parser, prompt_opens_think
from tessera.server.openai.tool_schemas import ChatTool, NamedToolChoice
from tessera.server.tools import add_tools_to_messages, tool_constraint

TOOLS = [ChatTool.model_validate(t) for t in [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "zip": {"type": "string"}, "detail": {"type": "boolean"},
                                         "opts": {"type": "object"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]]

# (parser, text as the family writes it, content, [(name, arguments as an object)])
TOOL_CASES = [
    ("hermes", 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
     "I will check.", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "Europe/Paris"})]),
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris", "opts": {"x": [1, "}"]}}}', "",
     [("get_weather", {"city": "Paris", "opts": {"x": [1, "}"]}})]),
    ("hermes", "No tools needed: 4.", "No tools needed: 4.", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco, CA"}}', "",
     [("get_weather", {"city": "San Francisco, CA"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("llama3_json", 'Use {braces} freely; "name" too.', 'Use {braces} freely; "name" too.', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "opts": {"a": [1, "]"]}}}, '
                '{"name": "get_time", "arguments": {}}]', "",
     [("get_weather", {"city": "Paris", "opts": {"a": [1, "]"]}}), ("get_time", {})]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
     "Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]),
    ("mistral", "A list: [1, 2].", "A list: [1, 2].", []),
    ("pythonic", '[get_weather(city="Paris, FR", days=3, detail=True), get_time(zone=\'CET\')]', "",
     [("get_weather", {"city": "Paris, FR", "days": 3, "detail": True}), ("get_time", {"zone": "CET"})]),
    ("pythonic", '<|python_start|>[get_weather(city="Rome", opts={"a": [1, 2], "b": None})]<|python_end|>', "",
     [("get_weather", {"city": "Rome", "opts": {"a": [1, 2], "b": None}})]),
    ("pythonic", "See [the docs](https://x.y) and [1, 2].", "See [the docs](https://x.y) and [1, 2].", []),
    ("qwen3_coder", "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n10001\n</parameter>\n<parameter=opts>\n"
                    '{"units": "metric"}\n</parameter>\n</function>\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "New York", "days": 3, "zip": "10001", "opts": {"units": "metric"}})]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
                    "<parameter=city>\na < b\n</parameter>\n<parameter=detail>\ntrue\n</parameter>\n</function>\n"
                    "</tool_call>",
     "", [("get_time", {}), ("get_weather", {"city": "a < b", "detail": True})]),
]

# (reasoning parser, rendered prompt, output, reasoning, content)
REASONING_CASES = [
    ("deepseek_r1", "<｜User｜>2+2?<｜Assistant｜><think>\n", "2+2 is 4.\n</think>\n\nThe answer is 4.",
     "2+2 is 4.\n", "The answer is 4."),
    ("deepseek_r1", "<｜User｜>hi<｜Assistant｜>", "<think>\nhmm\n</think>\n\nHello!", "\nhmm\n", "Hello!"),
    ("deepseek_r1", "", "cut off while still thinking", "cut off while still thinking", ""),
    ("deepseek_r1", "<｜Assistant｜><think>\n\n</think>\n\n", "Thinking was off.", "", "Thinking was off."),
    ("qwen3", "<|im_start|>assistant\n", "<think>\nThe user greets.\n</think>\n\nHello!", "\nThe user greets.\n",
     "Hello!"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hello, no thinking.", "", "Hello, no thinking."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "opened by the template</think>answer", "opened by the template",
     "answer"),
    ("qwen3", "", "a < b and </thin are not the end", "", "a < b and </thin are not the end"),
]


def run(settings_: OutputParsing, chunks: list[str], parse_tools: bool = True, prompt: str = "") -> dict:
    p = output_parser(settings_, parse_tools, tools=TOOLS, prompt=prompt)
    events = []
    for c in chunks:
        events += p.feed(c)
    events += p.finish()
    calls: dict[int, list[str]] = {}
    for e in events:
        if e.kind == "call":
            assert e.index not in calls and e.call is not None
            calls[e.index] = [e.call.name, ""]
        elif e.kind == "args":
            calls[e.index][1] += e.text
    streamed = [(name, args) for _, (name, args) in sorted(calls.items())]
    assert streamed == [(c.name, c.arguments) for c in p.calls]
    out = {"content": "".join(e.text for e in events if e.kind == "content"),
           "reasoning": "".join(e.text for e in events if e.kind == "reasoning"), "calls": streamed}
    assert out["content"] == p.content and out["reasoning"] == p.reasoning
    return out


def splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize("name, text, content, calls", TOOL_CASES)
def test_tool_parser_goldens_whole_and_split_everywhere(name, text, content, calls):
    settings_ = OutputParsing(tool_call_parser=name)
    whole = run(settings_, [text])
    assert whole["content"] == content
    assert [(n, json.loads(a)) for n, a in whole["calls"]] == calls  # valid JSON, the values written
    for chunks in splits(text):
        assert run(settings_, chunks) == whole, chunks


@pytest.mark.parametrize("name, prompt, text, reasoning, content", REASONING_CASES)
def test_reasoning_parser_goldens_whole_and_split_everywhere(name, prompt, text, reasoning, content):
    settings_ = OutputParsing(reasoning_parser=name)
    whole = run(settings_, [text], parse_tools=False, prompt=prompt)
    assert (whole["reasoning"], whole["content"]) == (reasoning, content)
    for chunks in splits(text):
        assert run(settings_, chunks, parse_tools=False, prompt=prompt) == whole, chunks


def test_reasoning_then_tool_calls_and_plain_passthrough():
    text = ('<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call>')
    settings_ = OutputParsing(tool_call_parser="hermes", reasoning_parser="qwen3")
    whole = run(settings_, [text])
    assert whole == {"content": "", "reasoning": "\nThe user wants weather.\n",
                     "calls": [("get_weather", '{"city": "Oslo"}')]}
    for chunks in splits(text):
        assert run(settings_, chunks) == whole
    # Neither parser: the text goes through untouched, whitespace and all.
    assert run(OutputParsing(), ["\n  <tool_call> as text ", "\n"], parse_tools=False)["content"] == \
        "\n  <tool_call> as text \n"


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(TOOL_CASES + [(None, c[1], c[2], c[3]) for c in REASONING_CASES]), data=st.data())
def test_any_cutting_gives_the_whole_result(case, data):
    name, text = case[0], case[1] if case[0] is not None else case[2]
    settings_ = OutputParsing(tool_call_parser=name) if name else OutputParsing(reasoning_parser="deepseek_r1")
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=20)))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert run(settings_, chunks) == run(settings_, [text])


def test_a_call_cut_short_keeps_what_was_written():
    p = output_parser(OutputParsing(tool_call_parser="qwen3_coder"), True, tools=TOOLS)
    p.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2")
    p.finish()
    assert json.loads(p.calls[0].arguments) == {"city": "Paris"}
    p = output_parser(OutputParsing(tool_call_parser="pythonic"), True, tools=TOOLS)
    p.feed('[get_weather(city="Paris", days=')
    p.finish()
    assert json.loads(p.calls[0].arguments) == {"city": "Paris"}


# ----------------------------------------------------------------------------- grammars

def accepts(constraint, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_structural_tag(constraint.structural_tag), text)


# (parser, a call the grammar must accept (named get_weather), the same call to an undeclared tool)
GRAMMAR_CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    ("pythonic", '[get_weather(city="Paris", days=2, detail=True)]'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>"),
]


@pytest.mark.parametrize("name, call", GRAMMAR_CASES)
def test_each_parsers_grammar_holds_calls_to_its_syntax_and_the_tools(name, call):
    settings_ = OutputParsing(tool_call_parser=name)
    required = tool_constraint(TOOLS, "required", True, settings_)
    named = tool_constraint(TOOLS, NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}}), True, settings_)
    auto = tool_constraint(TOOLS, None, True, settings_)
    assert accepts(required, call) and accepts(named, call) and accepts(auto, "Hello. " + call)
    assert accepts(auto, "No call at all.") and not accepts(required, "No call at all.")
    assert not accepts(required, call.replace("get_weather", "get_wether"))  # an undeclared tool
    assert not accepts(required, call.replace("Paris", "").replace("city", "days"))  # bad arguments
    # What it accepts, its parser reads back as the call.
    assert [c[0] for c in run(settings_, [call])["calls"]] == ["get_weather"]


def test_pythonic_grammar_writes_python_literals_and_parallel_calls():
    settings_ = OutputParsing(tool_call_parser="pythonic")
    required = tool_constraint(TOOLS, "required", True, settings_)
    assert accepts(required, '[get_weather(city="a", opts={"k": None}), get_time(), get_time(zone="UTC")]')
    assert not accepts(required, '[get_weather(city="a", detail=true)]')  # JSON's true is no Python literal
    assert not accepts(tool_constraint(TOOLS, "required", False, settings_), '[get_time(), get_time()]')


def test_reasoning_comes_before_the_calls_in_the_grammar():
    settings_ = OutputParsing(tool_call_parser="hermes", reasoning_parser="qwen3")
    call = GRAMMAR_CASES[0][1]
    opened = tool_constraint(TOOLS, "required", True, settings_, prompt="<|im_start|>assistant\n<think>\n")
    assert accepts(opened, "Weather, so a call.\n</think>\n\n" + call)
    assert not accepts(opened, call)  # the template opened the block: it must close before a call
    free = tool_constraint(TOOLS, "required", True, settings_, prompt="<|im_start|>assistant\n")
    assert accepts(free, call) and accepts(free, "<think>\nhm\n</think>\n\n" + call)
    off = tool_constraint(TOOLS, "required", True, settings_, prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert accepts(off, call) and not accepts(off, "<think>\nhm\n</think>\n\n" + call)  # thinking switched off


# ----------------------------------------------------------------------------- settings

def test_parser_detection_and_settings_checks():
    assert detect_tool_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_tool_parser("<tool_call>\n<function=example_function_name>") == "qwen3_coder"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_parser("[func_name1(params_name1=params_value1") == "pythonic"
    assert detect_tool_parser("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect_tool_parser(None) == "hermes"
    assert OutputParsing().resolved("[TOOL_CALLS]").tool_call_parser == "mistral"
    assert OutputParsing(tool_call_parser="pythonic").resolved("<tool_call>").tool_call_parser == "pythonic"
    assert OutputParsing(chat_template="<function=").resolved("<tool_call>").tool_call_parser == "qwen3_coder"
    for bad in (dict(tool_call_parser="nope"), dict(reasoning_parser="nope"), dict(chat_template=" ")):
        with pytest.raises(ConfigError):
            OutputParsing(**bad)
    assert prompt_opens_think("x<think>\n") and not prompt_opens_think("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"])
def test_history_written_in_the_parsers_syntax_reads_back(name):
    """For a template that renders no tools, earlier calls go into the text in the parser's own
    syntax, which the same parser reads back as those calls."""
    settings_ = OutputParsing(tool_call_parser=name)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}]
    out = add_tools_to_messages(messages, TOOLS, settings_.tool_parser)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    got = run(settings_, [out[-1]["content"]])["calls"]
    assert [(n, json.loads(a)) for n, a in got] == [("get_weather", {"city": "Paris", "days": 2})]


def test_chat_template_flag_and_model_tables(tmp_path):
    from tessera.server.config import models_from_toml, read_chat_template

    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    assert read_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0].content }}"
    assert read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    with pytest.raises(ConfigError, match="neither a readable file nor a template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "m.toml").write_text(
        '[[model]]\nmodel = "a"\ntool_call_parser = "mistral"\nchat_template = "{{ x }}"\n'
        '[[model]]\nmodel = "b"\n')
    flags = OutputParsing(tool_call_parser="pythonic", reasoning_parser="qwen3")
    first, second = models_from_toml(tmp_path / "m.toml", None, False, flags)[0]
    assert first.parsing == OutputParsing("mistral", "qwen3", "{{ x }}") and second.parsing == flags
    (tmp_path / "bad.toml").write_text('[[model]]\nmodel = "a"\nreasoning_parser = "nope"\n')
    with pytest.raises(Exception, match="reasoning-parser"):
        models_from_toml(tmp_path / "bad.toml", None, False)


def test_hermes_auto_holds_a_fenced_pretty_object_to_the_tools():
    """Qwen2.5-Coder under an agent's long prompt writes its call as a pretty-printed object in a
    ```json fence: in "auto" that opens a call too, held to the tools' names, and read back."""
    settings_ = OutputParsing(tool_call_parser="hermes")
    auto = tool_constraint(TOOLS, None, True, settings_)
    call = '```json\n{\n  "name": "get_weather", "arguments": {"city": "Paris"}}\n```'
    assert accepts(auto, call)
    assert not accepts(auto, call.replace("get_weather", "echo"))
    parsed = run(settings_, [call])
    assert [c[0] for c in parsed["calls"]] == ["get_weather"]


def test_parsers_are_detected_from_the_chat_template():
    """Qwen3's template (its enable_thinking switch, <tool_call> examples) gets the qwen3 reasoning
    parser and hermes; a template that opens <think> itself gets deepseek_r1; a plain one neither;
    an explicit "none" keeps the think block in the content."""
    qwen3 = ("{% if tools %}<tool_call>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
             "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")
    r1 = "{% for m in messages %}{{ m.content }}{% endfor %}<|Assistant|><think>\n"
    got = OutputParsing().resolved(qwen3)
    assert (got.reasoning_parser, got.tool_call_parser, got.reasoning.name) == ("qwen3", "hermes", "qwen3")
    assert OutputParsing().resolved(r1).reasoning_parser == "deepseek_r1"
    assert OutputParsing().resolved("{{ messages[0].content }}").reasoning is None
    off = OutputParsing(reasoning_parser="none").resolved(qwen3)
    assert off.reasoning_parser == "none" and off.reasoning is None
    assert OutputParsing(reasoning_parser="qwen3", chat_template=qwen3).resolved(None).reasoning_parser == "qwen3"
