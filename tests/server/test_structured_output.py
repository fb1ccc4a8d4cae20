"""Structured output and tool calls: the grammar engine on the real engine loop (tiny random model),
the tool-call parser's streaming invariants, and the OpenAI surface through the official client.

A random model writes garbage, which is the point: whatever it prefers, every finished output must
match its constraint, at temperature 1 as well as greedy, with n > 1, under speculative decoding
and after preemption.
"""
from __future__ import annotations

import json
import pickle
import re
from typing import Iterator, Literal, Optional

import jsonschema
import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from fakes import serve_in_thread
from tiny_model import make_tiny_model

from tessera.config import EngineConfig
from tessera.engine.frontend.async_engine import AsyncLLMEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.llm import LLM
from tessera.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from tessera.server.app import create_app
from tessera.server.tools import ToolCallParser

NAME = "tiny"
# Bounded schemas: a random model inside an unbounded string or number could run to max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "inner": {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"],
                  "additionalProperties": False},
    },
    "required": ["colour", "ok", "count", "tags", "inner"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "set_light", "description": "Switch a light",
                                      "parameters": {"type": "object", "properties": {
                                          "room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
                                          "required": ["room", "on"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {},
                                                                       "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    # Long enough for the tools' system prompt in the tiny tokenizer (~700 tokens).
    return make_tiny_model(tmp_path_factory.mktemp("tiny-structured") / "llama", max_positions=1024)


@pytest.fixture(scope="module")
def llm(tiny_folder) -> LLM:
    return LLM(str(tiny_folder), dtype="float32", max_model_len=256, kv_cache_memory=2 * 2**20)


def constrained(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw, disable_any_whitespace=True)


# ----------------------------------------------------------------------------- engine


def test_every_finished_output_matches_its_constraint(llm):
    cases = [
        (constrained(json=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        (constrained(choice=["yes", "no", "ask (again)?"]), lambda t: t in ("yes", "no", "ask (again)?")),
        (constrained(regex=r"[ab]{2,4}-\d"), lambda t: re.fullmatch(r"[ab]{2,4}-\d", t) is not None),
        (constrained(grammar='root ::= "(" ("x" | "y")+ ")"'), lambda t: re.fullmatch(r"\([xy]+\)", t) is not None),
        (constrained(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    prompts, params, checks = [], [], []
    for seed in range(6):
        for c, check in cases:
            prompts.append("the quick brown fox")
            params.append(SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured_outputs=c, n=2))
            checks.append(check)
    outs = llm.generate(prompts, params)
    finished = 0
    for out, check in zip(outs, checks):
        for c in out.outputs:
            if c.finish_reason == "stop":
                finished += 1
                assert check(c.text), (out.request_id, c.text)
    assert finished >= len(outs)  # most of the 2 x 30 sequences end inside max_tokens


def test_greedy_is_the_masked_argmax_and_speculation_keeps_it(tiny_folder):
    """ngram speculation proposes tokens the grammar may refuse; verification against masked
    logits must give exactly the tokens of plain masked decoding."""
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=constrained(json=SCHEMA)),
              SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=constrained(regex=r"(ab|ba)+c"))]
    prompts = ["hello world, this is a tiny model", "the quick brown fox jumps over the lazy dog"]
    plain = LLM(str(tiny_folder), dtype="float32", max_model_len=256, kv_cache_memory=2 * 2**20)
    spec = LLM(str(tiny_folder), dtype="float32", max_model_len=256, kv_cache_memory=2 * 2**20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    a = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert a == b
    assert spec.engine.scheduler.kv.num_free_blocks == spec.engine.kv.num_blocks


def test_the_runner_gets_a_bitmask_and_plain_chunks(tiny_folder, monkeypatch):
    """What crosses the step boundary for constrained requests is plain data: an int32 bitmask
    with a row per sampled position (a verified run's k + 1 among them) and chunks that pickle,
    no grammar state and no request's lists; the grammars advance on the scheduler's side."""
    spec = LLM(str(tiny_folder), dtype="float32", max_model_len=256, kv_cache_memory=2 * 2**20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    seen = []
    execute = spec.engine.runner.execute

    def spy(out):
        seen.append(out)
        return execute(out)

    monkeypatch.setattr(spec.engine.runner, "execute", spy)
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=constrained(regex=r"(ab|ba)+c"))
    spec.generate(["abababababab", "babababa"], params)
    words = (spec.engine.model_config.vocab_size + 31) // 32
    runs = 0
    for out in (o for o in seen if o.grammar is not None):
        g = out.grammar
        assert g.pending is None and g.bitmask.dtype == torch.int32 and g.bitmask.shape[1] == words
        sizes = {s.request_id: s.num_spec_tokens + 1 for s in out.scheduled if s.samples}
        assert set(g.rows) <= set(sizes) and sum(sizes[r] for r in g.rows) == g.bitmask.shape[0]
        runs += sum(1 for s in out.scheduled if s.num_spec_tokens and s.request_id in g.rows)
        pickle.loads(pickle.dumps((g.bitmask, g.rows, out.scheduled)))
    assert runs > 0  # some masks covered a verified run of proposals


def test_grammar_state_survives_preemption(tiny_folder):
    """A KV cache too small for all sequences forces recompute preemption mid-output."""
    small = LLM(str(tiny_folder), dtype="float32", max_model_len=256, max_num_seqs=8,
                kv_cache_memory=14 * 2 * 2 * 2 * 16 * 16 * 4)  # 14 blocks of 16 tokens for 8 sequences
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5, n=8, structured_outputs=constrained(json=SCHEMA))
    out = small.generate(["paged attention stores keys"], params)[0]
    assert small.engine.scheduler.num_preemptions > 0
    for c in out.outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)


@pytest.mark.parametrize("bad, reason", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "JSON schema"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="(("), "regex"),
    (dict(grammar="root ::= undefined_rule"), "EBNF grammar"),
    (dict(grammar='root ::= root "a"'), "matches no output"),
    (dict(regex="[^\\s\\S]"), "matches no output"),
])
def test_invalid_constraints_are_refused_before_queueing(llm, bad, reason):
    with pytest.raises(InvalidRequestError, match=reason):
        llm.engine.prepare_request("bad", "hello", SamplingParams(structured_outputs=StructuredOutputsParams(**bad)))
    assert not llm.engine.has_unfinished_requests()


def test_a_grammar_that_dead_ends_stops_instead_of_sampling_from_nothing(llm):
    """After "ab" this grammar can never finish: no token is allowed, so the sequence stops there."""
    params = SamplingParams(max_tokens=30, temperature=1.0, structured_outputs=constrained(
        grammar='root ::= "ab" x\nx ::= x "c"'))
    out = llm.generate(["hello"], params)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("ab", "stop")


def test_params_need_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputsParams(choice=[])


# ----------------------------------------------------------------------------- tool-call parser


def parse(chunks: list[str]) -> tuple[str, list[tuple[str, str]], str, list[tuple[str, str]]]:
    """(content from events, calls from events, parser.content, parser.calls)."""
    p = ToolCallParser()
    events = []
    for c in chunks:
        events += p.feed(c)
    events += p.finish()
    content = "".join(e.text for e in events if e.kind == "content")
    calls: dict[int, list[str]] = {}
    for e in events:
        if e.kind == "call":
            calls[e.index] = [e.call.name, ""]
        elif e.kind == "args":
            calls[e.index][1] += e.text
    return content, [tuple(v) for _, v in sorted(calls.items())], p.content, [(c.name, c.arguments) for c in p.calls]


PARSER_CASES = [
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": {"y": [1, "}"]}}}\n'
     '</tool_call>', "Sure.", [("get_weather", '{"city": "Paris", "x": {"y": [1, "}"]}}')]),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": '
     '{"q": 1}}\n</tool_call>', "", [("a", "{}"), ("b", '{"q": 1}')]),
    ('<tool_call>\n{"arguments": {"q": 1}, "name": "z"}\n</tool_call>', "", [("z", '{"q": 1}')]),
    ('<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>', "",
     [("a", '{"x": 1}'), ("b", "{}")]),
    ("<tool_call>[1, 2]</tool_call> ok", "<tool_call>[1, 2]</tool_call> ok", []),
    ('{"name": "f", "arguments": {"u": "c"}}\n{"temp": 21}', '{"temp": 21}', [("f", '{"u": "c"}')]),
    ("Hello { world } and {\"name\" is here", "Hello { world } and {\"name\" is here", []),
    ('{"name": 5, "x": 1} tail', '{"name": 5, "x": 1} tail', []),
    ("Plain answer\n", "Plain answer", []),
]


