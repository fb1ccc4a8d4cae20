"""OpenAI's harmony format (gpt-oss): the answer is a sequence of messages, each with a channel,

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

the analysis channel is the reasoning, final the answer, a message with a recipient
`to=functions.NAME` (before or after the channel) a call of NAME with its JSON as the body, and
commentary without one a preamble the user sees (content). The template's generation prompt ends
with `<|start|>assistant`, so the first header starts at its channel; a model that leaves out
`<|start|>assistant` before a later message is read the same. <|return|> and <|call|> end the
output (both are stop tokens), <|end|> only the message.

The markers are special tokens, so the detokenizer keeps them for these parsers
(`keeps_special_tokens`). vLLM's names: reasoning parser `openai_gptoss`, tool parser `openai`;
both are this reader, which splits reasoning, content and calls at once (`output_parser`).
"""
from __future__ import annotations

import json
import re
from typing import Any, ClassVar, Optional, Sequence

from tessera.server.output_parsers.base import ParserEvent, ToolParser, json_text, partial_suffix

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
END_OF_TEXT = "<|endoftext|>"
# A message's body ends at one of these (consumed), or where the next header starts (kept).
BODY_ENDS = (END, CALL, RETURN, END_OF_TEXT)
NEXT_HEADER = (START, CHANNEL)
# What a header may start with; other text where a header was due is content as it stands.
HEADER_OPENERS = (START, CHANNEL, "to=", "assistant")
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


class HarmonyToolParser(ToolParser):
    """Reads harmony messages as they stream: each message's header (up to <|message|>) says
    what its body is, and the body streams as reasoning, content or a call's arguments.

    `reasoning` False (reasoning parser "none") leaves the analysis channel in the content;
    `calls` False (no tools offered) drops messages to functions, as it drops messages to
    tools the server does not run (the built-in browser and python)."""

    name = "openai"
    keeps_special_tokens = True

    def __init__(self, tools: Sequence[Any] = (), *, reasoning: bool = True, calls: bool = True) -> None:
        super().__init__(tools)
        self.separate_reasoning = reasoning
        self.parse_calls = calls
        self.state = "header"  # "header" | "body" | "done"
        self.kind = "content"  # the current body: "content" | "reasoning" | "call" | "drop"
        self.fresh = True  # nothing of the current body sent yet

    # -- reading ------------------------------------------------------------------------
    def step(self, final: bool) -> bool:
        if self.state == "done":
            self.buf = ""
            return False
        if self.state == "header":
            return self._header(final)
        return self._body(final)

    def _header(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if not head:
            return False
        if not head.startswith(HEADER_OPENERS):
            if not final and any(o.startswith(head) for o in HEADER_OPENERS):
                return False
            self._open("content")  # no header: plain text, read as the answer
            return True
        at = self.buf.find(MESSAGE)
        if at < 0:
            if final and "<|" not in head:  # "assistant ..." or "to=..." that never became a header
                self._open("content")
                return True
            return False
        header, self.buf = self.buf[:at], self.buf[at + len(MESSAGE):]
        self._open(self._kind_of(header))
        return True

    def _kind_of(self, header: str) -> str:
        recipient = _RECIPIENT.search(header)
        target = recipient.group(1) if recipient is not None else "assistant"
        if target != "assistant":
            if not (self.parse_calls and target.startswith(FUNCTIONS)):
                return "drop"
            self.start_call(target[len(FUNCTIONS):])
            return "call"
        # The last channel named: gpt-oss-20b sometimes writes a stray "<|channel|>commentary" first.
        channels = _CHANNEL_NAME.findall(header)
        if channels and channels[-1] == "analysis" and self.separate_reasoning:
            return "reasoning"
        return "content"

    def _open(self, kind: str) -> None:
        self.state, self.kind, self.fresh = "body", kind, True

    def _body(self, final: bool) -> bool:
        ends = [(self.buf.find(m), m) for m in BODY_ENDS + NEXT_HEADER]
        found = min(((at, m) for at, m in ends if at >= 0), default=None)
        if found is not None:
            at, marker = found
            self._send(self.buf[:at])
            self._close()
            self.buf = self.buf[at + (len(marker) if marker in BODY_ENDS else 0):]
            self.state = "done" if marker in (RETURN, END_OF_TEXT) else "header"
            return True
        keep = 0 if final else max(partial_suffix(self.buf, m) for m in BODY_ENDS + NEXT_HEADER)
        self._send(self.buf[:len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _send(self, text: str) -> None:
        if not text or self.kind == "drop":
            return
        if self.kind == "call":
            self.emit_args(text)
        elif self.kind == "reasoning":
            if self.fresh and self.reasoning:
                text = "\n" + text  # one analysis message after another
            self.reasoning += text
            self._events.append(ParserEvent("reasoning", text=text))
        else:
            self.emit_content("\n\n" + text if self.fresh and self.content else text)
        self.fresh = False

    def _close(self) -> None:
        """A call's message ended: one that had no body still has arguments, an empty object."""
        if self.kind == "call" and self.fresh:
            self.emit_args("{}")
        self.kind = "content"

    def end(self) -> None:
        if self.state == "body":
            self._close()
        self.state = "done"

    # -- grammar and prompt side ----------------------------------------------------------
    @classmethod
    def call_format(cls, specs: list[dict[str, Any]], mode: str, parallel: bool) -> dict[str, Any]:
        """xgrammar's own harmony format: analysis and final messages, and calls through the
        commentary channel held to the tools' schemas, between `<|start|>assistant` headers."""
        import xgrammar as xgr

        from tessera.sampling_params import MAX_JSON_WHITESPACE

        xchoice: Any = {"auto": "auto", "required": "required"}.get(mode) or {
            "type": "function", "function": {"name": specs[0]["name"]}}
        tools = [{"type": "function", "function": s} for s in specs]
        tag = xgr.get_model_structural_tag("harmony", tools=tools, tool_choice=xchoice, reasoning="enabled",
                                           parallel_tool_calls=parallel, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        return json.loads(tag.model_dump_json())["format"]

    @classmethod
    def render_calls(cls, calls: list[dict[str, Any]]) -> str:
        return "".join(f"{START}assistant to={FUNCTIONS}{c['name']}{CHANNEL}commentary json{MESSAGE}"
                       f"{json_text(c['arguments'])}{CALL}" for c in calls)


class HarmonyReasoningParser(HarmonyToolParser):
    """The harmony reader as a reasoning parser (`--reasoning-parser openai_gptoss`): analysis to
    reasoning, final and commentary to content, for a request without tools."""

    name: ClassVar[str] = "openai_gptoss"  # type: ignore[misc]

    def __init__(self, prompt: str = "") -> None:
        super().__init__((), reasoning=True, calls=False)


def is_harmony_template(chat_template: Optional[str]) -> bool:
    """A chat template in the harmony format (gpt-oss's): messages carry channels."""
    return CHANNEL in (chat_template or "")
