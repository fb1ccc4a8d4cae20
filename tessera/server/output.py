"""How the Responses and Messages APIs read the model's output: one parser per generated
sequence, turning text deltas into events of four kinds (content, reasoning, a tool call's
start, its argument text) that each API renders as its own items or blocks.

Both APIs feed a whole response's text through the same parser their streams feed delta by
delta, so a streamed response concatenates to the non-streamed one by construction (the
parsers give the same result however the text is cut).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from tessera.server.tools import ParsedCall, ParserEvent, ToolCallParser


class OutputParser(Protocol):
    """feed() each text delta, then finish() once; `calls` are the tool calls found so far."""

    calls: list[ParsedCall]

    def feed(self, delta: str) -> list[ParserEvent]: ...

    def finish(self) -> list[ParserEvent]: ...


@dataclass
class PlainText:
    """The output as it is: content only (no tools were offered, no reasoning parser is set)."""

    calls: list[ParsedCall] = field(default_factory=list)
    reasoning: str = ""

    def feed(self, delta: str) -> list[ParserEvent]:
        return [ParserEvent("content", text=delta)] if delta else []

    def finish(self) -> list[ParserEvent]:
        return []


def output_parser(parse_tools: bool) -> OutputParser:
    """The parser for one sequence of the model's output (tool calls when `parse_tools`): the
    one place that picks it (`chat.chat_run` hands it to the Responses and Messages APIs)."""
    return ToolCallParser() if parse_tools else PlainText()


def parse_whole(parser: OutputParser, text: str) -> list[ParserEvent]:
    """A whole response's events, as its stream would have given them."""
    return parser.feed(text) + parser.finish()


def typed_sse(event: str, payload: dict) -> str:
    """A server-sent event with its type on the `event:` line, as the Responses and Messages
    streams send every event (the payload's `type` says the same)."""
    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
