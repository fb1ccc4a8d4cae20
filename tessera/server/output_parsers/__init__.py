"""Reading what a model wrote: its reasoning, its answer and its tool calls, in the syntax of
its family. One interface for every API (chat completions, Responses, Messages):

    settings = route.model.output_parsing            # OutputParsing, per served model
    parser = output_parser(settings, parse_tools, tools=tools, prompt=prompt_text)
    for delta in deltas: events = parser.feed(delta)  # ParserEvent: content / reasoning / call / args
    events += parser.finish()
    parser.calls, parser.reasoning, parser.content

Tool-call parsers carry vLLM's names (`--tool-call-parser`); without the flag the parser is
detected from the chat template. Reasoning parsers (`--reasoning-parser`) are the think family
and gpt-oss's harmony channels, detected the same way (`none` turns them off). A harmony
template (one with `<|channel|>`) gets both harmony parsers, `openai_gptoss` and `openai`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from tessera.errors import ConfigError
from tessera.server.output_parsers.base import (
    OutputParser, ParsedCall, ParserEvent, ToolParser, new_call, partial_suffix,
)
from tessera.server.output_parsers.harmony import HarmonyReasoningParser, HarmonyToolParser, is_harmony_template
from tessera.server.output_parsers.hermes import HermesToolParser
from tessera.server.output_parsers.llama import Llama3JsonToolParser
from tessera.server.output_parsers.mistral import MistralToolParser
from tessera.server.output_parsers.pythonic import PythonicToolParser
from tessera.server.output_parsers.qwen3_coder import Qwen3CoderToolParser
from tessera.server.output_parsers.reasoning import (
    REASONING_PARSERS, ReasoningParser, ThinkReasoningParser, prompt_closes_think, prompt_opens_think,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HarmonyToolParser, HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser,
    Qwen3CoderToolParser)}
DEFAULT_TOOL_PARSER = "hermes"


def detect_tool_parser(chat_template: Optional[str]) -> str:
    """The tool-call syntax a chat template teaches its model (hermes when it shows none)."""
    template = chat_template or ""
    if is_harmony_template(template):  # gpt-oss: its calls are messages to functions.NAME
        return HarmonyToolParser.name
    for marker, name in (("<function=", "qwen3_coder"), ("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                         ("[func_name1(", "pythonic"), ("<|python_tag|>", "llama3_json"),
                         ('"parameters": dictionary of argument name', "llama3_json")):
        if marker in template and name in TOOL_PARSERS:
            return name
    return DEFAULT_TOOL_PARSER


NO_REASONING_PARSER = "none"


def detect_reasoning_parser(chat_template: Optional[str]) -> str:
    """The reasoning reader a chat template's model needs: openai_gptoss for a harmony template
    (gpt-oss's channels), qwen3 for a template with Qwen3's `enable_thinking` switch,
    deepseek_r1 for one that opens a think block itself (R1's distills), none otherwise
    (llama.cpp server separates reasoning by default the same way)."""
    template = chat_template or ""
    if is_harmony_template(template):
        return HarmonyReasoningParser.name
    if "enable_thinking" in template and "<think>" in template:
        return "qwen3"
    if "<think>" in template:
        return "deepseek_r1"
    return NO_REASONING_PARSER


@dataclass(frozen=True)
class OutputParsing:
    """How one served model's output is read, and the template its prompts are rendered with.

    `tool_call_parser` and `reasoning_parser` None mean "detect from the chat template" (`resolved`
    fills them in once the template is known; reasoning "none" leaves a think block in the
    content); `chat_template` is a template text that overrides the model's own.
    """

    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    chat_template: Optional[str] = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, "
                              f"not {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, NO_REASONING_PARSER, *REASONING_PARSERS):
            raise ConfigError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)} or "
                              f"{NO_REASONING_PARSER}, not {self.reasoning_parser!r}")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ConfigError("--chat-template must not be empty")

    def template(self, model_template: Optional[str]) -> Optional[str]:
        """The template prompts are rendered with: the override, else the model's."""
        return self.chat_template or model_template

    def resolved(self, model_template: Optional[str]) -> "OutputParsing":
        """These settings with the tool-call and reasoning parsers named (detected from the template
        where unset)."""
        template = self.template(model_template)
        return replace(self, tool_call_parser=self.tool_call_parser or detect_tool_parser(template),
                       reasoning_parser=self.reasoning_parser or detect_reasoning_parser(template))

    @property
    def tool_parser(self) -> type[ToolParser]:
        return TOOL_PARSERS[self.tool_call_parser or DEFAULT_TOOL_PARSER]

    @property
    def reasoning(self) -> Optional[type[ReasoningParser]]:
        return REASONING_PARSERS.get(self.reasoning_parser or NO_REASONING_PARSER)

    @property
    def harmony(self) -> bool:
        """Whether output is read as harmony messages (either parser is harmony's)."""
        return self.tool_call_parser == HarmonyToolParser.name or self.reasoning is HarmonyReasoningParser

    def keeps_special_tokens(self, parse_tools: bool) -> bool:
        """Whether the parsers of a response need its special tokens in the text: harmony's
        markers are special tokens (<|channel|>, <|message|>), as are Mistral's call markers."""
        return self.harmony or (parse_tools and self.tool_parser.keeps_special_tokens)


class ChainedParser:
    """The reasoning parser (if any) in front of the tool-call parser (if any); content passes
    through untouched when there is neither."""

    def __init__(self, reasoning: Optional[ReasoningParser], tools: Optional[ToolParser]) -> None:
        self.reasoner = reasoning
        self.tools = tools
        self.content = ""

    @property
    def calls(self) -> list[ParsedCall]:
        return self.tools.calls if self.tools is not None else []

    @property
    def reasoning(self) -> str:
        return self.reasoner.reasoning if self.reasoner is not None else ""

    def feed(self, delta: str) -> list[ParserEvent]:
        events = self.reasoner.feed(delta) if self.reasoner is not None else [ParserEvent("content", text=delta)]
        return self._through(events)

    def finish(self) -> list[ParserEvent]:
        out = self._through(self.reasoner.finish() if self.reasoner is not None else [])
        if self.tools is not None:
            out += self._count(self.tools.finish())
        return out

    def _through(self, events: list[ParserEvent]) -> list[ParserEvent]:
        out: list[ParserEvent] = []
        for e in events:
            if e.kind != "content":
                out.append(e)
            elif self.tools is not None:
                out += self._count(self.tools.feed(e.text))
            elif e.text:
                out += self._count([e])
        return out

    def _count(self, events: list[ParserEvent]) -> list[ParserEvent]:
        self.content += "".join(e.text for e in events if e.kind == "content")
        return events


def output_parser(settings: OutputParsing, parse_tools: bool, *, tools: Sequence = (),
                  prompt: str = "") -> OutputParser:
    """The parser of one response (one per choice): `settings` of the model that answers,
    `parse_tools` when the request allows tool calls; `tools` (ChatTool) give parsers whose
    syntax is untyped (qwen3_coder's XML) the parameter types; `prompt` is the rendered prompt,
    which says whether the template opened a think block."""
    if settings.tool_call_parser == HarmonyToolParser.name:
        # Harmony's channels carry reasoning, answer and calls alike: one reader splits all three.
        return HarmonyToolParser(tools, reasoning=settings.reasoning is HarmonyReasoningParser, calls=parse_tools)
    reasoning_cls = settings.reasoning
    return ChainedParser(reasoning_cls(prompt) if reasoning_cls is not None else None,
                         settings.tool_parser(tools) if parse_tools else None)


__all__ = [
    "DEFAULT_TOOL_PARSER", "REASONING_PARSERS", "TOOL_PARSERS", "ChainedParser", "HarmonyReasoningParser",
    "HarmonyToolParser", "OutputParser", "OutputParsing", "ParsedCall", "ParserEvent", "ReasoningParser",
    "ThinkReasoningParser", "ToolParser", "detect_tool_parser", "is_harmony_template", "new_call",
    "output_parser", "partial_suffix", "prompt_closes_think", "prompt_opens_think",
]
