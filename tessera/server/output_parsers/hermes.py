"""Hermes tool calls, as Qwen2.5 (and Hermes, Qwen3) write them:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Small Qwen2.5 models often write the same object without the tags; that is read (and, in
"auto", allowed by the grammar) too. Objects in other shapes inside the tags (keys in another
order, "parameters" for "arguments", a list of calls, SmolLM2's habit) are read once whole.
"""
from __future__ import annotations

import json
import re
from typing import Any

from tessera.server.output_parsers.base import json_text, partial_suffix
from tessera.server.output_parsers.json_calls import JsonCallParser, parse_call_objects

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
BARE_OPEN = '{"name": '
# The same object pretty-printed, as Qwen2.5-Coder writes it under a long agent prompt (often in
# a ```json fence): also a call's start, held to the tools' names and schemas like the others.
BARE_OPENS = (BARE_OPEN, '{\n  "name": ', '{\n    "name": ')
_OPENERS = re.compile(r'<tool_call>|\{\s*"name"\s*:')


class HermesToolParser(JsonCallParser):
    name = "hermes"
    instructions = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}}\n</tool_call>"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bare = False  # the current call has no tags: it ends where its JSON object does

    def hold_back(self, text: str) -> int:
        if text.rstrip().endswith("{"):  # '{' then whitespace may still become '{ "name":'
            return len(text) - len(text.rstrip()) + 1
        return partial_suffix(text, BARE_OPEN)

    def step(self, final: bool) -> bool:
        if self.state == "text":
            found = self.text_until(_OPENERS, final, (CALL_OPEN,))
            if found is None:
                return False
            self.bare = found.group() != CALL_OPEN
            self.buf = self.buf[found.start() if self.bare else found.end():]
            self.state, self.calls_here = "head", 0
            return True
        if self.state != "tail":
            return self.call_step(final)
        # after a call inside the tags: the closing tag, or another object in the same tag
        rest = self.buf.lstrip()
        if rest.startswith(CALL_CLOSE):
            self.buf, self.state = rest[len(CALL_CLOSE):], "text"
            return True
        if rest.startswith("{"):
            self.buf, self.state = rest, "head"
            return True
        close = rest.find(CALL_CLOSE)
        if close >= 0:  # stray text inside the tags after a call: dropped with them
            self.buf, self.state = rest[close + len(CALL_CLOSE):], "text"
            return True
        return False

    def odd_object(self, final: bool) -> bool:
        if self.bare:
            return super().odd_object(final)
        close = self.buf.find(CALL_CLOSE)
        if close < 0:  # a call in another shape (unconstrained output): read it whole at the tag's end
            return False
        body, self.buf, self.state = self.buf[:close], self.buf[close + len(CALL_CLOSE):], "text"
        found = parse_call_objects(body)
        if found is None:
            if self.calls_here == 0:  # not a call: it was text all along
                self.emit_content(CALL_OPEN + body + CALL_CLOSE)
            return True
        for name, arguments in found:
            self.whole_call(name, arguments)
        return True

    def after_call(self) -> None:
        self.state = "text" if self.bare else "tail"

    def end(self) -> None:
        if self.state == "head" and self.calls_here == 0:  # never got as far as a name: it was text
            self.emit_content((("" if self.bare else CALL_OPEN) + self.buf).rstrip())
        self.state = "text"

    @classmethod
    def call_format(cls, specs: list[dict[str, Any]], mode: str, parallel: bool) -> dict[str, Any]:
        import xgrammar as xgr

        from tessera.sampling_params import MAX_JSON_WHITESPACE

        xchoice: Any = {"auto": "auto", "required": "required"}.get(mode) or {
            "type": "function", "function": {"name": specs[0]["name"]}}
        tools = [{"type": "function", "function": s} for s in specs]
        tag = json.loads(xgr.get_model_structural_tag(
            "qwen_3", tools=tools, tool_choice=xchoice, reasoning="disabled", parallel_tool_calls=parallel,
            max_whitespace_cnt=MAX_JSON_WHITESPACE).model_dump_json())
        fmt = tag["format"]
        if mode == "auto" and fmt.get("type") == "triggered_tags":
            # Free text may also start a call without the tags ({"name": ...}), which small Qwen2.5
            # models write on their own; it is held to the same schemas.
            fmt["triggers"] += list(BARE_OPENS)
            tagged = list(fmt["tags"])
            for opener in BARE_OPENS:
                fmt["tags"] += [dict(t, begin=opener + t["begin"].removeprefix(CALL_OPEN + "\n" + BARE_OPEN), end="}")
                                for t in tagged]
        return fmt

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"{CALL_OPEN}\n{json_text({'name': c['name'], 'arguments': c['arguments']})}\n{CALL_CLOSE}"
                         for c in calls)
