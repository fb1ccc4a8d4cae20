"""OpenAI Responses API response schemas: the response object, its output items (messages,
reasoning, function and custom tool calls), usage and errors."""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from tessera.server.openai.schema_base import OpenAIModel


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


class _CallOutput(OpenAIModel):
    """A call the model makes, as an output item."""

    id: str
    status: str = "in_progress"
    call_id: str
    name: str


class FunctionCallOutput(_CallOutput):
    """A function's call (the client answers with function_call_output). `namespace` only for a
    namespace's function (then `name` is the function's own)."""

    type: Literal["function_call"] = "function_call"
    arguments: str = ""
    namespace: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_no_namespace(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("namespace") is None:
            data.pop("namespace", None)
        return data


class CustomToolCallOutput(_CallOutput):
    """A freeform tool's call (the client answers with custom_tool_call_output)."""

    type: Literal["custom_tool_call"] = "custom_tool_call"
    input: str = ""


OutputItem = Union[OutputMessage, ReasoningItem, FunctionCallOutput, CustomToolCallOutput]


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
