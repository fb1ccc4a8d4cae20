"""Ollama API request schemas (/api/chat, /api/generate, /api/show), as Ollama's api/types.go has them.

Unknown fields are ignored, as Ollama does; a known field of the wrong type fails validation
(a 400 in Ollama's `{"error": ...}` shape). `options` holds the runtime options Tessera maps
onto SamplingParams; Ollama's load-time options (num_gpu, num_thread, use_mmap, ...) and the
samplers it has that Tessera does not (mirostat, tfs_z, typical_p, repeat_last_n) are accepted
and ignored, as Ollama ignores options a runner does not use.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tessera.sampling_params import InvalidRequestError

# Go's int is 64-bit: a larger number is a decoding error there, and a 400 here.
INT64_MAX = 2**63 - 1

# Ollama's own defaults (api/types.go DefaultOptions), which its clients expect when they send none.
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9


class OllamaModel(BaseModel):
    # strict: `true` is not a num_predict and "0.5" is not a temperature (ints still pass as floats)
    model_config = ConfigDict(extra="ignore", strict=True)


class OllamaOptions(OllamaModel):
    """The runtime options of a request; None = Ollama's default."""

    num_ctx: Optional[int] = None
    num_predict: Optional[int] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    repeat_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None

    def check(self) -> None:
        for name in ("num_ctx", "num_predict", "top_k", "seed"):
            value = getattr(self, name)
            if value is not None and not -INT64_MAX - 1 <= value <= INT64_MAX:
                raise InvalidRequestError(f"option {name!r} is out of range for a 64-bit integer: {value}")
        if self.num_ctx is not None and self.num_ctx < 1:
            raise InvalidRequestError(f"option 'num_ctx' must be at least 1, not {self.num_ctx}")


class OllamaFunctionCall(OllamaModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)  # an object, not JSON text (Ollama's form)


class OllamaToolCall(OllamaModel):
    function: OllamaFunctionCall


class OllamaMessage(OllamaModel):
    role: str
    content: Optional[str] = ""
    images: Optional[list[str]] = None
    tool_calls: Optional[list[OllamaToolCall]] = None
    tool_name: Optional[str] = None  # a tool turn: the tool whose result this is
    thinking: Optional[str] = None  # an earlier turn's reasoning (rendered only by templates that read it)


class OllamaToolFunction(OllamaModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class OllamaTool(OllamaModel):
    type: Literal["function"] = "function"
    function: OllamaToolFunction


# `format`: "json", a JSON schema, or "" / absent for free text.
Format = Union[Literal["", "json"], dict[str, Any], None]
# `keep_alive`: a duration ("5m", "30s", "1h"), a number of seconds; negative: never unload.
KeepAlive = Union[str, int, float, None]


class OllamaGenerationRequest(OllamaModel):
    """What /api/chat and /api/generate share."""

    model: Optional[str] = None
    stream: Optional[bool] = True  # Ollama streams unless told not to
    format: Format = None
    options: Optional[OllamaOptions] = None
    keep_alive: KeepAlive = None
    think: Union[bool, str, None] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)

    @property
    def opts(self) -> OllamaOptions:
        return self.options or OllamaOptions()


class OllamaChatRequest(OllamaGenerationRequest):
    messages: Optional[list[OllamaMessage]] = None
    tools: Optional[list[OllamaTool]] = None


class OllamaGenerateRequest(OllamaGenerationRequest):
    prompt: Optional[str] = None
    suffix: Optional[str] = None
    system: Optional[str] = None
    template: Optional[str] = None
    context: Optional[list[int]] = None  # token ids of an earlier response, to continue from
    raw: Optional[bool] = False
    images: Optional[list[str]] = None


class OllamaShowRequest(OllamaModel):
    model: Optional[str] = None
    name: Optional[str] = None  # older clients' name for `model`
    verbose: Optional[bool] = False
