"""OpenAI Responses API request schemas (`POST /v1/responses`): the request and its input items
(the response object and its output items are in response_models.py).

A request is translated into a chat completion request (`ResponsesRequest.chat_request`), so
the chat template, tool calling (choice, constraint, parsing) and structured output are the
ones chat completions use, and so are its rules for what agents send:
- tools: `function`; a `namespace`'s function tools, offered under flat names
  (`<namespace>__<name>`, as Codex flattens them) and their calls returned with `name` and
  `namespace` apart; `custom` (freeform) tools, whose calls come back as `custom_tool_call`
  items carrying text; hosted tools (web_search, file_search, code_interpreter, mcp,
  local_shell, ...) left out, named in the x-tessera-ignored-tools header.
- input items: messages of every role (`developer` is `system`), function and custom tool calls
  and their outputs, reasoning items (left out of the prompt); items of hosted tools
  (web_search_call, ...) and other kinds this server has no use for are skipped.
Fields OpenAI has and Tessera has no use for (truncation, include, prompt_cache_key,
max_tool_calls, service_tier) are ignored, as unknown fields are everywhere; a known field with
the wrong type is a 400, and so is an image or file for a model that reads text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, field_validator

from tessera.sampling_params import InvalidRequestError
from tessera.server.errors import validated
from tessera.server.openai.protocol import ChatCompletionRequest
from tessera.server.openai.schema_base import OpenAIModel
from tessera.server.openai.tool_schemas import FREEFORM_ARGUMENT

# ----------------------------------------------------------------------------- input items


class ContentPart(OpenAIModel):
    """input_text / output_text (text), input_image (its `image_url`, for a model that takes
    images), input_file (refused: the models read text)."""

    type: str
    text: Optional[str] = None
    image_url: Optional[str] = None
    file_id: Optional[str] = None


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    def chat_content(self) -> Union[str, list[dict[str, Any]]]:
        """The content as a chat message's: its text, or with images the chat API's content parts."""
        if isinstance(self.content, str) or not any(p.type == "input_image" for p in self.content):
            return self.text()
        if self.role != "user":
            raise InvalidRequestError(f"images are taken in user messages only, not in a {self.role!r} message")
        parts: list[dict[str, Any]] = []
        for part in self.content:
            if part.type == "input_image":
                if not part.image_url:
                    raise InvalidRequestError("an input_image needs an image_url (a data: URL); file_id is not "
                                              "supported")
                parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
            elif part.type != "refusal":
                parts.append({"type": "text", "text": MessageItem(role=self.role, content=[part]).text()})
        return parts

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type == "refusal":  # an earlier turn's refusal: not shown again
                continue
            if part.type not in ("input_text", "output_text", "text"):
                raise InvalidRequestError(f"content parts of type {part.type!r} are not supported; this server's "
                                          "models read text only (input_text, output_text)")
            if part.text is None:
                raise InvalidRequestError(f"a content part of type {part.type!r} needs a 'text' field")
            texts.append(part.text)
        return "".join(texts)


class FunctionCallItem(OpenAIModel):
    """A call the model made in an earlier turn, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: Optional[str] = None  # the call of a namespace's function
    id: Optional[str] = None
    status: Optional[str] = None


class CustomToolCallItem(OpenAIModel):
    """An earlier turn's call of a freeform tool, with its text."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: Optional[str] = None
    status: Optional[str] = None


class SkippedItem(OpenAIModel):
    """An item this server has no use for in a prompt: a hosted tool's call or result
    (web_search_call, file_search_call, ...), an item_reference to a stored item, a compaction.
    Skipped rather than refused, as a transcript an agent keeps may hold any of them."""

    type: str


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return MessageItem(role="user", content=self.output).text()


class CustomToolCallOutputItem(FunctionCallOutputItem):
    type: Literal["custom_tool_call_output"]  # type: ignore[assignment]


class ReasoningInputItem(OpenAIModel):
    """An earlier turn's reasoning, sent back by clients that keep the whole transcript (Codex):
    accepted and left out of the prompt, as chat templates leave earlier turns' reasoning out."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: Optional[list[dict[str, Any]]] = None
    content: Optional[list[dict[str, Any]]] = None
    encrypted_content: Optional[str] = None


INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "custom_tool_call",
                    "custom_tool_call_output", "reasoning")


def _item_type(value: Any) -> Optional[str]:
    """A message may leave out its type (OpenAI's EasyInputMessage); other items must say theirs."""
    kind = value.get("type", "message" if "role" in value else None) if isinstance(value, dict) \
        else getattr(value, "type", None)
    if kind in INPUT_ITEM_TYPES:
        return kind
    return "skipped" if isinstance(kind, str) else None


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")],
          Annotated[CustomToolCallItem, Tag("custom_tool_call")],
          Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")],
          Annotated[ReasoningInputItem, Tag("reasoning")], Annotated[SkippedItem, Tag("skipped")]],
    Discriminator(_item_type, custom_error_type="invalid_input_item",
                  custom_error_message="an input item must be an object with a role, or with a string type ("
                                       + ", ".join(INPUT_ITEM_TYPES) + ", ...)"),
]


# ----------------------------------------------------------------------------- request


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    def chat_tool(self, name: Optional[str] = None) -> dict[str, Any]:
        fields = self.model_dump(exclude_none=True, exclude={"type"})
        return {"type": "function", "function": {**fields, "name": name or self.name}}


class NamespaceTool(OpenAIModel):
    """A group of function tools (an MCP server's, say), which the model calls by flat names."""

    type: Literal["namespace"]
    name: str
    description: Optional[str] = None
    tools: list[FunctionTool] = Field(default_factory=list)


class CustomTool(OpenAIModel):
    """A freeform tool (Codex's apply_patch): its input is text, in the grammar `format` names."""

    type: Literal["custom"]
    name: str
    description: Optional[str] = None
    format: Optional[dict[str, Any]] = None


class HostedResponsesTool(OpenAIModel):
    """web_search, file_search, code_interpreter, image_generation, computer_use, mcp, local_shell,
    ...: run by OpenAI's platform, not here (tool_schemas.HostedTool)."""

    type: str


def _tool_type(value: Any) -> Optional[str]:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in ("function", "namespace", "custom"):
        return kind
    return "hosted" if isinstance(kind, str) else None


ResponsesTool = Annotated[
    Union[Annotated[FunctionTool, Tag("function")], Annotated[NamespaceTool, Tag("namespace")],
          Annotated[CustomTool, Tag("custom")], Annotated[HostedResponsesTool, Tag("hosted")]],
    Discriminator(_tool_type, custom_error_type="invalid_tool",
                  custom_error_message="a tool must be an object with a string 'type' ('function', 'namespace', "
                                       "'custom', or a hosted tool's type, which is ignored)"),
]


def flat_name(namespace: str, name: str) -> str:
    """A namespace's function as the model calls it: Codex's own flattening of the pair."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


@dataclass(frozen=True)
class CallNames:
    """How the model's calls map back to the client's tools: flat names of namespaced functions
    (to their namespace and name) and the names of freeform tools."""

    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    freeform: frozenset[str] = frozenset()

    def model_name(self, name: str, namespace: Optional[str]) -> str:
        return flat_name(namespace, name) if namespace else name


class FunctionToolChoice(OpenAIModel):
    type: Literal["function", "custom"]
    name: str
    namespace: Optional[str] = None


class OtherToolChoice(OpenAIModel):
    """`allowed_tools`, or a hosted tool's type: the model picks among the tools it is shown."""

    type: str

    @field_validator("type")
    @classmethod
    def _not_named(cls, kind: str) -> str:
        if kind in ("function", "custom"):
            raise ValueError(f"a tool_choice of type {kind!r} needs the tool's name")
        return kind


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(OpenAIModel):
    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


