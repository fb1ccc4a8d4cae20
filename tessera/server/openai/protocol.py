"""OpenAI API request and response schemas (the subset Tessera serves); their base classes are in
schema_base.py, the tools' schemas in tool_schemas.py.

Requests ignore fields they do not know, as OpenAI and vLLM do, but a known
field with the wrong type fails validation (the app turns that into a 400).
Range checks live in SamplingParams so the engine and the server agree on them.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from tessera.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from tessera.server.openai.schema_base import OpenAIModel
from tessera.server.openai.tool_schemas import (ChatTool, CustomChatTool, NamedCustomToolChoice, NamedToolChoice,
                                                OtherToolChoice, RequestTool, ToolCallIn, freeform_function)

# Largest n one request may ask for (OpenAI's own limit); keeps one request from flooding the engine.
MAX_N = 128


# How to describe the fields whose type is a union, when a value fits none of its members.
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "input": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
    "tool_choice": "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
}


# ----------------------------------------------------------------------------- requests


class StreamOptions(OpenAIModel):
    include_usage: Optional[bool] = False


class JSONSchemaSpec(OpenAIModel):
    """`response_format.json_schema`: OpenAI's wrapper around the schema itself."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaSpec] = None


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Union[dict[str, Any], str, None] = None
    disable_any_whitespace: Optional[bool] = None


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
    logit_bias: Optional[dict[str, float]] = None  # token id (as text) -> bias in [-100, 100]
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
    # vLLM extension: lower runs earlier under --scheduling-policy priority; None: the API key's default.
    priority: Optional[int] = None
    user: Optional[str] = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _logit_bias(self) -> Optional[dict[int, float]]:
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not key.strip().isdigit():
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}")
            out[int(key)] = value
        return out

    def structured_constraint(self) -> Optional[StructuredOutputsParams]:
        """The one output constraint this request asks for, from whichever field it used."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format of type json_schema needs json_schema.schema")
            found.append(("response_format", StructuredOutputsParams(json=rf.json_schema.schema_)))
        so = self.structured_outputs
        if so is not None:
            tag = so.structural_tag
            found.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=bool(so.json_object),
                structural_tag=json.dumps(tag) if isinstance(tag, dict) else tag,
                disable_any_whitespace=bool(so.disable_any_whitespace))))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, StructuredOutputsParams(**{kind: value})))
        if len(found) > 1:
            raise InvalidRequestError("give one output constraint, not several: "
                                      + ", ".join(name for name, _ in found))
        return found[0][1] if found else None

    def to_sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                           structured: Optional[StructuredOutputsParams] = None,
                           default_priority: int = 0) -> SamplingParams:
        """Build the engine's settings; raises InvalidRequestError for out-of-range values.
        `structured` is the output constraint (the request's own, or one its tools imply);
        `default_priority` applies where the request names none (its API key's)."""
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
                structured_outputs=structured,
                logit_bias=self._logit_bias(),
                priority=pick(self.priority, default_priority),
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
        return prompt_list(self.prompt, "prompt")


def prompt_list(value: Prompt, field: str) -> list[Union[str, list[int]]]:
    """A string, list of strings, token ids or list of token-id lists (`prompt`, embeddings'
    `input`) as a list of engine prompts; a 400 naming `field` when it or an entry is empty."""
    if isinstance(value, str):
        items: list[Union[str, list[int]]] = [value]
    elif value and all(isinstance(x, int) for x in value):
        items = [list(value)]  # type: ignore[arg-type]
    else:
        items = list(value)  # type: ignore[arg-type]
    if not items or any(len(x) == 0 for x in items):
        raise InvalidRequestError(f"{field} must not be empty")
    return items


class ImageURL(OpenAIModel):
    url: str
    detail: Optional[str] = None  # OpenAI's resolution hint: every image is processed at the model's size


class TextPart(OpenAIModel):
    """A content part: text, or an image (`image_url`, its URL as an object or, as vLLM takes it, a string)."""

    type: str
    text: Optional[str] = None
    image_url: Union[ImageURL, str, None] = None

    def url(self) -> str:
        if self.image_url is None:
            raise InvalidRequestError("a content part of type 'image_url' needs an 'image_url' field")
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class ChatMessage(OpenAIModel):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None  # an assistant turn that called tools
    tool_call_id: Optional[str] = None  # a tool turn: which call this is the result of
    # An assistant turn's reasoning sent back (vLLM's and llama.cpp's field, and vLLM's newer name).
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    def image_urls(self) -> list[str]:
        """Its images' URLs, in order (images are taken in user turns only)."""
        if self.content is None or isinstance(self.content, str):
            return []
        urls = [p.url() for p in self.content if p.type == "image_url"]
        if urls and self.role != "user":
            raise InvalidRequestError(f"images are taken in user messages only, not in a {self.role!r} message")
        return urls

    def template_content(self) -> Union[str, list[dict[str, Any]]]:
        """The content as a chat template reads it: one string, or with images the parts in order
        (`{"type": "text", "text": ...}` and `{"type": "image"}`, as transformers' processors
        hand them to a model's template)."""
        if self.content is None or isinstance(self.content, str) or not any(
                p.type == "image_url" for p in self.content):
            return self.text()
        parts: list[dict[str, Any]] = []
        for part in self.content:
            if part.type == "image_url":
                parts.append({"type": "image"})
            elif part.type != "refusal":
                parts.append({"type": "text", "text": self._part_text(part)})
        return parts

    def text(self) -> str:
        """The message content as one string (text parts only)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(self._part_text(p) for p in self.content if p.type != "refusal")

    @staticmethod
    def _part_text(part: TextPart) -> str:
        if part.type == "image_url":
            raise InvalidRequestError("an image is taken in a user message's content only")
        if part.type != "text":
            raise InvalidRequestError(
                f"content parts of type {part.type!r} are not supported; send text parts and image_url parts")
        if part.text is None:
            raise InvalidRequestError("a content part of type 'text' needs a 'text' field")
        return part.text


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: Optional[bool] = True  # vLLM extension
    # After validation, function tools only: a freeform tool as its function (freeform_function),
    # hosted tools left out (ignored_tools names them).
    tools: Optional[list[RequestTool]] = None  # type: ignore[assignment]
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, NamedCustomToolChoice, OtherToolChoice,
                       None] = None
    parallel_tool_calls: Optional[bool] = True
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM extension: template variables (enable_thinking)
    reasoning_effort: Optional[str] = None  # "low" | "medium" | "high": the template's `reasoning_effort`
    _ignored_tools: list[str] = PrivateAttr(default_factory=list)
    _freeform_tools: frozenset[str] = PrivateAttr(default_factory=frozenset)

    @model_validator(mode="after")
    def _function_tools(self) -> "ChatCompletionRequest":
        """Every tool as the function the model is offered; see HostedTool and CustomToolSpec."""
        if self.tools is not None:
            functions: list[ChatTool] = []
            for tool in self.tools:
                if isinstance(tool, ChatTool):
                    functions.append(tool)
                elif isinstance(tool, CustomChatTool):
                    functions.append(freeform_function(tool.custom))
                    self._freeform_tools = self._freeform_tools | {tool.custom.name}
                else:
                    self._ignored_tools.append(tool.type)
            self.tools = functions or None  # type: ignore[assignment]
        choice = self.tool_choice
        if isinstance(choice, NamedCustomToolChoice):
            self.tool_choice = NamedToolChoice(type="function", function=choice.custom)
        elif isinstance(choice, OtherToolChoice):
            self.tool_choice = "auto" if self.tools else None
        return self

    @property
    def ignored_tools(self) -> list[str]:
        """The hosted tools this request offered, which the model is not shown."""
        return list(self._ignored_tools)

    @property
    def freeform_tools(self) -> frozenset[str]:
        """Names of the freeform (custom) tools, whose calls carry text rather than arguments."""
        return self._freeform_tools

    def function_tools(self) -> list[ChatTool]:
        return list(self.tools or [])  # type: ignore[arg-type]

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        """The template variables of this request: `reasoning_effort` (which gpt-oss's harmony
        template writes into its system message) under any `chat_template_kwargs` it sends."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as chat templates read them: tool-call arguments as objects (Hugging Face's
        convention; OpenAI clients send them as JSON text); an assistant turn's reasoning as
        `reasoning_content` (which render_prompt gives only the templates that read it)."""
        if not self.messages:
            raise InvalidRequestError("messages must not be empty")
        out: list[dict[str, Any]] = []
        for m in self.messages:
            # OpenAI's newer name for the system role; templates know only "system".
            role = "system" if m.role == "developer" else m.role
            msg: dict[str, Any] = {"role": role, "content": m.template_content() if role == "user" else m.text()}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning and role == "assistant":
                msg["reasoning_content"] = reasoning
            if m.tool_calls:
                calls = []
                for call in m.tool_calls:
                    function = call.as_function()
                    args: Any = function.arguments
                    if isinstance(args, str):
                        try:
                            args = json.loads(args) if args.strip() else {}
                        except json.JSONDecodeError:
                            raise InvalidRequestError(
                                f"tool call {function.name!r}: arguments are not valid JSON") from None
                    calls.append({"id": call.id, "type": "function",
                                  "function": {"name": function.name, "arguments": args}})
                msg["tool_calls"] = calls
            out.append(msg)
        return out

    def image_urls(self) -> list[str]:
        """Every image of the conversation, in order (the order of the prompt's image tokens)."""
        return [url for m in self.messages for url in m.image_urls()]

    def num_logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None


# Names a range error from SamplingParams may start with, to report as the error's param.
REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)
