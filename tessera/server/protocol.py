"""OpenAI API request and response schemas (the subset Tessera serves).

Requests ignore fields they do not know, as OpenAI and vLLM do, but a known
field with the wrong type fails validation (the app turns that into a 400).
Range checks live in SamplingParams so the engine and the server agree on them.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from tessera.sampling_params import InvalidRequestError, SamplingParams

# Largest n one request may ask for (OpenAI's own limit); keeps one request from flooding the engine.
MAX_N = 128


class OpenAIModel(BaseModel):
    # strict: `true` is not a max_tokens and "0.5" is not a temperature (ints still pass as floats)
    model_config = ConfigDict(extra="ignore", strict=True)


# How to describe the fields whose type is a union, when a value fits none of its members.
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}


# ----------------------------------------------------------------------------- requests


class StreamOptions(OpenAIModel):
    include_usage: Optional[bool] = False


class SamplingRequest(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None  # None = the served model
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # vLLM extension
    min_p: Optional[float] = None  # vLLM extension
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None  # vLLM extension
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None  # vLLM extension
    n: Optional[int] = Field(default=None, le=MAX_N)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: Optional[bool] = False  # vLLM extension
    skip_special_tokens: Optional[bool] = True  # vLLM extension
    # Tessera extension: false opts this request out of speculative decoding (e.g. a client that
    # wants the steadiest per-token latency rather than the highest speed).
    speculative: Optional[bool] = True
    user: Optional[str] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        """Build the engine's settings; raises InvalidRequestError for out-of-range values."""
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        try:
            return SamplingParams(
                n=pick(self.n, 1),
                max_tokens=max_tokens,
                temperature=pick(self.temperature, 1.0),
                top_p=pick(self.top_p, 1.0),
                top_k=pick(self.top_k, 0),
                min_p=pick(self.min_p, 0.0),
                presence_penalty=pick(self.presence_penalty, 0.0),
                frequency_penalty=pick(self.frequency_penalty, 0.0),
                repetition_penalty=pick(self.repetition_penalty, 1.0),
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=bool(self.ignore_eos),
                logprobs=logprobs,
                skip_special_tokens=pick(self.skip_special_tokens, True),
                speculative=pick(self.speculative, True),
            )
        except (TypeError, ValueError) as exc:  # InvalidRequestError is a ValueError
            raise InvalidRequestError(str(exc)) from exc


Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    logprobs: Optional[int] = None  # top-N per token; 0 = only the sampled token
    echo: Optional[bool] = False

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt field as a list of engine prompts (one request per entry)."""
        p = self.prompt
        if isinstance(p, str):
            items: list[Union[str, list[int]]] = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        if not items or any(len(x) == 0 for x in items):
            raise InvalidRequestError("prompt must not be empty")
        return items


class TextPart(OpenAIModel):
    type: str
    text: Optional[str] = None


class ChatMessage(OpenAIModel):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The message content as one string; only text parts are supported."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text":
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} are not supported; only text parts are")
            if part.text is None:
                raise InvalidRequestError("a content part of type 'text' needs a 'text' field")
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: Optional[bool] = True  # vLLM extension

    def template_messages(self) -> list[dict[str, str]]:
        if not self.messages:
            raise InvalidRequestError("messages must not be empty")
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def num_logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None


# ----------------------------------------------------------------------------- responses


# Names a range error from SamplingParams may start with, to report as the error's param.
REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


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
    content: Optional[str] = None


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


class DeltaMessage(OpenAIModel):
    """Only the fields a chunk carries: {"role": ..} first, then {"content": ..}, and {} at the end."""

    role: Optional[str] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


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
    max_model_len: Optional[int] = None


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
