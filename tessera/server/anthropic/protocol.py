"""Anthropic Messages API schemas (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

A request is translated into a chat completion request (`MessagesRequest.chat_request`):
`system` (a string or text blocks) and `system` entries anywhere in `messages` become system
messages, `tool_use` blocks the assistant turn's tool calls, each `tool_result` block a tool
message (`is_error` said in its text), `tool_choice` auto/any/tool/none the chat's
auto/required/named/none, `input_schema` a function's parameters. So the template, tool
constraint and parsing are the ones chat completions use, and so are its rules for what
agents send: server tools (web_search_..., code_execution_..., with a `type`) are left out and
named in the x-tessera-ignored-tools header; earlier turns' thinking is the turn's reasoning
(left out of the prompt unless the template renders it, as gpt-oss's does before a tool call),
blocks of server tools or of kinds this server has no use for are left out of the prompt;
`output_config.effort` is the template's `reasoning_effort`. Fields Tessera has no use
for (cache_control, context_management, service_tier, container, mcp_servers) are ignored, and
sampling settings the SDK no longer names (temperature, top_p, top_k, min_p, penalties) are
read from the body wherever a client puts them. Image blocks, and documents that are not
text, are a 400, since the models served read text.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag

from tessera.sampling_params import InvalidRequestError
from tessera.server.errors import validated
from tessera.server.openai.protocol import ChatCompletionRequest
from tessera.server.openai.schema_base import OpenAIModel

# ----------------------------------------------------------------------------- content blocks


class TextBlock(OpenAIModel):
    type: Literal["text"]
    text: str


class MediaBlock(OpenAIModel):
    """image (a base64 or URL source, for a model that takes images) / document (read when its
    source is text: plain text, or text blocks)."""

    type: Literal["image", "document"]
    source: Optional[dict[str, Any]] = None
    title: Optional[str] = None

    def text(self) -> str:
        source = self.source or {}
        if self.type == "document" and source.get("type") == "text" and isinstance(source.get("data"), str):
            body = source["data"]
        elif self.type == "document" and source.get("type") == "content" and isinstance(source.get("content"), list):
            body = "".join(b.get("text", "") for b in source["content"]
                           if isinstance(b, dict) and b.get("type") == "text")
        else:
            raise InvalidRequestError(f"{self.type} content blocks are not supported here: a document is read as "
                                      "text only when its source is text, and images are taken in user messages")
        return f"{self.title}\n\n{body}" if self.title else body

    def image_url(self) -> str:
        """An image block's source as a URL (its base64 data as a data: URL)."""
        source = self.source or {}
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            media = source.get("media_type")
            return f"data:{media if isinstance(media, str) else ''};base64,{source['data']}"
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return source["url"]
        raise InvalidRequestError("an image block's source must be {\"type\": \"base64\", \"media_type\": ..., "
                                  "\"data\": ...} or {\"type\": \"url\", \"url\": ...}")


class SkippedBlock(OpenAIModel):
    """A block with no place in a prompt here: a server tool's use or result (server_tool_use,
    web_search_tool_result, mcp_tool_use, ...), a container upload, or a kind this server does not
    know. Left out rather than refused, as a transcript an agent keeps may hold any of them."""

    type: str


