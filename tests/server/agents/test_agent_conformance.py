"""What agent clients send, accepted and answered in the event order each client reads, on all
three chat-shaped APIs (chat completions, Responses, Messages) through the real server on a tiny
random model.

The fixtures (tests/fixtures/agents/) are requests Claude Code and Codex CLI sent to a recording
server (benchmarks/agents/capture.py): Claude Code's `system` entry among the messages,
`?beta=true`, `anthropic-beta` headers, adaptive thinking, `context_management`,
`output_config`, a 32,000-token max_tokens, a deferred tool and its billing-header system block;
Codex's `developer` messages, namespace tools and the hosted `web_search`, `include`,
`store: false`, `prompt_cache_key`, `client_metadata`, and a function call with its output sent
back. Whole, each must become a prompt; with its long texts shortened (the tiny model's
tokenizer spends a token a byte), each is replayed through the server, streamed and not. Then a
tool round trip per API with each kind of tool: function, namespace, freeform (custom), and a
hosted tool that the model is not shown and the response header names.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import jsonschema
import pytest
from agent_server import LIGHT, anthropic_client, openai_client, tiny_engine
from fakes import serve_in_thread
from tiny_model import make_tiny_model

from tessera.metrics import MetricFamilies
from tessera.server.app import create_app
from tessera.server.openai.tool_schemas import IGNORED_TOOLS_HEADER
from tessera.server.anthropic.protocol import BILLING_HEADER, MessagesRequest
from tessera.server.responses.protocol import ResponsesRequest, items_to_messages
from tessera.server.tools import OutputParsing, render_prompt
from tessera.tokenizer import Tokenizer

NAME = "tiny"
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "agents"
CLAUDE_CODE = sorted(FIXTURES.glob("claude_code_*.json"))
CODEX = sorted(FIXTURES.glob("codex_*.json"))
MAX_MODEL_LEN = 16384
PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to files.",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}


def captured(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def shorten(value: Any, limit: int = 40) -> Any:
    """The same request with every string past `limit` characters cut: keys, roles, block and item
    kinds, tools and their schemas stay as the client sent them."""
    if isinstance(value, str):
        return value[:limit]
    if isinstance(value, list):
        return [shorten(v, limit) for v in value]
    if isinstance(value, dict):
        return {k: shorten(v, limit) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-conformance") / "llama", max_positions=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(folder) -> Iterator[str]:
    engine = tiny_engine(folder, max_model_len=MAX_MODEL_LEN)
    try:
        with serve_in_thread(create_app(engine, [NAME], metrics=MetricFamilies())) as url:
            yield url
    finally:
        engine.shutdown()


oai = pytest.fixture(scope="module", name="oai")(openai_client)  # the clients, on this module's server
claude = pytest.fixture(scope="module", name="claude")(anthropic_client)


def sse_events(r: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a typed event stream, in order."""
    events, name = [], None
    for line in r.text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            assert data["type"] == name, (name, data)
            events.append((name, data))
    return events


def check_message_events(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Anthropic's order: message_start, ping, then each block's start, deltas and stop (indices
    counting up), message_delta with the stop reason, message_stop."""
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"], names
    open_index, next_index = None, 0
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index = next_index
        elif name == "content_block_delta":
            assert data["index"] == open_index
        else:
            assert name == "content_block_stop" and data["index"] == open_index, name
            open_index, next_index = None, next_index + 1
    assert open_index is None
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "stop_sequence")


def check_response_events(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """OpenAI's order: created, in_progress, each item added ... done, then completed (or
    incomplete); sequence numbers count up from 0. Returns the final response."""
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"], names
    assert names[-1] in ("response.completed", "response.incomplete"), names
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    added = [d["output_index"] for n, d in events if n == "response.output_item.added"]
    done = [d["output_index"] for n, d in events if n == "response.output_item.done"]
    assert added == done == list(range(len(added)))
    return events[-1][1]["response"]


# ----------------------------------------------------------------------------- captured requests, whole


@pytest.mark.parametrize("path", CLAUDE_CODE + CODEX, ids=lambda p: p.stem)
def test_captured_requests_become_prompts(path, folder):
    """Each captured body, whole, through the API's conversion and a chat template: accepted, with
    its system entries kept and what the model is not shown left out."""
    tokenizer = Tokenizer.from_hf_folder(folder)
    body = captured(path)["body"]
    if path in CLAUDE_CODE:
        request = MessagesRequest.model_validate(body)
        chat = request.chat_request(**request.sampling())
        offered = {t["name"] for t in body["tools"] if not t.get("defer_loading")}
        assert any(t.get("defer_loading") for t in body["tools"])
    else:
        request = ResponsesRequest.model_validate(body)
        chat = request.chat_request(items_to_messages(request.input_items()))
        offered = {t["name"] for t in body["tools"] if t["type"] == "function"} | {
            f"{ns['name']}__{t['name']}" for ns in body["tools"] if ns["type"] == "namespace" for t in ns["tools"]}
        assert chat.ignored_tools == ["web_search"]
    assert {t.function.name for t in chat.function_tools()} == offered
    roles = [m.role for m in chat.messages]
    assert roles[0] == "system" and "user" in roles
    prompt = render_prompt(tokenizer, OutputParsing(), chat.template_messages(), chat.tools)
    assert BILLING_HEADER not in prompt
    assert body_texts(body)[-1][:40] in prompt  # the last thing the client said is in the prompt


def body_texts(body: dict[str, Any]) -> list[str]:
    """The plain texts of a Messages or Responses body's turns, in order."""
    texts = []
    for turn in body.get("messages") or body.get("input") or []:
        content = turn.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts += [c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)]
        elif isinstance(turn.get("output"), str):
            texts.append(turn["output"])
    return texts


