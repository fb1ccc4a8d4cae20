"""POST /v1/chat/completions: messages through the model's chat template, OpenAI chat objects out."""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import TYPE_CHECKING, Callable, Optional, Union

from fastapi import Request
from fastapi.responses import Response

from tessera.engine.outputs import RequestOutput, TokenLogprob
from tessera.sampling_params import InvalidRequestError, SamplingParams
from tessera.server.auth import request_priority
from tessera.server.media import image_token_text, images_as_text, load_images, template_reads_images
from tessera.server.openai.protocol import ChatCompletionRequest
from tessera.server.openai.tool_schemas import IGNORED_TOOLS_HEADER, ToolCall
from tessera.server.openai.response_models import (
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs, ChatResponseMessage,
    ChatTokenLogprob, DeltaFunctionCall, DeltaMessage, DeltaToolCall, TopLogprob, UsageInfo,
)
from tessera.server.serving import DONE, Run, ServerState, StreamRenderer, clamp_logprob, record_usage, sse, usage_of

if TYPE_CHECKING:
    from tessera.engine.frontend.protocols import ServingEngine
    from tessera.tokenizer import Tokenizer

from tessera.server.tools import (
    OutputParser, OutputParsing, ParserEvent, check_tools, output_parser, render_prompt, tool_choice_mode,
    tool_constraint,
)


def chat_logprobs(entries: list[TokenLogprob], num_top: int) -> ChatLogprobs:
    """OpenAI's chat format: one object per generated token, with its `num_top` best alternatives."""
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=e.token, logprob=clamp_logprob(e.logprob), bytes=list(e.token.encode("utf-8")),
            top_logprobs=[TopLogprob(token=text, logprob=clamp_logprob(lp), bytes=list(text.encode("utf-8")))
                          for _, text, lp in e.top[:num_top]],
        )
        for e in entries
    ])


def _finish_reason(reason: Optional[str], parser: OutputParser) -> Optional[str]:
    """OpenAI says "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if parser.calls and reason == "stop" else reason


def _delta(event: ParserEvent) -> DeltaMessage:
    """The chunk delta of a parser event (a freeform tool's call goes whole, see ChatStream)."""
    if event.kind == "content":
        return DeltaMessage(content=event.text)
    if event.kind == "reasoning":
        return DeltaMessage(reasoning_content=event.text, reasoning=event.text)
    if event.kind == "call":
        assert event.call is not None
        return DeltaMessage(tool_calls=[DeltaToolCall(index=event.index, id=event.call.id, type="function",
                                                      function=DeltaFunctionCall(name=event.call.name,
                                                                                 arguments=""))])
    return DeltaMessage(tool_calls=[DeltaToolCall(index=event.index, function=DeltaFunctionCall(arguments=event.text))])


class ChatStream(StreamRenderer):
    """SSE events for a streamed chat completion: a role delta per choice first, then content (or
    tool-call) deltas, then a chunk with an empty delta and the finish reason."""

    def __init__(self, request_id: str, model: str, n: int, num_logprobs: Optional[int],
                 include_usage: bool, parsers: Callable[[], OutputParser],
                 freeform: frozenset[str] = frozenset()) -> None:
        self.request_id, self.model, self.n = request_id, model, n
        self.num_logprobs = num_logprobs
        self.include_usage = include_usage
        self.created = int(time.time())
        self.finished: set[int] = set()
        self.parsers = {i: parsers() for i in range(n)}
        self.freeform = freeform  # tools whose calls carry text: sent whole once written
        self.held: dict[int, set[int]] = {i: set() for i in range(n)}  # per choice, calls of freeform tools

    def _deltas(self, choice: int, parser: OutputParser, events: list[ParserEvent],
                finished: bool) -> list[DeltaMessage]:
        """Chunk deltas for the parser's events; a freeform tool's call is held back and sent
        whole (its text, not the JSON it was written as) when the output ends."""
        held = self.held[choice]
        out = []
        for e in events:
            if e.kind == "call" and e.call is not None and e.call.name in self.freeform:
                held.add(e.index)
            elif e.kind in ("content", "reasoning") or e.index not in held:
                out.append(_delta(e))
        if finished:
            for index in sorted(held):
                call = parser.calls[index]
                tool = ToolCall.of(call.id, call.name, call.arguments, self.freeform)
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=call.id, type="custom",
                                                                  custom=tool.custom)]))
        return out

    def _chunk(self, choices: list[ChatChunkChoice], usage: Optional[UsageInfo] = None) -> str:
        chunk = ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                    usage=usage)
        return sse(chunk.model_dump_json(exclude=None if self.include_usage else {"usage"}))

    def start(self) -> list[str]:
        return [self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(self.n)]

    def render(self, prompt_index: int, output: RequestOutput) -> list[str]:
        events = []
        for c in output.outputs:
            if c.index in self.finished:
                continue
            logprobs = (chat_logprobs(c.delta_logprobs or [], self.num_logprobs)
                        if self.num_logprobs is not None and c.delta_logprobs else None)
            parser = self.parsers[c.index]
            deltas = self._deltas(c.index, parser, parser.feed(c.delta_text) + (parser.finish() if c.finished else []),
                                  c.finished)
            if logprobs is not None and not deltas:
                deltas = [DeltaMessage()]
            for i, delta in enumerate(deltas):  # the step's logprobs ride on its first chunk
                events.append(self._chunk([ChatChunkChoice(index=c.index, delta=delta,
                                                           logprobs=logprobs if i == 0 else None)]))
            if c.finished:
                self.finished.add(c.index)
                events.append(self._chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(),
                                                           finish_reason=_finish_reason(c.finish_reason, parser),
                                                           stop_reason=c.stop_reason)]))
        return events

    def finish(self, usage: UsageInfo) -> list[str]:
        return ([self._chunk([], usage)] if self.include_usage else []) + [DONE]


