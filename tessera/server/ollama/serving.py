"""Ollama's generation routes on Tessera's port: /api/chat and /api/generate (the model listing
is in models.py, the embeddings in embed.py, the answer's lines in reply.py, the routes in router.py).

Many tools people run beside local models speak Ollama's API rather than OpenAI's (Open WebUI,
Continue, n8n, LangChain's ChatOllama, the `ollama` client). These handlers translate its
requests onto the same path the OpenAI handlers take (`Run`: the router and its fallback rules,
admission and 429, deadlines, abort on disconnect, the engine's metrics and traces) and its
answers back into Ollama's shapes:

- streamed by default, as NDJSON (one JSON object a line, the last one `"done": true` with the
  statistics); `"stream": false` for one object;
- durations in nanoseconds: `total_duration` (the whole request), `load_duration` (waiting for
  the model to load), `prompt_eval_duration` (first scheduled to first token), `eval_duration`
  (first token to last); `prompt_eval_count` is the whole prompt, cached prefix included, and
  `prompt_eval_cached_count` the prefix the cache served (Ollama's fields, its values alike);
- `options` onto SamplingParams with Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9);
  `num_predict` past the context is cut to what the context leaves (Ollama generates until the
  context is full), `num_ctx` bounds prompt + output below the model's own length;
- `format` ("json" or a JSON schema) through xgrammar, `tools` through the tool-calling core
  (tools.py) with each call's `function.arguments` an object, as Ollama returns them; a streamed
  call comes whole in one line once its arguments are complete, as Ollama sends it;
- a model with a reasoning parser returns its reasoning as the message's `thinking` and takes
  `think` (true/false its template's `enable_thinking`, "low"/"medium"/"high" gpt-oss's
  `reasoning_effort`); an earlier turn's `thinking` is its reasoning;
- `keep_alive` onto the router's per-model keep_alive (`ModelRouter.set_keep_alive`), counted
  from the end of the request; a request without it restores the model's configured value;
- errors as `{"error": "..."}` with Ollama's statuses (400 bad request, 404 unknown model, 429,
  503); an error after the stream started is one last `{"error": ...}` line.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tessera.engine.input_processor import check_token_ids
from tessera.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from tessera.server.auth import check_model
from tessera.server.openai.chat import chat_prompt, chat_prompt_text
from tessera.server.errors import APIError, validated
from tessera.server.media import image_token_text, load_images
from tessera.server.openai.protocol import ChatCompletionRequest
from tessera.server.ollama.reply import OllamaReply, Timing
from tessera.server.ollama.protocol import (
    DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, KeepAlive, OllamaChatRequest, OllamaGenerateRequest,
    OllamaGenerationRequest,
)
from tessera.server.served_model import ServedModel
from tessera.server.serving import Run, ServerState, StreamFraming, record_usage, usage_of
from tessera.server.tools import (
    OutputParser, OutputParsing, check_tools, output_parser, tool_choice_mode, tool_constraint,
)

if TYPE_CHECKING:
    from tessera.engine.frontend.protocols import ServingEngine

_LATEST = ":latest"


# ----------------------------------------------------------------------------- errors


def ollama_error(err: APIError) -> JSONResponse:
    """Ollama's error shape: {"error": message}, same status and headers (Retry-After on a 429)."""
    return JSONResponse({"error": err.message}, status_code=err.status, headers=err.headers)


NDJSON = StreamFraming("application/x-ndjson", ollama_error)


async def ollama_guarded(request: Request, handler: Awaitable[Response]) -> Response:
    """Every failure inside a handler becomes an Ollama error response; the server stays up."""
    try:
        return await handler
    except APIError as exc:
        return ollama_error(exc)
    except Exception as exc:
        return ollama_error(request.app.state.tessera.error(exc))


def served_model(state: ServerState, name: Optional[str]) -> ServedModel:
    """The model a request names (Ollama's implicit ":latest" tag accepted); 400 without a name
    and 404 for one this server does not serve, as Ollama answers."""
    if not name:
        raise APIError(400, "model is required", param="model")
    for candidate in (name, name.removesuffix(_LATEST)):
        try:
            return state.router.resolve(candidate)
        except APIError:
            continue
    served = ", ".join(n for n, _ in state.router.names())
    raise APIError(404, f'model "{name}" not found (this server serves: {served})', param="model",
                   code="model_not_found")