class ToolUseBlock(OpenAIModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


def _inner_type(value: Any) -> Optional[str]:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in ("text", "image", "document"):
        return "media" if kind != "text" else "text"
    return "skipped" if isinstance(kind, str) else None


# What a tool result holds: text, images and documents (search results and others skipped).
ResultBlock = Annotated[
    Union[Annotated[TextBlock, Tag("text")], Annotated[MediaBlock, Tag("media")],
          Annotated[SkippedBlock, Tag("skipped")]],
    Discriminator(_inner_type, custom_error_type="invalid_content_block",
                  custom_error_message="a content block must be an object with a string type"),
]


class ToolResultBlock(OpenAIModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[ResultBlock], None] = None
    is_error: Optional[bool] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            text = self.content or ""
        else:
            text = "".join(_text_of(b) for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(OpenAIModel):
    """An earlier turn's thinking sent back: the turn's reasoning, which most chat templates keep
    out of the prompt (gpt-oss's renders it before a tool call)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: Optional[str] = None
    signature: Optional[str] = None
    data: Optional[str] = None


BLOCK_TYPES = ("text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _block_type(value: Any) -> Optional[str]:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in ("image", "document"):
        return "media"
    if kind == "redacted_thinking":
        return "thinking"
    if kind in BLOCK_TYPES:
        return kind
    return "skipped" if isinstance(kind, str) else None


ContentBlock = Annotated[
    Union[Annotated[TextBlock, Tag("text")], Annotated[MediaBlock, Tag("media")],
          Annotated[ToolUseBlock, Tag("tool_use")], Annotated[ToolResultBlock, Tag("tool_result")],
          Annotated[ThinkingBlock, Tag("thinking")], Annotated[SkippedBlock, Tag("skipped")]],
    Discriminator(_block_type, custom_error_type="invalid_content_block",
                  custom_error_message="a content block must be an object with a string type ("
                                       + ", ".join(BLOCK_TYPES) + ", ...)"),
]


def _text_of(block: Any) -> str:
    if isinstance(block, SkippedBlock):
        return ""
    if isinstance(block, MediaBlock):
        return block.text()
    return block.text


class InputMessage(OpenAIModel):
    # Claude Code puts `system` entries among the messages too; they are system messages.
    role: Literal["user", "assistant", "system"]
    content: Union[list[ContentBlock], str]  # the list first: a bad block is the error reported


# ----------------------------------------------------------------------------- request


class Tool(OpenAIModel):
    """A client tool (the client runs it). One with `defer_loading` is not shown to the model
    until a tool search brings it in (Anthropic's tool search), so it is not shown here."""

    name: str
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None
    defer_loading: Optional[bool] = None


class ServerTool(OpenAIModel):
    """A tool Anthropic's platform runs (web_search_..., code_execution_..., bash_..., with a
    `type`): left out here (tool_schemas.HostedTool)."""

    type: str
    name: Optional[str] = None


def _tool_kind(value: Any) -> Optional[str]:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in (None, "custom"):
        return "client"
    return "server" if isinstance(kind, str) else None


AnyTool = Annotated[
    Union[Annotated[Tool, Tag("client")], Annotated[ServerTool, Tag("server")]],
    Discriminator(_tool_kind, custom_error_type="invalid_tool",
                  custom_error_message="a tool must be an object with a name and input_schema, or a server "
                                       "tool's type (which is ignored)"),
]


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Metadata(OpenAIModel):
    user_id: Optional[str] = None


class ThinkingConfig(OpenAIModel):
    """Extended thinking, as Claude Code sends it: the chat template's `enable_thinking`
    (Qwen3's and other hybrid reasoners' switch), on unless `disabled` ("adaptive" lets the
    model decide, which a hybrid model does with thinking on). `budget_tokens` is accepted and
    not enforced: the reasoning shares `max_tokens` with the answer."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[int] = None

    def template_kwargs(self) -> dict[str, Any]:
        return {"enable_thinking": self.type != "disabled"}


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    """Structured output (`format`), through the same grammar path as chat's response_format."""

    format: Optional[OutputFormat] = None
    effort: Optional[str] = None


# Claude Code's first system block: accounting for Anthropic's API, not words for the model, and
# different in every request (a hash of the request): left in, no two prompts would share their
# system prompt and tools in the prefix cache.
BILLING_HEADER = "x-anthropic-billing-header:"


class CountTokensRequest(OpenAIModel):
    model: Optional[str] = None
    messages: list[InputMessage]
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[AnyTool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[OutputConfig] = None

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        if not self.messages:
            raise InvalidRequestError("messages: at least one message is required")
        messages: list[dict[str, Any]] = []
        system = self.system if isinstance(self.system, str) else "\n\n".join(
            b.text for b in self.system or [] if not b.text.startswith(BILLING_HEADER))
        if system:
            messages.append({"role": "system", "content": system})
        for m in self.messages:
            messages += _to_chat(m)
        choice: Any = None
        parallel = True
        if self.tool_choice is not None:
            tc = self.tool_choice
            if tc.type == "tool" and not tc.name:
                raise InvalidRequestError("tool_choice of type 'tool' needs a name")
            choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
                {"type": "function", "function": {"name": tc.name}}
            parallel = not tc.disable_parallel_tool_use
        fmt = self.output_config.format if self.output_config is not None else None
        return validated(ChatCompletionRequest, {
            "model": self.model, "messages": messages, "parallel_tool_calls": parallel, "tool_choice": choice,
            "response_format": None if fmt is None else {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.schema_}},
            "tools": [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                        "parameters": t.input_schema}}
                      if isinstance(t, Tool) else {"type": t.type} for t in self.tools
                      if not (isinstance(t, Tool) and t.defer_loading)] or None if self.tools else None,
            "chat_template_kwargs": self.thinking.template_kwargs() if self.thinking is not None else None,
            "reasoning_effort": self.output_config.effort if self.output_config is not None else None,
            **sampling,
        })


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as Anthropic's API has it
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    metadata: Optional[Metadata] = None
    stream: Optional[bool] = False
    # Not Anthropic's: vLLM's sampling extensions, for clients that send them as extra body fields.
    seed: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None

    def sampling(self) -> dict[str, Any]:
        return {"max_completion_tokens": self.max_tokens, "stop": self.stop_sequences,
                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                "user": self.metadata.user_id if self.metadata is not None else None}


def _to_chat(message: InputMessage) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user message's tool_result blocks become tool
    messages (before its text), an assistant message's tool_use blocks its tool calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "system":
        return [{"role": "system", "content": "".join(_text_of(b) for b in message.content
                                                      if not isinstance(b, (ToolUseBlock, ToolResultBlock,
                                                                            ThinkingBlock)))}]
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and images in order, for a message holding images
    results: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thoughts: list[str] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            if message.role != "user":
                raise InvalidRequestError("tool_result blocks belong in user messages")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise InvalidRequestError("tool_use blocks belong in assistant messages")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ThinkingBlock):
            if block.thinking and message.role == "assistant":
                thoughts.append(block.thinking)
        elif isinstance(block, MediaBlock) and block.type == "image" and message.role == "user":
            if texts:
                parts.append({"type": "text", "text": "".join(texts)})
                texts = []
            parts.append({"type": "image_url", "image_url": {"url": block.image_url()}})
        else:
            texts.append(_text_of(block))
    out = list(results)
    text = "".join(texts)
    if parts:  # the images where they were among the text
        out.append({"role": "user", "content": parts + ([{"type": "text", "text": text}] if text else [])})
        return out
    # The thinking rides along as the turn's reasoning: templates that render it (gpt-oss's, for a
    # turn that called tools) get it, the others leave it out (render_prompt).
    reasoning = {"reasoning_content": "\n".join(thoughts)} if thoughts else {}
    if calls:
        out.append({"role": "assistant", "content": text or None, "tool_calls": calls, **reasoning})
    elif text or not results:
        out.append({"role": message.role, "content": text, **reasoning})
    return out


# ----------------------------------------------------------------------------- response


class Usage(OpenAIModel):
    """Anthropic's split of the prompt, whose length is the sum of the three input fields:
    `cache_read_input_tokens` the prefix cache served, `input_tokens` the rest (computed for this
    request). `cache_creation_input_tokens` stays 0: Anthropic counts there what a `cache_control`
    breakpoint writes to its cache, billed above plain input; this server caches every full block
    of every prompt as a side effect of computing it, at no extra cost and with no lifetime
    promised, so nothing is written in that sense and computed tokens stay in `input_tokens`."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, cached_tokens: int, output_tokens: int = 0) -> "Usage":
        return cls(input_tokens=prompt_tokens - cached_tokens, cache_read_input_tokens=cached_tokens,
                   output_tokens=output_tokens)


class MessageResponse(OpenAIModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]] = Field(default_factory=list)
    model: str
    stop_reason: Optional[str] = None  # end_turn, max_tokens, stop_sequence, tool_use
    stop_sequence: Optional[str] = None
    usage: Usage = Field(default_factory=Usage)


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
