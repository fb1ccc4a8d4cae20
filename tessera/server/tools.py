"""Tool calling, shared by every API: the prompt, the constraint and the parsing of calls.

Prompt: a model whose chat template renders tools (Qwen2.5) gets them through its template;
one whose template does not (SmolLM2) gets instructions in its parser's syntax as a system
message, and earlier calls written into their assistant turns the same way (`render_prompt`).

Enforcement: unless `tool_choice` is "none", the request carries a structural-tag constraint
in the syntax of the model's tool-call parser (`tool_constraint`): text is free until the
model opens a call; from there the function name must be one of the tools and the arguments
must validate against its `parameters` schema. "required" needs at least one call before any
end, a named choice forces that call, `parallel_tool_calls: false` stops after one. With a
reasoning parser, a think block may come first (must, when the template opened it; none when
the template closed an empty one, its way of switching thinking off).

Parsing: `output_parser` (tessera/server/output_parsers) reads the text as it streams into
reasoning, content and tool-call deltas (id and name first, then argument text as it arrives,
like OpenAI's); a whole response runs the same parser over the whole text.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from tessera.sampling_params import InvalidRequestError, StructuredOutputsParams
from tessera.server.output_parsers import (
    TOOL_PARSERS, OutputParser, OutputParsing, ParsedCall, ParserEvent, ThinkReasoningParser, ToolParser,
    is_harmony_template, output_parser, prompt_closes_think, prompt_opens_think,
)
from tessera.server.output_parsers.hermes import HermesToolParser
from tessera.server.openai.tool_schemas import ChatTool, NamedToolChoice

# The parser of today's default syntax, under the name the chat handler has always used.
ToolCallParser = HermesToolParser


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


def tool_constraint(tools: list[ChatTool], choice: Any, parallel: bool,
                    settings: OutputParsing = OutputParsing(), prompt: str = "") -> StructuredOutputsParams:
    """The structural tag that enforces the parser's call syntax and each function's schema;
    `prompt` (the rendered prompt) says whether the output starts inside a think block."""
    specs = [{"name": t.function.name, "parameters": t.function.parameters or {"type": "object", "properties": {}}}
             for t in tools]
    mode = tool_choice_mode(tools, choice)
    if mode == "named":
        specs = [s for s in specs if s["name"] == choice.function.name]
    fmt = settings.tool_parser.call_format(specs, mode, parallel)
    reasoning = settings.reasoning
    # (Harmony's reasoning is its analysis channel, which its own format already holds.)
    if (isinstance(reasoning, type) and issubclass(reasoning, ThinkReasoningParser)
            and not prompt_closes_think(prompt, reasoning.closer)):
        opened = reasoning.always_starts_inside or prompt_opens_think(prompt, reasoning.opener, reasoning.closer)
        # The newlines after the block belong to it: with "required" the calls' format starts at once.
        think: dict[str, Any] = {"type": "tag", "begin": "" if opened else reasoning.opener,
                                 "content": {"type": "any_text"},
                                 "end": [reasoning.closer + "\n\n", reasoning.closer + "\n", reasoning.closer]}
        fmt = {"type": "sequence", "elements": [think if opened else {"type": "optional", "content": think}, fmt]}
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))


def add_tools_to_messages(messages: list[dict[str, Any]], tools: Sequence[ChatTool],
                          parser: type[ToolParser] = HermesToolParser) -> list[dict[str, Any]]:
    """For a template that ignores tools: the tools as a system message (merged into the first
    one if there is one), earlier tool calls written into their assistant turns' text, both in
    the parser's syntax."""
    out = [dict(m) for m in messages]
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            text = parser.render_calls([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                        for c in calls])
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + text
    if not tools:
        return out
    listing = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    block = (parser.instructions or HermesToolParser.instructions).format(tools=listing)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{block}"
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


