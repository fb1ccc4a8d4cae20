"""POST /v1/completions: raw prompts in, OpenAI `text_completion` objects out."""
from __future__ import annotations

import time
import uuid
from typing import Optional, Union

from fastapi import Request
from fastapi.responses import Response

from tessera.engine.input_processor import check_token_ids
from tessera.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tessera.sampling_params import InvalidRequestError
from tessera.server.auth import request_priority
from tessera.server.openai.protocol import CompletionRequest
from tessera.server.openai.response_models import CompletionChoice, CompletionLogprobs, CompletionResponse, UsageInfo
from tessera.server.serving import DONE, Run, ServerState, StreamRenderer, clamp_logprob, record_usage, sse, usage_of

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


def legacy_logprobs(entries: list[TokenLogprob], num_top: int, offset: int) -> CompletionLogprobs:
    """OpenAI's completions format; `offset` is where the first token starts in the choice text."""
    out = CompletionLogprobs()
    for entry in entries:
        out.tokens.append(entry.token)
        out.token_logprobs.append(clamp_logprob(entry.logprob))
        top: dict[str, float] = {}
        for _, text, lp in entry.top[:num_top]:  # best first, so of two tokens with one text the better stays
            top.setdefault(text, clamp_logprob(lp))
        top.setdefault(entry.token, clamp_logprob(entry.logprob))  # the sampled token is always listed
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(entry.token)
    return out


class CompletionStream(StreamRenderer):
    """SSE events for a streamed completion; choice index = prompt index * n + sample index."""

    def __init__(self, request_id: str, model: str, n: int, num_logprobs: Optional[int],
                 include_usage: bool, echo_texts: Optional[list[str]]) -> None:
        self.request_id, self.model, self.n = request_id, model, n
        self.num_logprobs = num_logprobs
        self.include_usage = include_usage
        self.echo_texts = echo_texts
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}
        self.finished: set[int] = set()

    def _chunk(self, choices: list[CompletionChoice], usage: Optional[UsageInfo] = None) -> str:
        chunk = CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage)
        return sse(chunk.model_dump_json(exclude=None if self.include_usage else {"usage"}))

    def start(self) -> list[str]:
        if not self.echo_texts:
            return []
        choices = []
        for p, text in enumerate(self.echo_texts):
            for i in range(self.n):
                self.offsets[p * self.n + i] = len(text)
                choices.append(CompletionChoice(index=p * self.n + i, text=text))
        return [self._chunk(choices)]

    def render(self, prompt_index: int, output: RequestOutput) -> list[str]:
        events = []
        for c in output.outputs:
            index = prompt_index * self.n + c.index
            if index in self.finished or not (c.delta_text or c.delta_logprobs or c.finished):
                continue
            logprobs = None
            if self.num_logprobs is not None:
                offset = self.offsets.get(index, 0)
                logprobs = legacy_logprobs(c.delta_logprobs or [], self.num_logprobs, offset)
                self.offsets[index] = offset + sum(len(t.token) for t in c.delta_logprobs or [])
            if c.finished:
                self.finished.add(index)
            events.append(self._chunk([CompletionChoice(index=index, text=c.delta_text, logprobs=logprobs,
                                                        finish_reason=c.finish_reason,
                                                        stop_reason=c.stop_reason)]))
        return events

    def finish(self, usage: UsageInfo) -> list[str]:
        return ([self._chunk([], usage)] if self.include_usage else []) + [DONE]


def _choice(index: int, c: CompletionOutput, num_logprobs: Optional[int], echo: str) -> CompletionChoice:
    logprobs = legacy_logprobs(c.logprobs or [], num_logprobs, len(echo)) if num_logprobs is not None else None
    return CompletionChoice(index=index, text=echo + c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason)


def _echo(engine, ids: list[int]) -> str:
    """A token-id prompt's text for `echo`, once its ids are known to be the model's."""
    check_token_ids(ids, engine.model_config.vocab_size)
    return engine.tokenizer.decode(ids, skip_special_tokens=False)


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state: ServerState = request.app.state.tessera
    state.router.resolve(body.model)  # 404 before anything else
    prompts = body.prompts()
    if body.echo and body.logprobs is not None:
        raise InvalidRequestError("echo together with logprobs is not supported (prompt logprobs are not computed)")
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    params = body.to_sampling_params(max_tokens=max_tokens, logprobs=body.logprobs,
                                     structured=body.structured_constraint(),
                                     default_priority=request_priority(request.scope, None))
    route = await state.route(body.model, request)
    model = route.reported
    run = Run(state, request, route, prompts, params, f"cmpl-{uuid.uuid4().hex}", reprompt=lambda engine: prompts)
    echo_texts: Optional[list[str]] = None
    if body.echo:
        echo_texts = [p if isinstance(p, str) else _echo(run.engine, p) for p in prompts]

    if body.stream:
        return await run.stream(CompletionStream(run.request_id, model, params.n, body.logprobs,
                                                 body.include_usage, echo_texts))
    finals: Union[dict[int, RequestOutput], Response] = await run.collect()
    if isinstance(finals, Response):
        return finals
    choices = [
        _choice(p * params.n + c.index, c, body.logprobs, echo_texts[p] if echo_texts else "")
        for p in sorted(finals) for c in sorted(finals[p].outputs, key=lambda c: c.index)
    ]
    usage = usage_of(finals)
    record_usage(request, usage)
    response = CompletionResponse(id=run.request_id, model=run.route.reported, choices=choices, usage=usage)
    return run.json(response.model_dump(mode="json"))