def routed_name(name: Optional[str], served: ServedModel) -> str:
    """The name a request for `served` is routed by: the LoRA adapter's when `name` is one of its
    adapters (the engine then runs it through the adapter), else the model's own."""
    adapters = served.adapters()
    for candidate in (name or "", (name or "").removesuffix(_LATEST)):
        if candidate in adapters:
            return candidate
    return served.name


def keep_alive_seconds(value: KeepAlive, served: ServedModel) -> Optional[float]:
    """Seconds the model stays loaded after this request (None: for ever); the model's
    configured keep_alive when the request gives none, as Ollama falls back to its default."""
    from tessera.errors import TesseraError
    from tessera.server.config import parse_duration

    if value is None:
        return served.spec.keep_alive
    if isinstance(value, bool):
        raise InvalidRequestError("keep_alive must be a duration such as \"5m\" or a number of seconds")
    try:
        return parse_duration(value)
    except TesseraError as exc:
        raise InvalidRequestError(f"keep_alive: {exc}") from None


def _refuse_unsupported(body: OllamaGenerationRequest, name: str, thinks: bool = False) -> None:
    """`thinks`: the model's output has a reasoning parser, so `think` means something to it."""
    if body.think not in (None, False, "") and not thinks:
        raise InvalidRequestError(f'"{name}" does not support thinking')


THINK_LEVELS = ("low", "medium", "high")


def _think_kwargs(think: Union[bool, str, None]) -> Optional[dict[str, Any]]:
    """Ollama's `think` as template variables: true/false the hybrid reasoners' `enable_thinking`,
    a level (gpt-oss's "low" / "medium" / "high") its `reasoning_effort`."""
    if think is None or think == "":
        return None
    if isinstance(think, bool):
        return {"enable_thinking": think}
    if think not in THINK_LEVELS:
        raise InvalidRequestError(f"think must be true, false or one of {', '.join(THINK_LEVELS)}")
    return {"enable_thinking": True, "reasoning_effort": think}


# ----------------------------------------------------------------------------- sampling


def _constraint(body: OllamaGenerationRequest) -> Optional[StructuredOutputsParams]:
    fmt = body.format
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=fmt)


def _max_tokens(engine: ServingEngine, body: OllamaGenerationRequest, prompt_len: int) -> int:
    """`num_predict` within the context: num_ctx (at most the model's length and what its KV
    cache holds) minus the prompt. Unset or negative (-1 infinite, -2 fill) is the whole rest."""
    opts = body.opts
    model_len = engine.config.max_model_len
    context = min(model_len, engine.kv_cache_info().get("max_sequence_tokens") or model_len)
    if opts.num_ctx is not None:
        context = min(context, opts.num_ctx)
    if prompt_len >= context:
        raise InvalidRequestError(f"the prompt is {prompt_len} tokens, which leaves no room to generate in a context "
                                  f"of {context} tokens (num_ctx {opts.num_ctx or 'unset'}, the model's "
                                  f"maximum {model_len})")
    room = context - prompt_len
    wanted = opts.num_predict
    return room if wanted is None or wanted <= 0 else min(wanted, room)


def _sampling_params(body: OllamaGenerationRequest, max_tokens: int,
                     structured: Optional[StructuredOutputsParams], keep_special: bool = False) -> SamplingParams:
    opts = body.opts
    opts.check()

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(opts.temperature, DEFAULT_TEMPERATURE),
            top_k=pick(opts.top_k, DEFAULT_TOP_K),
            top_p=pick(opts.top_p, DEFAULT_TOP_P),
            min_p=pick(opts.min_p, 0.0),
            repetition_penalty=pick(opts.repeat_penalty, 1.0),
            presence_penalty=pick(opts.presence_penalty, 0.0),
            frequency_penalty=pick(opts.frequency_penalty, 0.0),
            seed=opts.seed if opts.seed is not None and opts.seed >= 0 else None,  # Ollama: -1 = random
            stop=opts.stop or None,
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            structured_outputs=structured,
            skip_special_tokens=not keep_special,  # the markers of parsers that read special tokens
        )
    except (TypeError, ValueError) as exc:  # InvalidRequestError is a ValueError
        raise InvalidRequestError(f"options: {exc}") from exc