class ReasoningConfig(OpenAIModel):
    """`reasoning.effort` as the chat template's switches: "none" turns thinking off
    (`enable_thinking: false`, Qwen3's and other hybrid reasoners' variable), any other effort
    turns it on, and the effort itself is passed as `reasoning_effort` for templates that read
    it (gpt-oss's). `summary` is accepted; the reasoning comes back whole, never summarised."""

    effort: Optional[str] = None
    summary: Optional[str] = None

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        if self.effort is None:
            return None
        return {"enable_thinking": self.effort != "none", "reasoning_effort": self.effort}


class ResponsesRequest(OpenAIModel):
    model: Optional[str] = None
    input: Union[list[InputItem], str]  # the list first: a bad item is the error reported
    instructions: Optional[str] = None
    tools: Optional[list[ResponsesTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionToolChoice, OtherToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = True
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # vLLM extension
    seed: Optional[int] = None  # vLLM extension: reproducible sampling
    stream: Optional[bool] = False
    store: Optional[bool] = True
    background: Optional[bool] = False
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    priority: Optional[int] = None  # vLLM extension, as on chat completions; None: the API key's default

    def input_items(self) -> list[Any]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_request(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request this one amounts to: its instructions, then `conversation`
        (the stored turns of previous_response_id and this request's input items, as chat
        messages; earlier instructions are not carried over, as OpenAI's are not)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + conversation
        if not messages:
            raise InvalidRequestError("input must not be empty")
        fmt = self.text.format if self.text is not None else None
        response_format: Optional[dict[str, Any]] = None
        if fmt is not None and fmt.type == "json_object":
            response_format = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise InvalidRequestError("text.format of type json_schema needs a schema")
            response_format = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
        choice: Any = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = {"type": "function", "function": {"name": self.call_names().model_name(choice.name,
                                                                                           choice.namespace)}}
        elif isinstance(choice, OtherToolChoice):
            choice = {"type": "allowed_tools"}
        return validated(ChatCompletionRequest, {
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "user": self.user, "priority": self.priority, "response_format": response_format, "parallel_tool_calls": self.parallel_tool_calls,
            "tools": self.chat_tools(), "tool_choice": choice,
            "chat_template_kwargs": self.reasoning.template_kwargs() if self.reasoning is not None else None,
        })

    def chat_tools(self) -> Optional[list[dict[str, Any]]]:
        """The tools in chat completions' shapes: namespaces flattened, freeform tools as chat's
        custom tools, hosted ones by their type (which the chat request leaves out)."""
        if not self.tools:
            return None
        out: list[dict[str, Any]] = []
        for tool in self.tools:
            if isinstance(tool, FunctionTool):
                out.append(tool.chat_tool())
            elif isinstance(tool, NamespaceTool):
                out += [t.chat_tool(flat_name(tool.name, t.name)) for t in tool.tools]
            elif isinstance(tool, CustomTool):
                out.append({"type": "custom", "custom": tool.model_dump(exclude_none=True, exclude={"type"})})
            else:
                out.append({"type": tool.type})
        return out

    def call_names(self) -> CallNames:
        namespaced = {flat_name(tool.name, t.name): (tool.name, t.name)
                      for tool in self.tools or [] if isinstance(tool, NamespaceTool) for t in tool.tools}
        freeform = frozenset(tool.name for tool in self.tools or [] if isinstance(tool, CustomTool))
        return CallNames(namespaced, freeform)


def items_to_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls join one assistant turn (after
    the assistant's text, if it came just before), each call's output is a tool message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.chat_content()})
        elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
            if isinstance(item, FunctionCallItem):
                try:
                    json.loads(item.arguments or "{}")
                except json.JSONDecodeError:
                    raise InvalidRequestError(f"function_call {item.name!r}: arguments are not valid JSON") from None
                name = CallNames().model_name(item.name, item.namespace)
                arguments = item.arguments or "{}"
            else:
                name, arguments = item.name, json.dumps({FREEFORM_ARGUMENT: item.input}, ensure_ascii=False)
            call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):  # custom_tool_call_output too
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        # reasoning items are not part of the prompt (see ReasoningInputItem), nor are SkippedItems
    return messages
