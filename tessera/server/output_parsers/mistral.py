"""Mistral tool calls (vLLM's `mistral`): `[TOOL_CALLS]` (a special token of Mistral's
vocabulary, so detokenizing keeps special tokens) then a JSON list of call objects, as
Mistral 7B v0.3, Mixtral, Nemo and Small 3 write them,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ..., ...}]

or, from tokenizer v11 on (Small 3.2, Magistral, Devstral), one marker per call with the
name before `[ARGS]`: `[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`.
"""
from __future__ import annotations

import re
from typing import Any

from tessera.server.output_parsers.base import JsonScanner, json_text
from tessera.server.output_parsers.json_calls import JsonCallParser

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_OPENER = re.compile(re.escape(TOOL_CALLS))
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\[ARGS\]")


class MistralToolParser(JsonCallParser):
    name = "mistral"
    keeps_special_tokens = True
    instructions = (
        "You can call the following functions:\n{tools}\n\nTo call functions, answer with [TOOL_CALLS] "
        'followed by a JSON list of calls: [TOOL_CALLS][{{"name": <function-name>, "arguments": '
        "<args-json-object>}}]"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_list = False

    def step(self, final: bool) -> bool:
        if self.state == "text":
            found = self.text_until(_OPENER, final, (TOOL_CALLS,))
            if found is None:
                return False
            self.buf, self.state, self.in_list = self.buf[found.end():], "open", False
            return True
        if self.state == "open":  # after the marker: a list, one object, or name[ARGS]
            rest = self.buf.lstrip()
            named = _NAMED.match(rest)
            if rest.startswith("["):
                self.buf, self.state, self.in_list = rest[1:], "next", True
            elif rest.startswith("{"):
                self.buf, self.state = rest, "head"
            elif named is not None:
                self.start_call(named.group(1))  # the arguments are not inside a call object
                self.buf, self.state, self.scanner, self.wrapped = rest[named.end():], "args", JsonScanner(), False
            elif not final and re.fullmatch(r"[A-Za-z0-9_.\-]*(\[(A(R(GS?)?)?)?)?", rest):
                return False
            else:  # a marker with no call after it
                self.state = "text"
            return True
        if self.state in ("next", "sep"):  # in the list: an object; after one: ',' or ']'
            rest = self.buf.lstrip()
            if not rest and not final:
                return False
            if self.state == "next" and rest.startswith("{"):
                self.buf, self.state = rest, "head"
            elif self.state == "sep" and rest.startswith(","):
                self.buf, self.state = rest[1:], "next"
            elif rest.startswith("]"):
                self.buf, self.state = rest[1:], "text"
            else:
                self.buf, self.state = rest, "text"
            return True
        return self.call_step(final)

    def after_call(self) -> None:
        self.state = "sep" if self.in_list else "text"

    def end(self) -> None:
        if self.state == "head":
            self.emit_content(self.buf.strip())
        self.state = "text"

    @classmethod
    def call_format(cls, specs: list[dict[str, Any]], mode: str, parallel: bool) -> dict[str, Any]:
        tags = cls.json_call_tags(specs, "", "")
        if mode == "named":
            return {"type": "sequence", "elements": [{"type": "const_string", "value": TOOL_CALLS + "["}, tags[0],
                                                     {"type": "const_string", "value": "]"}]}
        calls = {"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True,
                 "stop_after_first": not parallel}
        block = {"type": "tag", "begin": TOOL_CALLS + "[", "content": calls, "end": "]"}
        return {"type": "triggered_tags", "triggers": [TOOL_CALLS], "tags": [block],
                "at_least_one": mode == "required", "stop_after_first": True}

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        return TOOL_CALLS + json_text([{"name": c["name"], "arguments": c["arguments"]} for c in calls])
