"""POST /tokenize and POST /detokenize in vLLM's shapes, for clients that count and budget tokens.

/tokenize takes a `prompt` (special tokens added unless `add_special_tokens` is false) or
`messages` (rendered by the model's chat template with its `tools`, the generation prompt
unless `add_generation_prompt` is false; no special tokens added, the template writes them)
and answers {"count", "max_model_len", "tokens"} (+ "token_strs" with `return_token_strs`).
Unlike a generation request, a text longer than the model's context is counted, not refused:
knowing how far over it is is the point. /detokenize turns {"tokens": [...]} back into
{"prompt": text}, special tokens kept, so the two round-trip; an id outside the vocabulary is a 400.
Errors are OpenAI-shaped, as vLLM's are. Neither touches the engine: only the model's tokenizer.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tessera.engine.input_processor import check_token_ids
from tessera.sampling_params import InvalidRequestError
from tessera.server.openai.chat import chat_prompt_text
from tessera.server.errors import APIError
from tessera.server.openai.protocol import ChatCompletionRequest, ChatMessage
from tessera.server.openai.schema_base import OpenAIModel
from tessera.server.openai.tool_schemas import ChatTool
from tessera.server.tools import OutputParsing

if TYPE_CHECKING:
    from tessera.engine.frontend.protocols import ServingEngine
    from tessera.server.serving import ServerState


class TokenizeRequest(OpenAIModel):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: `prompt` or `messages`."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # default: true for a prompt, false for messages
    add_generation_prompt: Optional[bool] = True
    continue_final_message: Optional[bool] = False
    tools: Optional[list[ChatTool]] = None
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[int]


async def _engine(state: ServerState, model: Optional[str], request: Request) -> tuple[ServingEngine, OutputParsing]:
    """The named model's engine, loaded, and how its prompts are rendered; never a fallback
    (another model has another tokenizer)."""
    route = await state.route(model, request, fallback=False, generates=False)
    engine = route.model.engine
    if engine is None:
        raise APIError(503, f"Model {route.model.name!r} was unloaded; retry.", type="server_error",
                       code="model_unavailable")
    return engine, route.model.output_parsing


def _text(engine: ServingEngine, settings: OutputParsing, body: TokenizeRequest) -> tuple[str, bool]:
    """The text to encode and whether to add special tokens to it."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if body.prompt is not None:
        if body.tools:
            raise APIError(400, "tools go with messages, not with a prompt", param="tools")
        return body.prompt, body.add_special_tokens is not False
    if body.continue_final_message:
        raise APIError(400, "continue_final_message is not supported", param="continue_final_message")
    chat = ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                 add_generation_prompt=body.add_generation_prompt)
    return chat_prompt_text(engine.tokenizer, settings, chat), bool(body.add_special_tokens)


async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    state: ServerState = request.app.state.tessera
    engine, settings = await _engine(state, body.model, request)
    text, special = _text(engine, settings, body)
    tokenizer = engine.tokenizer
    ids = await asyncio.to_thread(tokenizer.encode, text, special)  # a 16 MiB body takes a while
    out = {"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(out)


async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    state: ServerState = request.app.state.tessera
    engine, _ = await _engine(state, body.model, request)
    tokenizer = engine.tokenizer
    try:
        check_token_ids(body.tokens, tokenizer.vocab_size)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc).replace("prompt token ids", "tokens"), param="tokens") from None
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
    return JSONResponse({"prompt": text})