def render_prompt(tokenizer: Any, settings: OutputParsing, messages: list[dict[str, Any]],
                  tools: Optional[Sequence[ChatTool]], *, add_generation_prompt: bool = True,
                  template_kwargs: Optional[dict[str, Any]] = None) -> str:
    """A conversation (chat-template messages) as prompt text, with the model's template or the
    server's override; tools through the template if it renders them, else as a system message.
    Any API's messages go through here once turned into chat-template messages."""
    messages = _leading_system_joined(messages)
    template = settings.template(tokenizer.chat_template)
    messages = harmony_messages(messages) if is_harmony_template(template) else _without_reasoning(messages)
    template_tools = None
    if template_renders_tools(template):
        template_tools = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        if template_tools and is_harmony_template(template):  # gpt-oss's writes "// " + description
            for t in template_tools:
                t["function"].setdefault("description", "")
    else:
        messages = add_tools_to_messages(messages, tools or [], settings.tool_parser)
    extra: dict[str, Any] = {}
    if settings.chat_template is not None:
        extra["chat_template"] = settings.chat_template
    if template_kwargs:
        extra["template_kwargs"] = template_kwargs
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tools=template_tools, **extra)
    except Exception as exc:  # jinja templates raise for e.g. roles they do not know or a bad order
        plain = _plain_turns(messages)
        if plain != messages:
            try:
                return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                                     tools=template_tools, **extra)
            except Exception:  # noqa: BLE001 - the first refusal is the one to report
                pass
        if isinstance(exc, InvalidRequestError):
            raise
        raise InvalidRequestError(f"the model's chat template rejected these messages: {exc}") from exc


def _without_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier turns' reasoning left out, as the think family's templates leave it out."""
    if not any("reasoning_content" in m for m in messages):
        return messages
    return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]


def harmony_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation as gpt-oss's template reads it (as llama.cpp hands it over): a turn's
    reasoning as `thinking`, which the template renders before the turn's tool call (and raises
    on beside content there, so the reasoning wins); and one call per assistant turn, each
    followed by its result, since the template renders only a turn's first call and names a
    result after the latest call."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        m = dict(messages[i])
        i += 1
        if "reasoning_content" in m:
            m["thinking"] = m.pop("reasoning_content")
            if m.get("tool_calls"):
                m.pop("content", None)
        calls = m.get("tool_calls") or []
        if m["role"] != "assistant" or len(calls) < 2:
            out.append(m)
            continue
        results = []
        while i < len(messages) and messages[i]["role"] == "tool":
            results.append(messages[i])
            i += 1
        for n, call in enumerate(calls):
            out.append(dict(m, tool_calls=[call]) if n == 0 else {"role": "assistant", "tool_calls": [call]})
            # Its result: the one with its id, else the next one that names no call.
            at = next((k for k, r in enumerate(results) if call.get("id") and r.get("tool_call_id") == call["id"]),
                      next((k for k, r in enumerate(results) if not r.get("tool_call_id")), None))
            if at is not None:
                out.append(results.pop(at))
        out += results  # results of no call of the turn: after its calls
    return out


def _text_join(parts: list[Any]) -> str:
    return "\n\n".join(p for p in parts if p)


def _leading_system_joined(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system messages before the first other message as one: a template's system prompt is
    its first message (agents send instructions and then developer messages, each a system one)."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n < 2:
        return messages
    return [{"role": "system", "content": _text_join([m.get("content") or "" for m in messages[:n]])}] + messages[n:]


def _plain_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as the strictest templates take it (those that refuse a system message
    after the first, or two user turns in a row): every system message's text joined into the
    first, consecutive plain user turns joined. Only used when the template refused the messages
    as they were, so templates that read them as sent still do."""
    system = [m.get("content") or "" for m in messages if m["role"] == "system"]
    out: list[dict[str, Any]] = [{"role": "system", "content": _text_join(system)}] if system else []
    for m in messages:
        if m["role"] == "system":
            continue
        last = out[-1] if out else None
        if (last is not None and m["role"] == last["role"] == "user" and set(m) == set(last) == {"role", "content"}
                and isinstance(m.get("content") or "", str) and isinstance(last["content"] or "", str)):
            last["content"] = _text_join([last["content"] or "", m.get("content") or ""])
        else:
            out.append(dict(m))
    return out


__all__ = [
    "TOOL_PARSERS", "OutputParser", "OutputParsing", "ParsedCall", "ParserEvent", "ToolCallParser",
    "add_tools_to_messages", "check_tools", "output_parser", "render_prompt", "template_renders_tools",
    "tool_choice_mode", "tool_constraint",
]