# ----------------------------------------------------------------------------- captured requests, replayed


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("path", CLAUDE_CODE, ids=lambda p: p.stem)
def test_claude_code_requests_answered(server, path, stream):
    capture = captured(path)
    body = {**shorten(capture["body"]), "model": NAME, "stream": stream}
    assert body["max_tokens"] > MAX_MODEL_LEN  # the output stops at the context's end instead
    headers = {k: v for k, v in capture["headers"].items() if k.startswith("anthropic-")}
    r = httpx.post(f"{server}{capture['path']}", json=body, headers={**headers, "x-api-key": "k"}, timeout=120)
    assert r.status_code == 200, r.text
    if stream:
        check_message_events(sse_events(r))
    else:
        message = r.json()
        assert message["type"] == "message" and message["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
        assert all(b["type"] in ("text", "tool_use", "thinking") for b in message["content"])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("path", CODEX, ids=lambda p: p.stem)
def test_codex_requests_answered(server, path, stream):
    capture = captured(path)
    body = {**shorten(capture["body"]), "model": NAME, "stream": stream, "max_output_tokens": 24}
    r = httpx.post(f"{server}{capture['path']}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers[IGNORED_TOOLS_HEADER] == "web_search"
    response = check_response_events(sse_events(r)) if stream else r.json()
    assert response["store"] is False and response["status"] in ("completed", "incomplete")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("route", ["/v1/responses", "/v1/chat/completions", "/v1/messages"])
def test_an_unknown_tool_type_beyond_latin_1_is_named_escaped(server, route, stream):
    """The ignored tools' header names what the client sent: HTTP headers take neither characters
    beyond latin-1 nor line breaks (this was a 500 found by schemathesis)."""
    body = {"model": NAME, "tools": [{"type": "Ā\nx"}], "stream": stream}
    body.update({"input": "hi", "max_output_tokens": 4} if route == "/v1/responses" else
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    if route == "/v1/messages":  # Anthropic's server tools have a name besides the type
        body["tools"][0]["name"] = "x"
    r = httpx.post(f"{server}{route}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers[IGNORED_TOOLS_HEADER] == "\\u0100\\nx"


# ----------------------------------------------------------------------------- tool round trips


def test_chat_round_trip_with_each_kind_of_tool(server, oai):
    tools = [{"type": "function", "function": {"name": "set_light", "parameters": LIGHT}},
             {"type": "custom", "custom": {"name": "apply_patch", "description": "Apply a patch."}},
             {"type": "web_search_preview"}]
    messages = [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "fix it"}]
    for choice, kind in (({"type": "function", "function": {"name": "set_light"}}, "function"),
                         ({"type": "custom", "custom": {"name": "apply_patch"}}, "custom")):
        raw = oai.chat.completions.with_raw_response.create(model=NAME, messages=messages, tools=tools,
                                                            tool_choice=choice, max_tokens=300, seed=2,
                                                            temperature=0.7)
        assert raw.headers[IGNORED_TOOLS_HEADER] == "web_search_preview"
        call = raw.parse().choices[0].message.tool_calls[0]
        assert call.type == kind
        if kind == "function":
            jsonschema.validate(json.loads(call.function.arguments), LIGHT)
        else:
            assert call.custom.name == "apply_patch" and isinstance(call.custom.input, str)
        streamed = [c for chunk in oai.chat.completions.create(model=NAME, messages=messages, tools=tools,
                                                                tool_choice=choice, max_tokens=300, seed=2,
                                                                temperature=0.7, stream=True)
                    for c in chunk.choices[0].delta.tool_calls or []]
        assert streamed[0].type == kind
        if kind == "custom":  # a freeform call streams whole, the same as the whole response's
            assert streamed[0].model_dump()["custom"]["input"] == call.custom.input
        back = oai.chat.completions.create(model=NAME, max_tokens=8, tools=tools, messages=messages + [
            {"role": "assistant", "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": "done"}])
        assert back.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_responses_round_trip_with_each_kind_of_tool(server, oai):
    tools = [{"type": "namespace", "name": "home", "description": "The house.",
              "tools": [{"type": "function", "name": "set_light", "parameters": LIGHT}]},
             PATCH_TOOL, {"type": "web_search"}, {"type": "local_shell"}]
    prompt = [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "lights"}]
    raw = oai.responses.with_raw_response.create(
        model=NAME, input=prompt, tools=tools, store=False, max_output_tokens=300, temperature=0.7,
        tool_choice={"type": "function", "name": "set_light", "namespace": "home"}, extra_body={"seed": 2})
    assert raw.headers[IGNORED_TOOLS_HEADER] == "web_search, local_shell"
    call = raw.parse().output[-1].model_dump()
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "set_light", "home")
    jsonschema.validate(json.loads(call["arguments"]), LIGHT)

    events = list(oai.responses.create(model=NAME, input=prompt, tools=tools, store=False, max_output_tokens=300,
                                       temperature=0.7,
                                       tool_choice={"type": "custom", "name": "apply_patch"}, stream=True,
                                       extra_body={"seed": 2}))
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.done" in kinds
    patch = events[-1].response.output[-1]
    assert (patch.type, patch.name) == ("custom_tool_call", "apply_patch") and isinstance(patch.input, str)
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert done.input == patch.input

    back = oai.responses.create(model=NAME, tools=tools, store=False, max_output_tokens=8, input=prompt + [
        {"type": "function_call", "call_id": call["call_id"], "name": "set_light", "namespace": "home",
         "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "ok"},
        {"type": "custom_tool_call", "call_id": patch.call_id, "name": "apply_patch", "input": patch.input},
        {"type": "custom_tool_call_output", "call_id": patch.call_id, "output": "applied"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "x"}},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"}])
    assert back.status in ("completed", "incomplete")


def test_messages_round_trip_with_each_kind_of_tool(server, claude):
    tools = [{"name": "set_light", "description": "Switch a light", "input_schema": LIGHT},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]
    messages = [{"role": "user", "content": "lights"}, {"role": "system", "content": "Answer briefly."}]
    raw = claude.messages.with_raw_response.create(model=NAME, max_tokens=300, tools=tools, messages=messages,
                                                   tool_choice={"type": "tool", "name": "set_light"},
                                                   extra_body={"temperature": 0.5, "top_k": 20})
    assert raw.headers[IGNORED_TOOLS_HEADER] == "web_search_20250305"
    use = raw.parse().content[-1]
    assert use.type == "tool_use" and use.name == "set_light"
    jsonschema.validate(use.input, LIGHT)
    back = claude.messages.create(model=NAME, max_tokens=8, tools=tools, messages=messages + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                                           "input": {"query": "x"}},
                                          {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                                      "content": [{"type": "text", "text": "bulb missing"}],
                                      "cache_control": {"type": "ephemeral"}}]}])
    assert back.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_what_stays_a_4xx(server):
    """Tolerance ends at what no client sends on purpose: images to a text model, wrong types."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBER"}}
    for block in (image, pdf):
        r = httpx.post(f"{server}/v1/messages", json={"model": NAME, "max_tokens": 4, "messages": [
            {"role": "user", "content": [block]}]}, timeout=30)
        assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/responses", json={"model": NAME, "input": "hi", "tools": [{"type": 5}]}, timeout=30)
    assert r.status_code == 400
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": NAME, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, timeout=30)
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"]


# Gemma's way: a system message only first, user and assistant turns alternating.
STRICT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system only first') }}{% endif %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_strict_template_gets_the_system_texts_joined(folder):
    """Claude Code's and Codex's shapes (system after a user turn, user turns in a row) through a
    template that refuses both: rendered with every system text in the first message instead."""
    tokenizer = Tokenizer.from_hf_folder(folder)
    messages = [{"role": "system", "content": "You code."}, {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "<env>cwd</env>"}, {"role": "user", "content": "hi"},
                {"role": "system", "content": "Tools changed."}]
    prompt = render_prompt(tokenizer, OutputParsing(chat_template=STRICT_TEMPLATE), messages, None)
    assert prompt == ("<system>You code.\n\nBe brief.\n\nTools changed.</system><user><env>cwd</env>\n\nhi</user>"
                      "<assistant>")
    # A template that takes them as sent renders them as sent (the leading two joined).
    plain = render_prompt(tokenizer, OutputParsing(), messages, None)
    assert plain.index("Tools changed.") > plain.index("hi")


def test_max_tokens_is_a_ceiling():
    from tessera.sampling_params import SamplingParams
    from tessera.server.openai.chat import fit_context

    params = SamplingParams(max_tokens=32000)
    assert fit_context(params, 12000, 32768).max_tokens == 20768
    assert fit_context(params, 100, 65536) is params
    assert fit_context(SamplingParams(max_tokens=None), 12000, 32768).max_tokens is None
