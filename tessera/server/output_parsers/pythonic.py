"""Python-style tool calls (vLLM's `pythonic`): a list of calls with keyword arguments, as
Llama 3.2/4 and ToolACE write them, optionally inside Llama 4's `<|python_start|>`/`<|python_end|>`:

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

Arguments are Python literals, streamed as JSON one argument at a time as each completes. The
grammar writes them as Python literals too (True, False, None), each valid for its schema.
"""
from __future__ import annotations

import ast
import functools
import json
import re
from typing import Any, Optional

from tessera.server.output_parsers.base import ToolParser, json_text, partial_suffix

PY_START = "<|python_start|>"
PY_END = "<|python_end|>"
_OPENERS = re.compile(r"<\|python_start\|>|\[\s*[A-Za-z_][\w.\-]*\s*\(")
_MAYBE_OPEN = re.compile(r"\[\s*(?:[A-Za-z_][\w.\-]*\s*)?$")
_CALL = re.compile(r"([A-Za-z_][\w.\-]*)\s*\(")
_KEYWORD = re.compile(r"([A-Za-z_]\w*)\s*=(?!=)")
_JSON_NAMES = {"true": True, "false": False, "null": None}


def python_value(text: str) -> Any:
    """A literal as the model wrote it, as a JSON-able value (JSON's own names accepted too)."""
    for read in (ast.literal_eval, json.loads):
        try:
            value = read(text)
            json.dumps(value)
            return value
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return _JSON_NAMES.get(text, text)


