"""What the Responses and Messages APIs share in reading the model's output and streaming it.

The parser itself is the chat path's (`chat.chat_run` hands both APIs the same factory chat
completions uses: `tools.output_parser` with the served model's OutputParsing). Both APIs feed
a whole response's text through the same parser their streams feed delta by delta, so a
streamed response concatenates to the non-streamed one by construction (the parsers give the
same result however the text is cut).
"""
from __future__ import annotations

import json

from tessera.server.tools import OutputParser, ParserEvent


def parse_whole(parser: OutputParser, text: str) -> list[ParserEvent]:
    """A whole response's events, as its stream would have given them."""
    return parser.feed(text) + parser.finish()


def typed_sse(event: str, payload: dict) -> str:
    """A server-sent event with its type on the `event:` line, as the Responses and Messages
    streams send every event (the payload's `type` says the same)."""
    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
