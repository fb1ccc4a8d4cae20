"""OpenAI API schemas of tools: the tools a request offers (functions, freeform tools, hosted
tools it ignores), tool choices, and tool calls, the model's and a client's earlier ones."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag

from tessera.sampling_params import InvalidRequestError
from tessera.server.openai.schema_base import OpenAIModel, SparseModel


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class CustomCall(OpenAIModel):
    name: str
    input: str


class ToolCall(SparseModel):
    """A call the model made: a function's (JSON arguments) or a freeform tool's (its text)."""

    id: str
    type: Literal["function", "custom"] = "function"
    function: Optional[FunctionCall] = None
    custom: Optional[CustomCall] = None

    @classmethod
    def of(cls, call_id: str, name: str, arguments: str, freeform: frozenset[str]) -> "ToolCall":
        if name in freeform:
            return cls(id=call_id, type="custom", custom=CustomCall(name=name, input=freeform_input(arguments)))
        return cls(id=call_id, function=FunctionCall(name=name, arguments=arguments))


def freeform_input(arguments: str) -> str:
    """A freeform tool's text from the arguments the model wrote for its function
    (freeform_function); text that is not such an object is taken as it is."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments
    value = parsed.get(FREEFORM_ARGUMENT) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


class FunctionCallIn(OpenAIModel):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class CustomCallIn(OpenAIModel):
    name: str
    input: str = ""


class ToolCallIn(OpenAIModel):
    """A tool call of an earlier assistant turn, as a client sends it back (a freeform tool's
    call as `custom` with its input text)."""

    id: Optional[str] = None
    type: Literal["function", "custom"] = "function"
    function: Optional[FunctionCallIn] = None
    custom: Optional[CustomCallIn] = None

    def as_function(self) -> FunctionCallIn:
        if self.custom is not None:
            return FunctionCallIn(name=self.custom.name, arguments={FREEFORM_ARGUMENT: self.custom.input})
        if self.function is None:
            raise InvalidRequestError("a tool call needs its 'function' (or 'custom' for a freeform tool)")
        return self.function


# Tool names: OpenAI's characters, and room for the long names agents give MCP tools
# (`mcp__server__tool`, a namespace joined to its function's name).
TOOL_NAME = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:\-]+$")


class FunctionDefinition(OpenAIModel):
    name: str = TOOL_NAME
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class CustomToolSpec(OpenAIModel):
    """A freeform tool: its input is text (a patch, a query) rather than JSON arguments. A
    grammar `format` is accepted and not enforced: the input is constrained to a string."""

    name: str = TOOL_NAME
    description: Optional[str] = None
    format: Optional[dict[str, Any]] = None


class CustomChatTool(OpenAIModel):
    type: Literal["custom"]
    custom: CustomToolSpec


class HostedTool(OpenAIModel):
    """A tool the provider itself runs (web_search, file_search, code_interpreter, image_generation,
    computer_use, mcp, local_shell, Anthropic's server tools): this server runs none of them, so
    it leaves them out of what the model sees and says so (IGNORED_TOOLS_HEADER), as the
    servers agents are pointed at do, rather than refusing the request."""

    type: str


# The argument a freeform tool's call carries its text in, as the model sees the tool.
FREEFORM_ARGUMENT = "input"
# The response header naming the tools a request offered that the model was not shown.
IGNORED_TOOLS_HEADER = "x-tessera-ignored-tools"


def freeform_function(spec: CustomToolSpec) -> ChatTool:
    """A freeform tool as the model is offered it: a function of one string argument."""
    what = "The tool's whole input, as text."
    fmt = spec.format or {}
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        what += f" It follows this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    return ChatTool(type="function", function=FunctionDefinition(
        name=spec.name, description=spec.description,
        parameters={"type": "object", "properties": {FREEFORM_ARGUMENT: {"type": "string", "description": what}},
                    "required": [FREEFORM_ARGUMENT], "additionalProperties": False}))


def _request_tool_kind(value: Any) -> Optional[str]:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in ("function", "custom"):
        return kind
    return "hosted" if isinstance(kind, str) else None


RequestTool = Annotated[
    Union[Annotated[ChatTool, Tag("function")], Annotated[CustomChatTool, Tag("custom")],
          Annotated[HostedTool, Tag("hosted")]],
    Discriminator(_request_tool_kind, custom_error_type="invalid_tool",
                  custom_error_message="a tool must be an object with a string 'type' ('function', 'custom', "
                                       "or a hosted tool's type, which is ignored)"),
]


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class NamedCustomToolChoice(OpenAIModel):
    type: Literal["custom"]
    custom: NamedFunction


class OtherToolChoice(OpenAIModel):
    """`allowed_tools` or a hosted tool's choice: the model chooses among what it is shown."""

    type: Literal["allowed_tools", "allowed-tools"]