def literal_end(text: str) -> Optional[int]:
    """Where a Python literal ends: the first ',' or ')' outside brackets and strings."""
    depth, quote, escape = 0, "", False
    for i, ch in enumerate(text):
        if quote:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in "}]" or (ch == ")" and depth > 0):
            depth -= 1
        elif ch in ",)" and depth == 0:
            return i
    return None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    instructions = (
        "You have access to the following functions:\n{tools}\n\nTo call functions, reply with nothing but "
        "a Python list of calls with keyword arguments: [func_name1(params_name1=params_value1, "
        "params_name2=params_value2...), func_name2(params)]"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = "text"  # text | list | call | arg | sep | close
        self.nargs = 0
        self.key = ""

    def hold_back(self, text: str) -> int:
        found = _MAYBE_OPEN.search(text)
        return len(text) - found.start() if found else partial_suffix(text, PY_START)

    def step(self, final: bool) -> bool:
        if self.state == "text":
            found = self.text_until(_OPENERS, final)
            if found is None:
                return False
            tagged = found.group() == PY_START
            self.buf = self.buf[found.end():] if tagged else self.buf[found.start() + 1:]
            self.state = "list" if tagged else "call"
            return True
        rest = self.buf.lstrip()
        if not rest and not final:
            return False
        if self.state == "list":  # after <|python_start|>: the list
            self.buf, self.state = (rest[1:], "call") if rest.startswith("[") else (rest, "text")
            return True
        if self.state == "call":
            match = _CALL.match(rest)
            if match is not None:
                self.start_call(match.group(1))
                self.buf, self.state, self.nargs = rest[match.end():], "arg", 0
                return True
            if not final and re.fullmatch(r"[A-Za-z_][\w.\-]*\s*", rest):
                return False
            self.buf, self.state = rest, "text"  # not a call after all
            return True
        if self.state == "arg":  # a keyword argument, or the call's ')'
            if rest.startswith(")"):
                self.emit_args("}" if self.nargs else "{}")
                self.buf, self.state = rest[1:], "sep"
                return True
            match = _KEYWORD.match(rest)
            if match is None and not final and re.fullmatch(r"[A-Za-z_]\w*\s*", rest):
                return False
            self.key = match.group(1) if match else str(self.nargs)  # positional: numbered
            value = rest[match.end():] if match else rest
            end = literal_end(value)
            if end is None:
                return False
            self.emit_args(("{" if self.nargs == 0 else ", ")
                           + f"{json_text(self.key)}: {json_text(python_value(value[:end].strip()))}")
            self.nargs += 1
            self.buf = value[end + 1:] if value[end] == "," else value[end:]
            return True
        if self.state == "sep":  # after a call: ',' and the next, or the list's ']'
            if rest.startswith(","):
                self.buf, self.state = rest[1:], "call"
            elif rest.startswith("]"):
                self.buf, self.state = rest[1:], "close"
            else:
                self.buf, self.state = rest, "text"
            return True
        # close: Llama 4's end marker, if it wrote one
        if not final and PY_END.startswith(rest):
            return False
        self.buf, self.state = rest.removeprefix(PY_END), "text"
        return True

    def end(self) -> None:
        if self.state == "arg":  # cut short: the arguments that completed, as valid JSON
            self.emit_args("}" if self.nargs else "{}")
        self.state = "text"

    # -- grammar ------------------------------------------------------------------------
    @classmethod
    def call_format(cls, specs: list[dict[str, Any]], mode: str, parallel: bool) -> dict[str, Any]:
        def call(spec: dict[str, Any]) -> list[dict[str, Any]]:
            return [_const(f"{spec['name']}("), _arguments(spec["parameters"]), _const(")")]

        more: list[dict[str, Any]] = []
        if parallel:
            anyone = {"type": "or", "elements": [{"type": "sequence", "elements": call(s)} for s in specs]}
            more = [{"type": "star", "content": {"type": "sequence", "elements": [_const(", "), anyone]}}]
        if mode == "named":
            return {"type": "sequence", "elements": [_const("["), *call(specs[0]), _const("]")]}
        tags = [{"type": "tag", "begin": f"[{s['name']}(",
                 "content": {"type": "sequence", "elements": [_arguments(s["parameters"]), _const(")"), *more]},
                 "end": "]"} for s in specs]
        return {"type": "triggered_tags", "triggers": [t["begin"] for t in tags], "tags": tags,
                "at_least_one": mode == "required", "stop_after_first": True}

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        args = [", ".join(f"{k}={v!r}" for k, v in (c["arguments"] if isinstance(c["arguments"], dict)
                                                             else {}).items()) for c in calls]
        return "[" + ", ".join(f"{c['name']}({a})" for c, a in zip(calls, args)) + "]"


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


@functools.lru_cache(maxsize=256)
def _python_value_grammar(schema_json: str) -> str:
    """EBNF of a schema's values written as Python literals: xgrammar's JSON grammar with
    Python's True/False/None, and a string allowed to end before the call's ')' (the JSON
    grammar looks ahead for one of ,}]: after a closing quote)."""
    import xgrammar as xgr

    from tessera.sampling_params import MAX_JSON_WHITESPACE

    text = str(xgr.Grammar.from_json_schema(schema_json, max_whitespace_cnt=MAX_JSON_WHITESPACE))
    for name, py in (('"true"', '"True"'), ('"false"', '"False"'), ('"null"', '"None"'), ("[,}\\]:]", "[,}\\]:)]")):
        text = text.replace(name, py)
    return text


def _value(schema: Any) -> dict[str, Any]:
    return {"type": "grammar", "grammar": _python_value_grammar(json.dumps(schema if schema is not None else {},
                                                                           sort_keys=True))}


def _arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments valid for an object schema: the required ones in order, then any of the
    optional ones, in declared order; any keywords when it names no properties."""
    props = schema.get("properties") or {}
    if not props:
        keyword = {"type": "sequence", "elements": [{"type": "regex", "pattern": r"[A-Za-z_][A-Za-z0-9_]*="},
                                                    _value({})]}
        return {"type": "optional", "content": {"type": "sequence", "elements": [
            keyword, {"type": "star", "content": {"type": "sequence", "elements": [_const(", "), keyword]}}]}}
    required = [k for k in props if k in set(schema.get("required") or [])]
    optional = [k for k in props if k not in required]

    def kw(key: str, comma: bool) -> list[dict[str, Any]]:
        return [_const((", " if comma else "") + f"{key}="), _value(props[key])]

    def tail(keys: list[str]) -> list[dict[str, Any]]:  # each optional one may follow, with its comma
        return [{"type": "optional", "content": {"type": "sequence", "elements": kw(k, True)}} for k in keys]

    if required:
        elements = [e for i, k in enumerate(required) for e in kw(k, i > 0)] + tail(optional)
        return {"type": "sequence", "elements": elements}
    firsts = [{"type": "sequence", "elements": kw(k, False) + tail(optional[i + 1:])} for i, k in enumerate(optional)]
    return {"type": "optional", "content": {"type": "or", "elements": firsts}}
