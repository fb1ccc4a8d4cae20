"""OpenAI Responses API schemas (`POST /v1/responses`): the request, its input items, and the
response object with its output items.

A request is translated into a chat completion request (`ResponsesRequest.chat_request`), so
the chat template, tool calling (choice, constraint, parsing) and structured output are the
ones chat completions use. Fields OpenAI has and Tessera has no use for (truncation, include,
prompt cache keys) are ignored, as unknown fields are everywhere; a known
field with the wrong type, an input item of a type Tessera does not serve, or a tool other than
a function is a 400.
"""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, ValidationError

from tessera.sampling_params import InvalidRequestError
from tessera.server.errors import validation_error
from tessera.server.protocol import ChatCompletionRequest, OpenAIModel

# ----------------------------------------------------------------------------- input items


class ContentPart(OpenAIModel):
    """input_text / output_text (text), input_image / input_file (refused: the models read text)."""

    type: str
    text: Optional[str] = None


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[ContentPart]]
    id: Optional[str] = None
    status: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
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
    id: Optional[str] = None
    status: Optional[str] = None


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


class ReasoningInputItem(OpenAIModel):
    """An earlier turn's reasoning, sent back by clients that keep the whole transcript (Codex):
    accepted and left out of the prompt, as chat templates leave earlier turns' reasoning out."""

    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: Optional[list[dict[str, Any]]] = None
    content: Optional[list[dict[str, Any]]] = None
    encrypted_content: Optional[str] = None


def _item_type(value: Any) -> Optional[str]:
    """A message may leave out its type (OpenAI's EasyInputMessage); other items must say theirs."""
    if isinstance(value, dict):
        return value.get("type", "message" if "role" in value else None)
    return getattr(value, "type", None)


INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")

InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")],
          Annotated[ReasoningInputItem, Tag("reasoning")]],
    Discriminator(_item_type, custom_error_type="invalid_input_item",
                  custom_error_message="an input item must be an object whose type is one of "
                                       + ", ".join(INPUT_ITEM_TYPES)),
]


# ----------------------------------------------------------------------------- request


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


def _tool_type(value: Any) -> Optional[str]:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "function" if kind == "function" else None


ResponsesTool = Annotated[
    Union[Annotated[FunctionTool, Tag("function")]],
    Discriminator(_tool_type, custom_error_type="unsupported_tool",
                  custom_error_message="only tools of type 'function' are supported (no built-in tools)"),
]


class FunctionToolChoice(OpenAIModel):
    type: Literal["function"]
    name: str


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
    tool_choice: Union[Literal["none", "auto", "required"], FunctionToolChoice, None] = None
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
            choice = {"type": "function", "function": {"name": choice.name}}
        return chat_request({
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "user": self.user, "response_format": response_format, "parallel_tool_calls": self.parallel_tool_calls,
            "tools": [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                      for t in self.tools] if self.tools else None,
            "tool_choice": choice,
            "chat_template_kwargs": self.reasoning.template_kwargs() if self.reasoning is not None else None,
        })


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A chat completion request from another API's translated fields; a value the chat request
    refuses (a tool name it does not allow, say) is a 400 like any other."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def items_to_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls join one assistant turn (after
    the assistant's text, if it came just before), each call's output is a tool message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments or "{}")
            except json.JSONDecodeError:
                raise InvalidRequestError(f"function_call {item.name!r}: arguments are not valid JSON") from None
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        # reasoning items: not part of the prompt (see ReasoningInputItem)
    return messages


# ----------------------------------------------------------------------------- response


class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(OpenAIModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    status: str = "in_progress"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallOutput(OpenAIModel):
    """A call the model makes (an output item; the client answers with function_call_output)."""

    id: str
    type: Literal["function_call"] = "function_call"
    status: str = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


OutputItem = Union[OutputMessage, ReasoningItem, FunctionCallOutput]


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class ResponseError(OpenAIModel):
    code: str
    message: str


class IncompleteDetails(OpenAIModel):
    reason: str


class ResponseObject(OpenAIModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: str = "in_progress"  # queued, in_progress, completed, incomplete, failed, cancelled
    background: bool = False
    error: Optional[ResponseError] = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict[str, Any]] = None
    store: bool = True
    temperature: Optional[float] = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: Optional[float] = None
    truncation: str = "disabled"
    usage: Optional[ResponseUsage] = None
    user: Optional[str] = None
