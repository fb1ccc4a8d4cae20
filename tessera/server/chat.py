"""POST /v1/chat/completions: messages through the model's chat template, OpenAI chat objects out."""
from __future__ import annotations

import time
import uuid
from typing import Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tessera.engine.outputs import RequestOutput, TokenLogprob
from tessera.sampling_params import InvalidRequestError
from tessera.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                     ChatCompletionResponse, ChatLogprobs, ChatResponseMessage, ChatTokenLogprob,
                                     DeltaMessage, TopLogprob, UsageInfo)
from tessera.server.serving import Run, ServerState, clamp_logprob, record_usage, sse, usage_of


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


class ChatStream:
    """SSE events for a streamed chat completion: a role delta per choice first, then content deltas,
    then a chunk with an empty delta and the finish reason."""

    def __init__(self, request_id: str, model: str, n: int, num_logprobs: Optional[int],
                 include_usage: bool) -> None:
        self.request_id, self.model, self.n = request_id, model, n
        self.num_logprobs = num_logprobs
        self.include_usage = include_usage
        self.created = int(time.time())
        self.finished: set[int] = set()

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
            if c.delta_text or c.delta_logprobs:
                logprobs = (chat_logprobs(c.delta_logprobs or [], self.num_logprobs)
                            if self.num_logprobs is not None else None)
                events.append(self._chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(content=c.delta_text),
                                                           logprobs=logprobs)]))
            if c.finished:
                self.finished.add(c.index)
                events.append(self._chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(),
                                                           finish_reason=c.finish_reason,
                                                           stop_reason=c.stop_reason)]))
        return events

    def finish(self, usage: UsageInfo) -> list[str]:
        return [self._chunk([], usage)] if self.include_usage else []


def _prompt_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    tokenizer = state.engine.tokenizer
    try:
        text = tokenizer.apply_chat_template(body.template_messages(),
                                             add_generation_prompt=body.add_generation_prompt is not False)
    except InvalidRequestError:
        raise
    except Exception as exc:  # jinja templates raise for e.g. roles they do not know or a bad order
        raise InvalidRequestError(f"the model's chat template rejected these messages: {exc}") from exc
    ids = tokenizer.encode(text, add_special_tokens=False)  # the template already has BOS and friends
    if not ids:
        raise InvalidRequestError("the chat template produced an empty prompt")
    return ids


async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state: ServerState = request.app.state.tessera
    model = state.check_model(body.model)
    num_logprobs = body.num_logprobs()
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = body.to_sampling_params(max_tokens=max_tokens, logprobs=num_logprobs)
    prompt = _prompt_ids(state, body)
    run = Run(state, request, [prompt], params, f"chatcmpl-{uuid.uuid4().hex}")

    if body.stream:
        return await run.stream(ChatStream(run.request_id, model, params.n, num_logprobs, body.include_usage))
    finals: Union[dict[int, RequestOutput], Response] = await run.collect()
    if isinstance(finals, Response):
        return finals
    choices = [
        ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                   logprobs=chat_logprobs(c.logprobs or [], num_logprobs) if num_logprobs is not None else None,
                   finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in sorted(finals[0].outputs, key=lambda c: c.index)
    ]
    usage = usage_of(finals)
    record_usage(request, usage)
    response = ChatCompletionResponse(id=run.request_id, model=model, choices=choices, usage=usage)
    return JSONResponse(response.model_dump(mode="json"))