# ----------------------------------------------------------------------------- prompts


def _as_chat_request(messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None
                     ) -> ChatCompletionRequest:
    """Ollama's messages and tools as the OpenAI request the chat template path reads."""
    return validated(ChatCompletionRequest, {"messages": messages, "tools": tools or None})


def _chat_request(body: OllamaChatRequest, name: str) -> ChatCompletionRequest:
    messages = []
    for m in body.messages or []:
        msg: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.images:  # Ollama's base64 strings; the message's images go before its text
            msg["content"] = [_image_part(i) for i in m.images] + [{"type": "text", "text": m.content or ""}]
        if m.thinking:
            msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            msg["tool_calls"] = [{"type": "function", "function": {"name": c.function.name,
                                                                   "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
        if m.tool_name:
            msg["name"] = m.tool_name
        messages.append(msg)
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    request = _as_chat_request(messages, tools)
    request.chat_template_kwargs = _think_kwargs(body.think)
    return request


def _image_part(data: str) -> dict[str, Any]:
    """An Ollama image (base64, no media type: the bytes say what they are) as a chat content part."""
    if not isinstance(data, str):
        raise InvalidRequestError("images must be base64 strings")
    return {"type": "image_url", "image_url": {"url": "data:;base64," + data}}


def _generate_ids(engine: ServingEngine, settings: OutputParsing, body: OllamaGenerateRequest) -> list[int]:
    """The prompt's ids: `context` (an earlier response's), then the prompt through the chat
    template as a user turn after `system`, or as it is with `raw` (or a model without a template)."""
    tokenizer = engine.tokenizer
    context = list(body.context or [])
    if context:
        check_token_ids(context, engine.model_config.vocab_size)
    prompt = body.prompt or ""
    vision = engine.model_config.vision
    image_token = image_token_text(tokenizer, vision) if vision is not None else None
    if body.raw or not tokenizer.chat_template:
        text, special = prompt, not context  # BOS and friends only at the very start
        if body.images:
            if image_token is None:
                raise InvalidRequestError("this model does not take images; it reads text only")
            text = (image_token + "\n") * len(body.images) + text
    else:
        content: Any = prompt
        if body.images:
            content = [_image_part(i) for i in body.images] + [{"type": "text", "text": prompt}]
        messages = ([{"role": "system", "content": body.system}] if body.system else []) \
            + [{"role": "user", "content": content}]
        text, special = chat_prompt_text(tokenizer, settings, _as_chat_request(messages), image_token), False
    return context + tokenizer.encode_bounded(text, engine.config.max_model_len, add_special_tokens=special)


async def _load_or_unload(state: ServerState, request: Request, served: ServedModel, keep: Optional[float],
                          kind: str, timing: Timing, name: str) -> Response:
    """An empty conversation or prompt loads the model (keep_alive 0: unloads it), as Ollama does;
    `name` is the one asked for (an adapter's loads its base)."""
    reply = OllamaReply(kind, name, timing, parser=None, logprobs=False)
    check_model(request.scope, name, name)  # a key may only load or unload its models
    if keep == 0:
        if served.fixed or served.pinned:
            raise APIError(400, f'"{served.name}" stays loaded: it is this server\'s own engine, which '
                                "only stopping the server unloads")
        if served.engine is not None:
            await asyncio.to_thread(state.router.unload, served, "keep_alive 0")
        return JSONResponse({**reply._piece("", [], None, done=True), "done_reason": "unload"})
    route = await state.route(name, request, fallback=False, generates=False)
    timing.load = time.perf_counter_ns() - timing.start
    state.router.set_keep_alive(route.model, keep)
    return JSONResponse({**reply._piece("", [], None, done=True), "done_reason": "load"},
                        headers=route.headers())


async def _answer(state: ServerState, request: Request, body: OllamaGenerationRequest, served: ServedModel,
                  kind: str, timing: Timing, prompt: Callable[[ServingEngine], list[int]],
                  constraint: Optional[StructuredOutputsParams],
                  parser: Optional[Callable[[], OutputParser]], keep_special: bool = False,
                  image_urls: Optional[list[str]] = None) -> Response:
    """Route, tokenize, run and answer (streamed or whole); keep_alive applies once it is done.
    `image_urls`: the prompt's images, in order."""
    keep = keep_alive_seconds(body.keep_alive, served)
    route = await state.route(routed_name(body.model, served), request)
    timing.load = time.perf_counter_ns() - timing.start
    run: Optional[Run] = None
    try:
        engine = route.model.engine
        if engine is None:
            raise APIError(503, f'model "{route.model.name}" was unloaded; retry', type="server_error")
        images = await load_images(image_urls or [], engine.model_config.vision, route.reported, state.media)
        ids = prompt(engine)
        params = _sampling_params(body, _max_tokens(engine, body, len(ids)), constraint, keep_special)
        run = Run(state, request, route, [ids], params, f"ollama-{uuid.uuid4().hex}",
                  reprompt=lambda other: [prompt(other)], images=images)
        reply = OllamaReply(kind, route.reported, timing, parser() if parser else None, bool(body.logprobs))
        if body.stream is not False:
            return await run.stream(reply, NDJSON)
        finals = await run.collect()
        if isinstance(finals, Response):
            return finals
        usage = usage_of(finals)
        record_usage(request, usage)
        return run.json(reply.whole(finals[0]))
    finally:
        state.router.set_keep_alive(run.route.model if run is not None else route.model, keep)


async def chat(body: OllamaChatRequest, request: Request) -> Response:
    timing = Timing(time.perf_counter_ns())
    state: ServerState = request.app.state.tessera
    served = served_model(state, body.model)
    settings = served.output_parsing  # the model's syntaxes, in the prompt, grammar and parsers
    _refuse_unsupported(body, served.name, thinks=settings.reasoning is not None)
    if not body.messages:
        return await _load_or_unload(state, request, served, keep_alive_seconds(body.keep_alive, served), "chat", timing,
                                     routed_name(body.model, served))
    chat_body = _chat_request(body, served.name)
    constraint = _constraint(body)
    parse_tools = tool_choice_mode(chat_body.tools, None) != "none"
    if parse_tools:
        assert chat_body.tools
        check_tools(chat_body.tools)
        if constraint is not None:
            raise InvalidRequestError("format cannot be combined with tools")
    rendered: dict[str, str] = {}  # the prompt text, which says whether the template opened a think block

    def prompt(engine: ServingEngine) -> list[int]:
        rendered["text"], ids = chat_prompt(engine, settings, chat_body)
        return ids

    if parse_tools:
        assert chat_body.tools
        constraint = tool_constraint(chat_body.tools, None, True, settings)
    tools = chat_body.tools or ()
    # Reasoning goes to the message's `thinking`, as Ollama returns a thinking model's.
    reads = parse_tools or settings.reasoning is not None or settings.harmony
    return await _answer(state, request, body, served, "chat", timing, prompt, constraint,
                         (lambda: output_parser(settings, parse_tools, tools=tools, prompt=rendered.get("text", "")))
                         if reads else None, keep_special=settings.keeps_special_tokens(parse_tools),
                         image_urls=chat_body.image_urls())


async def generate(body: OllamaGenerateRequest, request: Request) -> Response:
    timing = Timing(time.perf_counter_ns())
    state: ServerState = request.app.state.tessera
    served = served_model(state, body.model)
    _refuse_unsupported(body, served.name)
    if body.suffix:
        raise InvalidRequestError(f'"{served.name}" does not support insert')
    if body.template:
        raise InvalidRequestError("template overrides are not supported: Tessera renders the model's own chat "
                                  "template; send raw: true with a prompt formatted as you want it")
    if not body.prompt:
        return await _load_or_unload(state, request, served, keep_alive_seconds(body.keep_alive, served), "generate",
                                     timing, routed_name(body.model, served))
    return await _answer(state, request, body, served, "generate", timing,
                         lambda engine: _generate_ids(engine, served.output_parsing, body), _constraint(body),
                         parser=None, image_urls=[_image_part(i)["image_url"]["url"] for i in body.images or []])