@pytest.mark.parametrize("text, content, calls", PARSER_CASES)
def test_parser_reads_calls_and_content(text, content, calls):
    got = parse([text])
    assert got == (content, calls, content, calls)


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from([c[0] for c in PARSER_CASES]), data=st.data())
def test_parser_gives_the_same_result_however_the_text_is_cut(case, data):
    """Streamed (any chunking) and whole responses agree, and deltas only ever append."""
    cuts = sorted(data.draw(st.sets(st.integers(1, len(case) - 1), max_size=12)))
    chunks = [case[a:b] for a, b in zip([0] + cuts, cuts + [len(case)])]
    assert parse(chunks) == parse([case])


# ----------------------------------------------------------------------------- OpenAI surface


@pytest.fixture(scope="module")
def server(tiny_folder) -> Iterator[tuple[str, openai.OpenAI]]:
    from tessera.models.loader import load_model

    config = EngineConfig(model=str(tiny_folder), dtype="float32", max_model_len=1024, max_num_seqs=8,
                          kv_cache_memory=4 * 2**20)
    engine = AsyncLLMEngine(config, engine=LLMEngine(config, loaded=load_model(tiny_folder, "float32")))
    try:
        with serve_in_thread(create_app(engine, [NAME])) as url:
            yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        engine.shutdown()