def chat_prompt_text(tokenizer: Tokenizer, settings: OutputParsing, body: ChatCompletionRequest,
                     image_token: Optional[str] = None) -> str:
    """The conversation (and its tools, in the model's tool-call syntax) through the chat template
    (the model's, or the server's --chat-template); /tokenize and Ollama's API render chats here too.
    Images go where their content parts are, for a template that renders image parts; otherwise
    each message's images go before its text as `image_token` (None: the model takes no images)."""
    messages = body.template_messages()
    if any(isinstance(m.get("content"), list) for m in messages):
        if image_token is None:
            raise InvalidRequestError("this model does not take images; it reads text only")
        if not template_reads_images(settings.template(tokenizer.chat_template)):
            messages = images_as_text(messages, image_token)
    return render_prompt(tokenizer, settings, messages, body.tools,
                         add_generation_prompt=body.add_generation_prompt is not False,
                         template_kwargs=body.template_kwargs())


def chat_prompt(engine: ServingEngine, settings: OutputParsing, body: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The rendered prompt (text, which the parsers read too) and its token ids."""
    vision = engine.model_config.vision
    text = chat_prompt_text(engine.tokenizer, settings, body,
                            image_token_text(engine.tokenizer, vision) if vision is not None else None)
    # The template already has BOS and friends.
    ids = engine.tokenizer.encode_bounded(text, engine.config.max_model_len, add_special_tokens=False)
    if not ids:
        raise InvalidRequestError("the chat template produced an empty prompt")
    return text, ids


def fit_context(params: SamplingParams, prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """`max_tokens` as a ceiling: where the prompt leaves less room in the context, the output
    stops at the context's end (finish reason "length"), as llama.cpp's and Ollama's servers
    do, rather than refusing the request. Agents ask for the most their model could ever write
    (Claude Code 32,000 tokens) whatever the prompt's length."""
    room = max_model_len - prompt_tokens
    if params.max_tokens is not None and params.max_tokens > room > 0:
        return dataclasses.replace(params, max_tokens=room)
    return params


async def chat_run(body: ChatCompletionRequest, request: Request,
                   request_id: str) -> tuple[Run, bool, Callable[[], OutputParser]]:
    """What every chat-shaped API does before generating (chat completions here, and the
    Responses and Messages APIs, which translate their requests into this one): the model, the
    output constraint (the tools' or the request's own), the sampling params and the prompt
    through the chat template. Also returns whether the output is parsed for tool calls, and
    what makes a parser for each sequence of the output."""
    state: ServerState = request.app.state.tessera
    state.router.resolve(body.model)  # 404 before anything else
    num_logprobs = body.num_logprobs()
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    constraint = body.structured_constraint()
    mode = tool_choice_mode(body.tools, body.tool_choice)
    parse_tools = mode != "none"
    if parse_tools:
        assert body.tools
        check_tools(body.tools)
        if constraint is not None:
            raise InvalidRequestError("tool calling cannot be combined with response_format or structured "
                                      "outputs; set tool_choice to 'none' to use them with tools")
    params = body.to_sampling_params(max_tokens=max_tokens, logprobs=num_logprobs, structured=constraint,
                                     default_priority=request_priority(request.scope, None))
    route = await state.route(body.model, request)
    settings = route.model.output_parsing
    run = Run(state, request, route, [], params, request_id,
              reprompt=lambda engine: [chat_prompt(engine, settings, body)[1]])
    run.images = await load_images(body.image_urls(), run.engine.model_config.vision, route.reported, state.media)
    prompt_text, prompt_ids = chat_prompt(run.engine, settings, body)
    run.prompts = [prompt_ids]
    run.params = fit_context(params, len(prompt_ids), run.engine.config.max_model_len)
    if body.ignored_tools:
        run.headers[IGNORED_TOOLS_HEADER] = ", ".join(dict.fromkeys(body.ignored_tools))
    if parse_tools:  # the constraint is in the syntax of the parser of the model that answers
        assert body.tools
        run.params = dataclasses.replace(
            run.params, structured_outputs=tool_constraint(body.tools, body.tool_choice,
                                                       body.parallel_tool_calls is not False, settings, prompt_text))
    if settings.keeps_special_tokens(parse_tools):  # parsers whose markers are special tokens need them in the text
        run.params = dataclasses.replace(run.params, skip_special_tokens=False)
    tools = body.tools or ()
    return run, parse_tools, lambda: output_parser(settings, parse_tools, tools=tools, prompt=prompt_text)


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    run, parse_tools, parser = await chat_run(body, request, f"chatcmpl-{uuid.uuid4().hex}")
    params, num_logprobs = run.params, body.num_logprobs()

    if body.stream:
        return await run.stream(ChatStream(run.request_id, model=run.route.reported, n=params.n,
                                           num_logprobs=num_logprobs, include_usage=body.include_usage,
                                           parsers=parser, freeform=body.freeform_tools))
    finals: Union[dict[int, RequestOutput], Response] = await run.collect()
    if isinstance(finals, Response):
        return finals
    choices = []
    for c in sorted(finals[0].outputs, key=lambda c: c.index):
        p = parser()
        p.feed(c.text)
        p.finish()
        reasoning = p.reasoning or None
        message = ChatResponseMessage(
            content=p.content or (None if parse_tools else ""),
            tool_calls=[ToolCall.of(call.id, call.name, call.arguments, body.freeform_tools) for call in p.calls],
            reasoning_content=reasoning, reasoning=reasoning)
        choices.append(ChatChoice(
            index=c.index, message=message,
            logprobs=chat_logprobs(c.logprobs or [], num_logprobs) if num_logprobs is not None else None,
            finish_reason=_finish_reason(c.finish_reason, p), stop_reason=c.stop_reason))
    usage = usage_of(finals)
    record_usage(request, usage)
    response = ChatCompletionResponse(id=run.request_id, model=run.route.reported, choices=choices, usage=usage)
    return run.json(response.model_dump(mode="json"))
