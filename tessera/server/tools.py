"""Tool calling on chat completions: prompt, constraint and parsing of the model's tool calls.

Format: the Hermes style that Qwen2.5 was trained on and writes natively,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A model whose chat template renders tools (Qwen2.5) gets them through its template; one
whose template does not (SmolLM2) gets the same instructions as a system message, as Qwen's
template words them, so every packaged chat model calls tools the same way.

Enforcement: unless `tool_choice` is "none", the request carries a structural-tag
constraint (xgrammar's `qwen_3` tool-call tag, the same syntax): text is free until the model
opens `<tool_call>`; from there the function name must be one of the tools and the arguments
must validate against its `parameters` schema. "required" needs at least one call before
any end, a named choice forces that call, `parallel_tool_calls: false` stops after one.

Parsing: `ToolCallParser` reads the text as it streams and turns it into content deltas and
tool-call deltas (id and name first, then argument text as it arrives, like OpenAI's). A
non-streamed response runs the same parser over the whole text, so streamed and
non-streamed responses agree by construction.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from tessera.engine.worker.structured_output import MAX_JSON_WHITESPACE
from tessera.sampling_params import InvalidRequestError, StructuredOutputsParams
from tessera.server.protocol import ChatTool, NamedToolChoice

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
BARE_OPEN = '{"name": '  # a call written without the tags, as qwen2.5-coder-0.5b mostly does
_OPENERS = re.compile(r'<tool_call>|\{\s*"name"\s*:')
# The head of a call, up to where the arguments' JSON starts (and something of it has come).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)',
                   re.S)

# Qwen2.5's own wording (its chat template), for templates that do not render tools themselves.
_SYSTEM_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


def template_renders_tools(chat_template: Optional[str]) -> bool:
    return bool(chat_template) and "tools" in chat_template  # type: ignore[operator]


def tool_choice_mode(tools: Optional[list[ChatTool]], choice: Any) -> str:
    """'none', 'auto', 'required' or 'named', after checking the choice against the tools."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools")
        return "none"
    if choice is None:
        return "auto"
    if isinstance(choice, NamedToolChoice):
        names = {t.function.name for t in tools}
        if choice.function.name not in names:
            raise InvalidRequestError(f"tool_choice names function {choice.function.name!r}, which is not "
                                      f"among the tools ({', '.join(sorted(names))})")
        return "named"
    return str(choice)


