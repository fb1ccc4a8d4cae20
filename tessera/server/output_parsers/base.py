"""What every output parser shares: the events it streams, the calls it finds, the protocol the
APIs drive, and the helpers for text that may still turn into markup.

A parser reads the model's text as it streams (`feed(delta)`, then `finish()`) and turns it into
events: content text, reasoning text, a tool call's start (id and name) and its argument text.
A whole response runs the same parser over the whole text, so streamed and whole responses
agree by construction, and the argument deltas of a call concatenate to its `arguments`.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from tessera.server.openai.tool_schemas import ChatTool

EventKind = Literal["content", "reasoning", "call", "args"]


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""  # JSON text of an object, as OpenAI sends it


def new_call(name: str, arguments: str = "") -> ParsedCall:
    return ParsedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=arguments)


@dataclass
class ParserEvent:
    """One thing to stream: content or reasoning text, a call's start (`call`, with id and name)
    or argument text of the call at `index`."""

    kind: EventKind
    text: str = ""
    index: int = 0
    call: Optional[ParsedCall] = None


class OutputParser(Protocol):
    """What the APIs drive: feed text deltas, then finish(); read the results off it."""

    calls: list[ParsedCall]  # the tool calls found so far (arguments grow as they stream)
    reasoning: str  # all reasoning text so far
    content: str  # all content text so far

    def feed(self, delta: str) -> list[ParserEvent]: ...

    def finish(self) -> list[ParserEvent]: ...


class ToolParser:
    """Base of the tool-call parsers: content and call events out of streamed text.

    A subclass reads one family's syntax (`step`), and says how that syntax is enforced
    (`call_format`: an xgrammar structural-tag format) and how earlier calls and the tools are
    written for a chat template that does not render them (`render_calls`, `instructions`).
    """

    name: ClassVar[str]
    # Its markers are special tokens (Mistral's [TOOL_CALLS]) that detokenizing must keep.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: Sequence[ChatTool] = ()) -> None:
        self.schemas: dict[str, dict[str, Any]] = {t.function.name: t.function.parameters or {} for t in tools}
        self.calls: list[ParsedCall] = []
        self.content = ""
        self.reasoning = ""
        self.buf = ""
        self._events: list[ParserEvent] = []

    # -- driving ------------------------------------------------------------------------
    def feed(self, delta: str) -> list[ParserEvent]:
        self.buf += delta
        self._run(final=False)
        return self._take()

    def finish(self) -> list[ParserEvent]:
        """The end of the text: what was held back, and an unterminated call as far as it goes."""
        self._run(final=True)
        self.end()
        self.buf = ""
        return self._take()

    def _run(self, final: bool) -> None:
        while self.step(final):
            pass

    def _take(self) -> list[ParserEvent]:
        events, self._events = self._events, []
        return events

    def step(self, final: bool) -> bool:
        """Consume what can be decided of `buf`; True if something changed (then it runs again)."""
        raise NotImplementedError

    def end(self) -> None:
        """At finish, after the last step: whatever the state still holds."""

    # -- events -------------------------------------------------------------------------
    def emit_content(self, text: str) -> None:
        if not text:
            return
        if not self.content:
            text = text.lstrip("\n")  # the newline a model puts before a call, or at the start
            if not text:
                return
        self.content += text
        self._events.append(ParserEvent("content", text=text))

    def start_call(self, name: str) -> ParsedCall:
        call = new_call(name)
        self.calls.append(call)
        self._events.append(ParserEvent("call", index=len(self.calls) - 1, call=call))
        return call

    def emit_args(self, text: str) -> None:
        if not text:
            return
        self.calls[-1].arguments += text
        self._events.append(ParserEvent("args", text=text, index=len(self.calls) - 1))

    def whole_call(self, name: str, arguments: str) -> None:
        self.start_call(name)
        self.emit_args(arguments)

    def text_until(self, opener: re.Pattern[str], final: bool, prefixes: Sequence[str] = ()) -> Optional[re.Match[str]]:
        """In free text: send the text before the first `opener` (whitespace just before it is
        dropped) and return the match, or send what cannot start an opener and return None."""
        found = opener.search(self.buf)
        if found is not None:
            self.emit_content(self.buf[:found.start()].rstrip())
            return found
        if final:
            self.emit_content(self.buf.rstrip())
            self.buf = ""
            return None
        hold = max([partial_suffix(self.buf, p) for p in prefixes] + [self.hold_back(self.buf)])
        cut = len(self.buf[:len(self.buf) - hold].rstrip())  # trailing whitespace waits: a call may follow
        if cut > 0:
            self.emit_content(self.buf[:cut])
            self.buf = self.buf[cut:]
        return None

    def hold_back(self, text: str) -> int:
        """How much of the end of free text may still become an opener, beyond a plain prefix."""
        return 0

    # -- grammar and prompt side ----------------------------------------------------------
    @classmethod
    def call_format(cls, specs: list[dict[str, Any]], mode: str, parallel: bool) -> dict[str, Any]:
        """The xgrammar structural-tag format of this syntax: free text and calls in "auto",
        at least one call in "required", exactly the one tool of `specs` in "named"; each call
        names a tool of `specs` (`{"name", "parameters"}`) with arguments valid for it."""
        raise NotImplementedError

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        """Earlier calls ({"name", "arguments": object}) as this family writes them."""
        raise NotImplementedError

    instructions: ClassVar[str] = ""  # how to call, for a system message; "{tools}" is the listing


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest end of `text` that is a proper start of `token`."""
    return next((k for k in range(min(len(token) - 1, len(text)), 0, -1) if token.startswith(text[-k:])), 0)


class JsonScanner:
    """Finds where a JSON value ends in text that arrives in pieces, without parsing it: string
    and bracket state is kept between calls, so each character is read once."""

    def __init__(self, depth: int = 0) -> None:
        self.pos = 0
        self.depth = depth  # >0: already inside that many brackets (e.g. the rest of an object)
        self.in_string = False
        self.escape = False
        self.started = depth > 0
        self.scalar = False

    def end(self, text: str) -> Optional[int]:
        """Index just past the value in `text` (which only grows between calls), or None yet."""
        i = self.pos
        while i < len(text):
            ch = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:  # a string on its own
                        self.pos = i + 1
                        return i + 1
            elif not self.started:
                if ch.isspace():
                    pass
                elif ch in "{[":
                    self.started, self.depth = True, 1
                elif ch == '"':
                    self.started, self.in_string = True, True
                else:
                    self.started, self.scalar = True, True
            elif self.scalar:
                if ch in ",}]" or ch.isspace():
                    self.pos = i
                    return i
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
            i += 1
        self.pos = i
        return None


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)