class Reading(BaseModel):
    colour: Literal["red", "green", "blue"]
    ok: bool
    level: Literal[1, 2, 3]


def test_openai_parse_helper_with_a_pydantic_model(server):
    """A random model may spend its tokens on the whitespace JSON allows (the helper then raises
    LengthFinishReasonError); whatever ends must parse."""
    _, client = server
    parsed = 0
    for seed in range(6):
        try:
            r = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "hello"}],
                                              response_format=Reading, max_tokens=160, temperature=0.7, seed=seed)
        except openai.LengthFinishReasonError:
            continue
        assert isinstance(r.choices[0].message.parsed, Reading)
        parsed += 1
    assert parsed >= 2


def test_response_format_on_completions_and_vllm_extras(server):
    _, client = server
    r = client.completions.create(model=NAME, prompt="hello", max_tokens=120, temperature=1.0, seed=1,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "s", "schema": SCHEMA}}})
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(model=NAME, prompt="hello", max_tokens=10, temperature=1.0,
                                  extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert r.choices[0].text in ("up", "down")
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                       extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch(r"[0-9]{3}", r.choices[0].message.content)


def collect_stream(chunks) -> tuple[Optional[str], list[tuple[str, str]], Optional[str]]:
    """A streamed chat completion put together as a client does: content (None if empty),
    (name, arguments) per tool call in index order, finish reason."""
    content, finish = "", None
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", ""])
            if tc.function is not None:
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [(n, a) for _, (n, a) in sorted(calls.items())], finish


def tool_call_args(message) -> list[tuple[str, dict]]:
    return [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_light"}}])
def test_forced_tool_calls_validate_and_stream_like_the_whole_response(server, choice):
    _, client = server
    kw = dict(model=NAME, messages=[{"role": "user", "content": "lights!"}], tools=TOOLS, tool_choice=choice,
              max_tokens=200, temperature=0.7, seed=11)
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls = tool_call_args(whole.choices[0].message)
    assert calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for name, args in calls:
        jsonschema.validate(args, schemas[name])
    if isinstance(choice, dict):
        assert [n for n, _ in calls] == ["set_light"]
    assert all(t.id.startswith("call_") for t in whole.choices[0].message.tool_calls)

    content, streamed, finish = collect_stream(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in streamed] == calls
    assert content == whole.choices[0].message.content


def test_tool_history_renders_and_bad_tool_requests_are_400(server):
    _, client = server
    history = [{"role": "user", "content": "lights"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "set_light", "arguments": '{"room": "hall", "on": true}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    r = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=20, temperature=1.0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    bad = [
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}),
        dict(tool_choice="required"),
        dict(tools=TOOLS, response_format={"type": "json_object"}),
        dict(tools=TOOLS + TOOLS[:1]),
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}),
        dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
        dict(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                              "function": {"name": "f", "arguments": "{oops"}}]}]),
    ]
    for kw in bad:
        kw = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **kw}
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(**kw)
        assert exc.value.body["type"] == "invalid_request_error"
