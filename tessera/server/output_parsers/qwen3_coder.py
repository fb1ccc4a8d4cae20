"""Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder`; also Qwen3.5):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are untyped text, so the tool's schema says what each one is: a string stays the text
(one newline trimmed each side, as the model frames it), anything else is read as JSON (then
as a Python literal). The arguments stream as JSON, one parameter at a time as each closes.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from tessera.server.output_parsers.base import ToolParser, json_text

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
FUNCTION_CLOSE = "</function>"
PARAMETER_CLOSE = "</parameter>"
_OPENERS = re.compile(r"<tool_call>|<function=")
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
# Where a value ends: its closing tag, or (a model that forgot it) the next parameter or the function's end.
_VALUE_END = re.compile(r"</parameter>|\n<parameter=|\n</function>")


def value_types(schema: dict[str, Any]) -> list[str]:
    kind = schema.get("type")
    if kind is None and isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return ["string"]
    if kind is None:
        kinds = [value_types(s) for s in schema.get("anyOf", schema.get("oneOf", [])) if isinstance(s, dict)]
        return [k for ks in kinds for k in ks]
    return [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)]


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", dict: "object", list: "array"}.get(type(value), "null")


def convert_value(raw: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as the JSON value its schema says it is."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    kinds = value_types(schema)
    if kinds and set(kinds) <= {"string"}:
        return text
    stripped = text.strip()
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(stripped)
            json.dumps(value)
            break
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    else:
        return text
    kind = _json_type(value)
    if "string" in kinds and kind not in kinds and not (kind == "integer" and "number" in kinds):
        return text  # e.g. a zip code the schema calls a string or an integer
    return value


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    instructions = (
        "# Tools\n\nYou have access to the following functions:\n\n<tools>\n{tools}\n</tools>\n\n"
        "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
        "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
        "</function>\n</tool_call>"
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = "text"  # text | function | params | value | tail
        self.key = ""
        self.params = 0  # parameters sent of the current call

    def step(self, final: bool) -> bool:
        if self.state == "text":
            found = self.text_until(_OPENERS, final, (CALL_OPEN, "<function="))
            if found is None:
                return False
            self.buf = self.buf[found.end() if found.group() == CALL_OPEN else found.start():]
            self.state = "function"
            return True
        rest = self.buf.lstrip()
        if self.state == "function":
            match = _FUNCTION.match(rest)
            if match is not None:
                self.start_call(match.group(1).strip())
                self.buf, self.state, self.params = rest[match.end():], "params", 0
                return True
            if not final and ("<function=".startswith(rest) or (rest.startswith("<function=") and ">" not in rest
                                                                 and "\n" not in rest)):
                return False
            self.emit_content((CALL_OPEN + "\n" + rest).rstrip())  # a tag with no function: text after all
            self.buf, self.state = "", "text"
            return True
        if self.state == "params":
            match = _PARAMETER.match(rest)
            if match is not None:
                self.key = match.group(1).strip()
                self.buf, self.state = rest[match.end():], "value"
                return True
            if rest.startswith(FUNCTION_CLOSE):
                self._close_args()
                self.buf, self.state = rest[len(FUNCTION_CLOSE):], "tail"
                return True
            if not rest or (not final and ("<parameter=".startswith(rest) or FUNCTION_CLOSE.startswith(rest)
                                           or (rest.startswith("<parameter=") and ">" not in rest))):
                return False
            skip = rest.find("<", 1)  # stray text between parameters
            self.buf = rest[skip:] if skip > 0 else ""
            return skip > 0
        if self.state == "value":
            end = _VALUE_END.search(self.buf)
            if end is None:
                return False
            self._param(self.buf[:end.start()])
            self.buf = self.buf[end.end() if end.group() == PARAMETER_CLOSE else end.start():]
            self.state = "params"
            return True
        # tail: after </function>, the closing tag
        if rest.startswith(CALL_CLOSE):
            self.buf, self.state = rest[len(CALL_CLOSE):], "text"
            return True
        if not final and CALL_CLOSE.startswith(rest):
            return False
        self.buf, self.state = rest, "text"
        return True

    def _param(self, raw: str) -> None:
        schema = self.schemas.get(self.calls[-1].name, {}).get("properties", {}).get(self.key, {})
        value = convert_value(raw, schema if isinstance(schema, dict) else {})
        self.emit_args(("{" if self.params == 0 else ", ") + f"{json_text(self.key)}: {json_text(value)}")
        self.params += 1

    def _close_args(self) -> None:
        self.emit_args("}" if self.params else "{}")

    def end(self) -> None:
        """A call cut short (max_tokens) keeps the parameters that closed, as valid JSON."""
        if self.state in ("params", "value"):
            self._close_args()
        self.state = "text"

    @classmethod
    def call_format(cls, specs: list[dict[str, Any]], mode: str, parallel: bool) -> dict[str, Any]:
        import xgrammar as xgr

        from tessera.sampling_params import MAX_JSON_WHITESPACE

        xchoice: Any = {"auto": "auto", "required": "required"}.get(mode) or {
            "type": "function", "function": {"name": specs[0]["name"]}}
        tag = xgr.get_model_structural_tag(
            "qwen_3_coder", tools=[{"type": "function", "function": s} for s in specs], tool_choice=xchoice,
            reasoning="disabled", parallel_tool_calls=parallel, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        return json.loads(tag.model_dump_json())["format"]

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        out = []
        for c in calls:
            args = c["arguments"] if isinstance(c["arguments"], dict) else {}
            params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json_text(v)}\n</parameter>\n"
                             for k, v in args.items())
            out.append(f"{CALL_OPEN}\n<function={c['name']}>\n{params}{FUNCTION_CLOSE}\n{CALL_CLOSE}")
        return "\n".join(out)

