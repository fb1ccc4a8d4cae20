"""Reasoning parsers: the `<think>...</think>` family (DeepSeek-R1 and its distills, Qwen3,
QwQ), whose reasoning is returned apart from the answer (`reasoning_content`); and gpt-oss's
harmony channels (`openai_gptoss`, in harmony.py), whose analysis channel is its reasoning.

A template may open the think block itself (DeepSeek-R1's distills, Qwen3's thinking
releases end the prompt with `<think>\\n`), so the output starts inside it: the parser is told
so by the prompt (`prompt_opens_think`). deepseek_r1 treats output as reasoning until
`</think>` unless the prompt closed an empty block (thinking switched off), as vLLM's parser of
that name does; qwen3 reads output without a `<think>` as the answer.
"""
from __future__ import annotations

from typing import ClassVar, Union

from tessera.server.output_parsers.base import ParserEvent, partial_suffix
from tessera.server.output_parsers.harmony import HarmonyReasoningParser

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_opens_think(prompt: str, opener: str = THINK_OPEN, closer: str = THINK_CLOSE) -> bool:
    """Whether the rendered prompt ends inside a think block its template opened."""
    at = prompt.rfind(opener)
    return at >= 0 and prompt.find(closer, at) < 0


def prompt_closes_think(prompt: str, closer: str = THINK_CLOSE) -> bool:
    """Whether the prompt ends with an empty think block already closed: the template's way of
    switching thinking off (Qwen3's enable_thinking=false), so the answer follows at once."""
    return prompt.rstrip().endswith(closer)


class ThinkReasoningParser:
    """Splits streamed text into reasoning (inside the think block) and content (after it)."""

    name: ClassVar[str] = "think"
    opener: ClassVar[str] = THINK_OPEN
    closer: ClassVar[str] = THINK_CLOSE
    # Output is reasoning until the closer even when neither prompt nor output opened the block.
    always_starts_inside: ClassVar[bool] = False
    keeps_special_tokens: ClassVar[bool] = False  # <think> is plain text in these vocabularies

    def __init__(self, prompt: str = "") -> None:
        inside = prompt_opens_think(prompt, self.opener, self.closer) or (
            self.always_starts_inside and not prompt_closes_think(prompt, self.closer))
        self.state = "inside" if inside else "start"
        self.at_start = True  # nothing of the block read yet: an opener written again is dropped
        self.buf = ""
        self.reasoning = ""
        self.content = ""
        self.after_close = False  # the whitespace after the closer is not part of the answer

    def feed(self, delta: str) -> list[ParserEvent]:
        self.buf += delta
        return self._run(final=False)

    def finish(self) -> list[ParserEvent]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[ParserEvent]:
        events: list[ParserEvent] = []
        while True:
            if self.state == "start":  # may open a block: leading whitespace, then the opener
                head = self.buf.lstrip()
                if head.startswith(self.opener):
                    self.buf, self.state = head[len(self.opener):], "inside"
                    continue
                if not final and self.opener.startswith(head):
                    return events
                self.state = "content"
                continue
            if self.state == "inside":
                if self.at_start:
                    head = self.buf.lstrip()
                    if head.startswith(self.opener):  # the template opened it and the model did too
                        self.buf = head[len(self.opener):]
                    elif not final and self.opener.startswith(head):
                        return events
                    self.at_start = False
                close = self.buf.find(self.closer)
                if close >= 0:
                    self._reason(events, self.buf[:close])
                    self.buf, self.state, self.after_close = self.buf[close + len(self.closer):], "content", True
                    continue
                keep = 0 if final else partial_suffix(self.buf, self.closer)
                self._reason(events, self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return events
            # content
            if self.after_close:
                self.buf = self.buf.lstrip()
                if not self.buf and not final:
                    return events
                self.after_close = False
            if self.buf:
                self.content += self.buf
                events.append(ParserEvent("content", text=self.buf))
                self.buf = ""
            return events

    def _reason(self, events: list[ParserEvent], text: str) -> None:
        if text:
            self.reasoning += text
            events.append(ParserEvent("reasoning", text=text))


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    always_starts_inside = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"


ReasoningParser = Union[ThinkReasoningParser, HarmonyReasoningParser]
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, HarmonyReasoningParser)}
