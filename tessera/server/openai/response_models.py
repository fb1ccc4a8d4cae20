"""OpenAI API response schemas: completions, chat completions (whole and streamed chunks), the
model list and the error body, as OpenAI's clients parse them."""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from tessera.server.openai.schema_base import OpenAIModel, SparseModel
from tessera.server.openai.tool_schemas import CustomCall, ToolCall


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache served (counted in prompt_tokens too)


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Set on a generation's usage, as OpenAI's chat and completions usage has it: agent clients
    # read it to show how much of each turn was cached. An embedding's usage has none.
    prompt_tokens_details: Optional[PromptTokensDetails] = None

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens_details.cached_tokens if self.prompt_tokens_details is not None else 0

    @model_serializer(mode="wrap")
    def _drop_no_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class CompletionLogprobs(OpenAIModel):
    """The legacy completions format: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None  # vLLM extension: the stop string or token that ended it


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: Optional[str] = None  # null when the reply is only tool calls
    tool_calls: list[ToolCall] = Field(default_factory=list)
    # With a reasoning parser: the think block's text (vLLM's and DeepSeek's name, and the newer `reasoning`).
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """`tool_calls` only when there are some, as OpenAI's responses have it; the reasoning
        fields only when the model's output is parsed for reasoning."""
        data = handler(self)
        for key in ("tool_calls", "reasoning_content", "reasoning"):
            if not data.get(key) and (key == "tool_calls" or data.get(key) is None):
                data.pop(key, None)
        return data


class DeltaFunctionCall(SparseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(SparseModel):
    """A piece of a streamed tool call: id, type and name first, then argument text."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function", "custom"]] = None
    function: Optional[DeltaFunctionCall] = None
    custom: Optional[CustomCall] = None  # a freeform tool's call, whole in one piece


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(SparseModel):
    """Only the fields a chunk carries: {"role": ..} first, then {"content": ..} or {"tool_calls": ..},
    and {} at the end."""

    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatChunkChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatChunkChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tessera"
    root: Optional[str] = None
    max_model_len: Optional[int] = None  # None while the model is not loaded
    status: Optional[str] = None  # tessera: unloaded, loading, ready or failed
    parent: Optional[str] = None  # a LoRA adapter's base model (vLLM's field); None for a model
    # tessera: what the model takes and does ("completion", "vision", "embedding"); None while not loaded
    capabilities: Optional[list[str]] = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Union[str, int, None] = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo
