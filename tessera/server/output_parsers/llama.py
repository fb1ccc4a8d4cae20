"""Llama 3.1/3.2/3.3 JSON tool calls (vLLM's `llama3_json`): a bare object per call, the
arguments under "parameters", several calls separated by ';', optionally after Llama's
`<|python_tag|>`:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}
"""
from __future__ import annotations

import re
from typing import Any

from tessera.server.output_parsers.base import json_text, partial_suffix
from tessera.server.output_parsers.json_calls import JsonCallParser

PYTHON_TAG = "<|python_tag|>"
BARE_OPEN = '{"name": '
_OPENERS = re.compile(r'<\|python_tag\|>|\{\s*"name"\s*:')


class Llama3JsonToolParser(JsonCallParser):
    name = "llama3_json"
    instructions = (
        "Given the following functions, please respond with a JSON for a function call with its proper "
        "arguments that best answers the given prompt.\n\nRespond in the format "
        '{{"name": function name, "parameters": dictionary of argument name and its value}}. '
        "Do not use variables.\n\n{tools}"
    )

    def hold_back(self, text: str) -> int:
        if text.rstrip().endswith("{"):
            return len(text) - len(text.rstrip()) + 1
        return partial_suffix(text, BARE_OPEN)

    def step(self, final: bool) -> bool:
        if self.state == "text":
            found = self.text_until(_OPENERS, final, (PYTHON_TAG,))
            if found is None:
                return False
            tagged = found.group() == PYTHON_TAG
            self.buf = self.buf[found.end() if tagged else found.start():]
            self.state = "next" if tagged else "head"
            return True
        if self.state in ("next", "sep"):  # after the tag or a ';': another object; after a call: ';'
            rest = self.buf.lstrip()
            if not rest and not final:
                return False
            if self.state == "next" and rest.startswith("{"):
                self.buf, self.state = rest, "head"
            elif self.state == "sep" and rest.startswith(";"):
                self.buf, self.state = rest[1:], "next"
            else:
                self.state = "text"
            return True
        return self.call_step(final)

    def after_call(self) -> None:
        self.state = "sep"

    def end(self) -> None:
        if self.state == "head":  # never got as far as a name: it was text
            self.emit_content(self.buf.strip())
        self.state = "text"

    @classmethod
    def call_format(cls, specs: list[dict[str, Any]], mode: str, parallel: bool) -> dict[str, Any]:
        tags = cls.json_call_tags(specs, "", "", key="parameters")
        if mode == "named":
            return tags[0]
        return {"type": "triggered_tags", "triggers": [BARE_OPEN], "tags": tags, "at_least_one": mode == "required",
                "stop_after_first": not parallel}

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        return "; ".join(json_text({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
