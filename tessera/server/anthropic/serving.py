"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A request becomes a chat completion request and runs through the chat path (`chat.chat_run`:
template, tool constraint, admission, deadline, cancel on disconnect). The model's output goes
through one parser into content blocks (`MessageBuilder`): `thinking`, `text`, `tool_use`. A
stream is the builder's events as Anthropic sends them (message_start, ping, then per block
content_block_start / _delta / _stop, then message_delta with the stop reason and usage, and
message_stop); a whole message is the builder's final state, so the two agree by construction.

Errors, wherever they arise (schema, routing, admission, the engine), leave in Anthropic's
shape, `{"type": "error", "error": {"type", "message"}}` (`anthropic_errors`); mid-stream, as an
`error` event. Claude Code and the SDK send `x-api-key` and `anthropic-version`; this server
checks neither (it has no keys), so any values are accepted.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Awaitable, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tessera.engine.outputs import RequestOutput
from tessera.server.openai.chat import chat_run
from tessera.server.errors import APIError
from tessera.server.output import parse_whole, typed_sse
from tessera.server.openai.response_models import UsageInfo
from tessera.server.anthropic.protocol import CountTokensRequest, MessageResponse, MessagesRequest, Usage, error_body
from tessera.server.serving import StreamRenderer, record_usage, usage_of
from tessera.server.tools import OutputParser, ParserEvent


async def anthropic_errors(handler: Awaitable[Response]) -> Response:
    """The handler's response, its error (if it is one) rewritten into Anthropic's shape."""
    response = await handler
    if response.status_code < 400 or not isinstance(response, JSONResponse):
        return response
    try:
        body = json.loads(bytes(response.body))
        message = body["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(error_body(response.status_code, message), status_code=response.status_code, headers=headers)


def stop_reason(finish_reason: Optional[str], engine_stop: Union[int, str, None], stops: list[str],
                called: bool) -> tuple[Optional[str], Optional[str]]:
    """Anthropic's stop_reason and stop_sequence for how the sequence ended."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(engine_stop, str) and engine_stop in stops:
        return "stop_sequence", engine_stop
    return "end_turn", None


class MessageBuilder:
    """Content blocks from the parser's events, and the stream's events as it goes (built
    whether or not anyone streams them, so whole and streamed messages take the same steps)."""

    def __init__(self, message: MessageResponse) -> None:
        self.message = message
        self.block: Optional[dict[str, Any]] = None  # the block being written
        self.arguments = ""  # the open tool_use block's input as JSON text, as it streams

    def start(self) -> list[str]:
        return [typed_sse("message_start", {"type": "message_start", "message": self.message.model_dump(mode="json")}),
                typed_sse("ping", {"type": "ping"})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return typed_sse("content_block_delta", {"type": "content_block_delta", "index": self._index(),
                                                 "delta": delta})

    def _index(self) -> int:
        return len(self.message.content) - 1

    def feed(self, events: list[ParserEvent]) -> list[str]:
        out: list[str] = []
        for e in events:
            if e.kind == "content":
                if self.block is None or self.block["type"] != "text":
                    out += self._open({"type": "text", "text": ""})
                self.block["text"] += e.text  # type: ignore[index]
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif e.kind == "reasoning":
                if self.block is None or self.block["type"] != "thinking":
                    out += self._open({"type": "thinking", "thinking": "", "signature": ""})
                self.block["thinking"] += e.text  # type: ignore[index]
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif e.kind == "call":
                assert e.call is not None
                out += self._open({"type": "tool_use", "id": "toolu_" + e.call.id.removeprefix("call_"),
                                   "name": e.call.name, "input": {}})
            else:  # argument text of the call just opened
                assert self.block is not None and self.block["type"] == "tool_use"
                self.arguments += e.text
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
        return out

    def _open(self, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.message.content.append(block)
        self.block = block
        out.append(typed_sse("content_block_start", {"type": "content_block_start", "index": self._index(),
                                                     "content_block": block}))
        return out

    def _close(self) -> list[str]:
        block, self.block = self.block, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            try:
                parsed = json.loads(self.arguments) if self.arguments.strip() else {}
            except json.JSONDecodeError:  # cut off by max_tokens: the input as far as it parses is none
                parsed = {}
            block["input"] = parsed if isinstance(parsed, dict) else {}
            self.arguments = ""
        return [typed_sse("content_block_stop", {"type": "content_block_stop", "index": self._index()})]

    def end(self, reason: tuple[Optional[str], Optional[str]], usage: UsageInfo) -> list[str]:
        out = self._close()
        self.message.stop_reason, self.message.stop_sequence = reason
        self.message.usage = Usage.of(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        out.append(typed_sse("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
            "usage": self.message.usage.model_dump(mode="json")}))
        out.append(typed_sse("message_stop", {"type": "message_stop"}))
        return out


class MessagesStream(StreamRenderer):
    def __init__(self, builder: MessageBuilder, parser: OutputParser, stops: list[str]) -> None:
        self.builder, self.parser, self.stops = builder, parser, stops
        self.model = builder.message.model
        self.reason: tuple[Optional[str], Optional[str]] = (None, None)

    def admitted(self, first: list[RequestOutput]) -> None:
        """message_start's usage, as Anthropic's has it: the prompt split into cache reads and
        the rest (without a first output yet, after a long prefill, it says the whole prompt
        and message_delta the split)."""
        if first:
            self.builder.message.usage = Usage.of(len(first[0].prompt_token_ids), first[0].num_cached_tokens)

    def start(self) -> list[str]:
        self.builder.message.model = self.model  # a fallback model may have taken the request over
        return self.builder.start()

    def render(self, prompt_index: int, output: RequestOutput) -> list[str]:
        c = output.outputs[0]
        events = self.parser.feed(c.delta_text) + (self.parser.finish() if c.finished else [])
        if c.finished:
            self.reason = stop_reason(c.finish_reason, c.stop_reason, self.stops, bool(self.parser.calls))
        return self.builder.feed(events)

    def finish(self, usage: UsageInfo) -> list[str]:
        return self.builder.end(self.reason, usage)

    def error(self, err: APIError) -> list[str]:
        return [typed_sse("error", error_body(err.status, err.message))]

    def keepalive(self) -> list[str]:
        return [typed_sse("ping", {"type": "ping"})]


async def create_message(body: MessagesRequest, request: Request) -> Response:
    run, _, parsers = await chat_run(body.chat_request(**body.sampling()), request, f"msg_{uuid.uuid4().hex}")
    message = MessageResponse(id=run.request_id, model=run.route.reported,
                              usage=Usage(input_tokens=len(run.prompts[0])))
    builder, parser, stops = MessageBuilder(message), parsers(), body.stop_sequences or []
    if body.stream:
        return await run.stream(MessagesStream(builder, parser, stops))
    finals: Union[dict[int, RequestOutput], Response] = await run.collect()
    if isinstance(finals, Response):
        return finals
    c = finals[0].outputs[0]
    builder.feed(parse_whole(parser, c.text))
    usage = usage_of(finals)
    record_usage(request, usage)
    builder.end(stop_reason(c.finish_reason, c.stop_reason, stops, bool(parser.calls)), usage)
    return run.json(message.model_dump(mode="json"))


async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The prompt's length in tokens as the model would see it (template and tools included)."""
    run, _, _ = await chat_run(body.chat_request(), request, f"count_{uuid.uuid4().hex}")
    return JSONResponse({"input_tokens": len(run.prompts[0])}, headers=run.route.headers())
