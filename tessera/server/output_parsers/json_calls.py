"""What the JSON call syntaxes share (hermes, llama3_json, mistral): a call is an object
`{"name": ..., "arguments" | "parameters": {...}}`; its name is known once the head has come,
and its arguments stream as they arrive, up to where their JSON value ends (`JsonScanner`),
so the argument deltas are exactly the text of the value the model wrote.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from tessera.server.output_parsers.base import JsonScanner, ToolParser, json_text

# The head of a call, up to where the arguments' JSON starts (and something of it has come).
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)', re.S)


def json_string(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw


def parse_call_objects(body: str) -> Optional[list[tuple[str, str]]]:
    """(name, arguments JSON) of a call object or a list of them in any key order; None if the
    text is not that."""
    try:
        obj = json.loads(body)
        found = []
        for item in obj if isinstance(obj, list) and obj else [obj]:
            name = item["name"]
            args = item.get("arguments", item.get("parameters", {}))
            if not isinstance(name, str):
                return None
            found.append((name, args if isinstance(args, str) else json_text(args)))
        return found
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None


class JsonCallParser(ToolParser):
    """The states of one call object: "head" (until the name and the start of the arguments),
    "args" (streamed to the value's end), "rest" (the object's other keys, up to its '}');
    then `after_call()` says what comes next in this syntax."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = "text"
        self.scanner = JsonScanner()
        self.calls_here = 0  # calls read since the current region (tag, list) opened
        self.wrapped = True  # the arguments are a key of a call object (whose '}' follows them)

    def call_step(self, final: bool) -> bool:
        if self.state == "head":
            match = HEAD.match(self.buf)
            if match is not None:
                self.start_call(json_string(match.group(1)))
                self.buf = self.buf[match.end():]
                self.scanner, self.state, self.wrapped = JsonScanner(), "args", True
                self.calls_here += 1
                return True
            return self.odd_object(final)
        if self.state == "args":
            end = self.scanner.end(self.buf)
            cut = len(self.buf) if end is None else end
            self.emit_args(self.buf[:cut])
            self.buf = self.buf[cut:]
            self.scanner.pos = 0  # it has read all that is left of buf
            if end is None:
                return False
            if self.wrapped:
                self.state, self.scanner = "rest", JsonScanner(depth=1)
            else:
                self.after_call()
            return True
        assert self.state == "rest"
        end = self.scanner.end(self.buf)
        if end is None:
            return False
        self.buf = self.buf[end:]
        self.after_call()
        return True

    def odd_object(self, final: bool) -> bool:
        """An object that is not in a call's head shape (keys in another order, a name that is not
        a string): read it whole once complete; if it is no call, it was text."""
        try:
            _, end = json.JSONDecoder().raw_decode(self.buf.lstrip())
        except json.JSONDecodeError:
            return False
        end += len(self.buf) - len(self.buf.lstrip())
        body, self.buf = self.buf[:end], self.buf[end:]
        found = parse_call_objects(body)
        if found is None:
            self.emit_content(body.strip())
            self.state = "text"
            return True
        for name, arguments in found:
            self.whole_call(name, arguments)
        self.calls_here += len(found)
        self.after_call()
        return True

    def after_call(self) -> None:
        self.state = "text"

    @staticmethod
    def json_call_tags(specs: list[dict[str, Any]], begin: str, end: str,
                       key: str = "arguments") -> list[dict[str, Any]]:
        """One structural tag per tool: `begin{"name": "f", "<key>": ` + its schema + `}end`."""
        from tessera.sampling_params import MAX_JSON_WHITESPACE

        return [{"type": "tag", "begin": f'{begin}{{"name": {json_text(s["name"])}, "{key}": ',
                 "content": {"type": "json_schema", "json_schema": s["parameters"],
                             "max_whitespace_cnt": MAX_JSON_WHITESPACE},
                 "end": "}" + end} for s in specs]
