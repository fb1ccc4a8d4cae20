"""Reasoning in the Responses and Messages APIs: a reasoning parser's events become a reasoning item
and a thinking block, through the real server too (a template that opens a think block, read
by the qwen3 parser), and the thinking settings reach the chat template."""
from __future__ import annotations

import json
from typing import Iterator

import anthropic
import httpx
import openai
import pytest
from agent_server import USER, merged_cache, prompt_tokens, tiny_engine, without_ids
from fakes import serve_in_thread
from tiny_model import CHAT_TEMPLATE, make_tiny_model

from tessera.server.anthropic.protocol import MessageResponse
from tessera.server.anthropic.serving import MessageBuilder
from tessera.server.app import create_app
from tessera.server.model_router import ModelRouter
from tessera.server.openai.response_models import UsageInfo
from tessera.server.responses.response_models import ResponseObject
from tessera.server.responses.serving import ResponseBuilder
from tessera.server.served_model import ModelSpec, ServedModel
from tessera.server.tools import OutputParsing, ParsedCall, ParserEvent

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
    assert merged_cache(final)["usage"] == merged_cache(whole)["usage"]
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
    assert without_ids(merged_cache(final)) == without_ids(merged_cache(whole))
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == ({"thinking_delta"} if on else {"text_delta"})
    assert "".join(d.thinking if on else d.text for d in deltas) == \
        (whole.content[0].thinking if on else whole.content[0].text)
    # The prompt is the one the setting renders: count_tokens agrees with usage either way.
    counted = claude.messages.count_tokens(**{k: v for k, v in kw.items() if k not in ("max_tokens", "extra_body")})
    assert counted.input_tokens == prompt_tokens(whole.usage)


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