def check_tools(tools: list[ChatTool]) -> None:
    names = [t.function.name for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidRequestError(f"tool names must be unique; repeated: {', '.join(dupes)}")
    for t in tools:
        params = t.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise InvalidRequestError(f"function {t.function.name!r}: parameters must be a JSON schema of "
                                      "type object")


def tool_constraint(tools: list[ChatTool], choice: Any, parallel: bool) -> StructuredOutputsParams:
    """The structural tag that enforces the tool-call syntax and each function's schema."""
    import xgrammar as xgr

    specs = [{"type": "function", "function": {
        "name": t.function.name, "parameters": t.function.parameters or {"type": "object", "properties": {}}}}
        for t in tools]
    xchoice: Any = choice.model_dump() if isinstance(choice, NamedToolChoice) else (choice or "auto")
    tag = json.loads(xgr.get_model_structural_tag("qwen_3", tools=specs, tool_choice=xchoice, reasoning="disabled",
                                                  parallel_tool_calls=parallel,
                                                  max_whitespace_cnt=MAX_JSON_WHITESPACE).model_dump_json())
    fmt = tag["format"]
    if xchoice == "auto" and fmt.get("type") == "triggered_tags":
        # Free text may also start a call without the tags ({"name": ...}), which small Qwen2.5
        # models write on their own; it is held to the same schemas.
        fmt["triggers"].append(BARE_OPEN)
        fmt["tags"] += [dict(t, begin=t["begin"].removeprefix(CALL_OPEN + "\n"), end="}") for t in fmt["tags"]]
    return StructuredOutputsParams(structural_tag=json.dumps(tag))


def add_tools_to_messages(messages: list[dict[str, Any]], tools: list[ChatTool]) -> list[dict[str, Any]]:
    """For a template that ignores tools: the tools as a system message (merged into the first
    one if there is one), earlier tool calls written into their assistant turns' text."""
    out = [dict(m) for m in messages]
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            text = "\n".join(CALL_OPEN + "\n" + json.dumps({"name": c["function"]["name"],
                                                           "arguments": c["function"]["arguments"]},
                                                          ensure_ascii=False) + "\n" + CALL_CLOSE for c in calls)
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + text
    if not tools:
        return out
    listing = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    block = _SYSTEM_TOOLS.format(tools=listing)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{block}"
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ParserEvent:
    """One thing to stream: content text, a call's start (id, name) or argument text."""

    kind: str  # "content" | "call" | "arguments"
    index: int = 0
    text: str = ""
    call: Optional[ParsedCall] = None


@dataclass
class ToolCallParser:
    """Incremental Hermes tool-call parser; feed text deltas, then call finish()."""

    state: str = "text"  # "text" | "head" | "args"
    bare: bool = False  # the current call has no tags: it ends where its JSON object does
    buf: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    content: str = ""
    _sent_args: int = 0

    def feed(self, delta: str) -> list[ParserEvent]:
        self.buf += delta
        events: list[ParserEvent] = []
        while True:
            before = (self.state, len(self.buf))
            if self.state == "text":
                self._text(events, final=False)
            elif self.state == "head":
                self._head(events)
            else:
                self._args(events)
            if (self.state, len(self.buf)) == before:
                return events

    def finish(self) -> list[ParserEvent]:
        """The end of the text: what was held back, and an unterminated call as far as it goes."""
        events: list[ParserEvent] = []
        if self.state == "text":
            self._text(events, final=True)
        elif self.state == "head":  # never got as far as a name: it was text after all
            self._emit_content(events, ("" if self.bare else CALL_OPEN) + self.buf)
            self.buf = ""
        else:
            self._args_until(events, len(self.buf), final=True)
            self.buf = ""
        self.state = "text"
        return events

    # -- states ---------------------------------------------------------------------
    def _emit_content(self, events: list[ParserEvent], text: str) -> None:
        if not text:
            return
        if not self.content:
            text = text.lstrip("\n")  # the newline a model puts before a call, or at the start
            if not text:
                return
        self.content += text
        events.append(ParserEvent("content", text=text))

    def _text(self, events: list[ParserEvent], final: bool) -> None:
        found = _OPENERS.search(self.buf)
        if found is not None:
            self._emit_content(events, self.buf[:found.start()].rstrip())
            self.bare = found.group() != CALL_OPEN
            self.buf = self.buf[found.start() if self.bare else found.end():]
            self.state = "head"
            return
        if final:
            self._emit_content(events, self.buf.rstrip())
            self.buf = ""
            return
        # Hold back a possible start of an opener and the whitespace before it (dropped if a call follows).
        partial = max(_partial_suffix(self.buf, CALL_OPEN), _partial_suffix(self.buf, BARE_OPEN))
        if self.buf.rstrip().endswith("{"):  # '{' then whitespace may still become '{ "name":'
            partial = max(partial, len(self.buf) - len(self.buf.rstrip()) + 1)
        cut = len(self.buf[:len(self.buf) - partial].rstrip())
        if cut > 0:
            self._emit_content(events, self.buf[:cut])
            self.buf = self.buf[cut:]

    def _head(self, events: list[ParserEvent]) -> None:
        match = _HEAD.match(self.buf)
        if match is None:
            if self.bare:  # an object with a "name" but not a call's shape: parse it whole once complete
                try:
                    _, end = json.JSONDecoder().raw_decode(self.buf)
                except json.JSONDecodeError:
                    return
                self._whole_call(events, self.buf[:end])
                self.buf = self.buf[end:]
                self.state = "text"
                return
            close = self.buf.find(CALL_CLOSE)
            if close >= 0:  # a call in another shape (unconstrained output): parse it whole
                self._whole_call(events, self.buf[:close])
                self.buf = self.buf[close + len(CALL_CLOSE):]
                self.state = "text"
            return
        try:
            name = json.loads(f'"{match.group(1)}"')
        except json.JSONDecodeError:
            name = match.group(1)
        call = ParsedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name)
        self.calls.append(call)
        events.append(ParserEvent("call", index=len(self.calls) - 1, call=call))
        self.buf = self.buf[match.end():]
        self._sent_args = 0
        self.state = "args"

    def _args(self, events: list[ParserEvent]) -> None:
        if self.bare:  # ends with the object: arguments, then the call's own '}'
            end = _call_end(self.buf)
            if end is not None:
                self._args_until(events, end, final=True)
                self.buf = self.buf[end:]
                self.state = "text"
                return
        else:
            close = self.buf.find(CALL_CLOSE)
            if close >= 0:
                self._args_until(events, close, final=True)
                self.buf = self.buf[close + len(CALL_CLOSE):]
                self.state = "text"
                return
        # Safe to send: all but a possible start of the closing tag, trailing whitespace and a
        # last '}' (the call's own closing brace is the last one before the tag).
        text = self.buf[:len(self.buf) - _partial_suffix(self.buf, CALL_CLOSE)].rstrip()
        if text.endswith("}"):
            text = text[:-1].rstrip()
        self._args_until(events, len(text), final=False)

    def _args_until(self, events: list[ParserEvent], end: int, final: bool) -> None:
        text = self.buf[:end].rstrip()
        if final and text.endswith("}") and _is_json(text[:-1]):
            text = text[:-1].rstrip()
        new = text[self._sent_args:]
        if new:
            call = self.calls[-1]
            call.arguments += new
            self._sent_args = len(text)
            events.append(ParserEvent("arguments", index=len(self.calls) - 1, text=new))

    def _whole_call(self, events: list[ParserEvent], body: str) -> None:
        """A call in another shape: keys in another order, "parameters" for "arguments", or a
        list of calls in one tag (SmolLM2's own format); anything else stays text."""
        try:
            obj = json.loads(body)
            found = []
            for item in obj if isinstance(obj, list) and obj else [obj]:
                name = item["name"]
                args = item.get("arguments", item.get("parameters", {}))
                if not isinstance(name, str):
                    raise TypeError
                found.append((name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            self._emit_content(events, body if self.bare else CALL_OPEN + body + CALL_CLOSE)
            return
        for name, arguments in found:
            call = ParsedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=arguments)
            self.calls.append(call)
            index = len(self.calls) - 1
            events.append(ParserEvent("call", index=index, call=call))
            events.append(ParserEvent("arguments", index=index, text=call.arguments))


def _call_end(args_text: str) -> Optional[int]:
    """Where a tagless call ends (just past its closing '}'), once its arguments' JSON is complete."""
    start = len(args_text) - len(args_text.lstrip())
    try:
        _, end = json.JSONDecoder().raw_decode(args_text, start)
    except json.JSONDecodeError:
        return None
    rest = args_text[end:]
    brace = len(rest) - len(rest.lstrip())
    return end + brace + 1 if rest[brace:brace + 1] == "}" else None


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest end of `text` that is a proper start of `token`."""
    return next((k for k in range(min(len(token) - 1, len(text)), 0, -1) if token.startswith(text[-k:])), 0)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False
