"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel.

A request becomes a chat completion request (the stored conversation of
`previous_response_id` first, then its own input items) and runs through the same path as
chat completions (`chat.chat_run`: template, tool constraint, admission, deadline, cancel on
disconnect). The model's output goes through one parser into output items (`ResponseBuilder`):
a reasoning item, message items of output_text, function_call items. A stream is the same
builder's typed events, each with its sequence number; a whole response is the builder's final
state, so the two agree by construction.

Stored responses (`store`, on by default as OpenAI has it) live in a bounded in-memory LRU
(`ResponseStore`): a restart, or enough newer responses, forgets them, and a request that
names a forgotten `previous_response_id` gets a 400 saying so. `background: true` answers at
once with a queued response that GET polls; only such a response can be cancelled.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tessera.engine.outputs import RequestOutput
from tessera.server.openai.chat import chat_run
from tessera.server.errors import APIError
from tessera.server.output import parse_whole, typed_sse
from tessera.server.openai.schema_base import OpenAIModel
from tessera.server.openai.tool_schemas import FREEFORM_ARGUMENT, freeform_input
from tessera.server.openai.response_models import UsageInfo
from tessera.server.responses.protocol import CallNames, ResponsesRequest, items_to_messages
from tessera.server.responses.response_models import (
    CustomToolCallOutput, FunctionCallOutput, IncompleteDetails, InputTokensDetails, OutputItem, OutputMessage,
    OutputText, ReasoningItem, ReasoningText, ResponseError, ResponseObject, ResponseUsage,
)
from tessera.server.serving import Run, StreamRenderer, record_usage, usage_of
from tessera.server.tools import OutputParser, ParserEvent

# What the store keeps by default: the newest responses, and at most this many bytes of their
# conversations (each response holds its whole conversation so far).
DEFAULT_MAX_STORED_RESPONSES = 1000
DEFAULT_MAX_STORED_BYTES = 256 * 2**20


def _hex() -> str:
    return uuid.uuid4().hex


# ----------------------------------------------------------------------------- the store


@dataclass
class StoredResponse:
    response: ResponseObject
    # The conversation through this response, as chat messages, without its instructions: what
    # a request naming it as previous_response_id continues.
    messages: list[dict[str, Any]] = field(default_factory=list)
    task: Optional[asyncio.Task] = None  # a background response still running

    def size(self) -> int:
        return len(json.dumps(self.messages)) + len(self.response.model_dump_json())


class ResponseStore:
    """Responses by id, newest last; the oldest are dropped past `max_responses` or `max_bytes`.
    Lives on the app (app.state.responses), so it lasts as long as the server process."""

    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_STORED_BYTES) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        rid = entry.response.id
        self.delete(rid)
        if self.max_responses == 0:
            return
        size = entry.size()
        self._entries[rid] = (entry, size)
        self._bytes += size
        while self._entries and (len(self._entries) > self.max_responses or self._bytes > self.max_bytes):
            _, (dropped, dropped_size) = self._entries.popitem(last=False)
            self._bytes -= dropped_size
            if dropped.task is not None:  # a running background response forgotten: stop its work
                dropped.task.cancel()

    def refresh(self, entry: StoredResponse) -> None:
        """Count an entry's size again after it changed (a background response finishing),
        unless it was deleted or dropped meanwhile."""
        found = self._entries.get(entry.response.id)
        if found is not None and found[0] is entry:
            self.put(entry)

    def get(self, rid: str) -> Optional[StoredResponse]:
        found = self._entries.get(rid)
        if found is None:
            return None
        self._entries.move_to_end(rid)  # continued conversations stay
        return found[0]

    def delete(self, rid: str) -> Optional[StoredResponse]:
        found = self._entries.pop(rid, None)
        if found is None:
            return None
        self._bytes -= found[1]
        return found[0]


def not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id {rid!r} not found.", param="response_id", code="response_not_found")


# ----------------------------------------------------------------------------- output items


class ResponseBuilder:
    """Output items from the parser's events, and the stream's typed events as it goes.

    Every event is built whether or not anyone streams it, so a whole response and a streamed
    one take the same steps. Items open when their kind of output starts and close when
    another starts (or the output ends)."""

    def __init__(self, response: ResponseObject, names: CallNames = CallNames()) -> None:
        self.response = response
        self.names = names  # the client's names for the model's calls
        self.sequence = 0
        self.item: Optional[OutputItem] = None  # the item being written
        self.arguments = ""  # a freeform call's arguments as the model writes them (JSON around the text)

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return typed_sse(kind, payload)

    def _snapshot(self) -> dict[str, Any]:
        return self.response.model_dump(mode="json")

    def start(self) -> list[str]:
        return [self.event("response.created", response=self._snapshot()),
                self.event("response.in_progress", response=self._snapshot())]

    def feed(self, events: list[ParserEvent]) -> list[str]:
        out: list[str] = []
        for e in events:
            if e.kind == "content":
                if not isinstance(self.item, OutputMessage):
                    out += self._open(OutputMessage(id=f"msg_{_hex()}"))
                    out.append(self._part_added(OutputText()))
                    self.item.content.append(OutputText())  # type: ignore[union-attr]
                part = self.item.content[0]  # type: ignore[union-attr]
                part.text += e.text
                out.append(self.event("response.output_text.delta", item_id=self.item.id,
                                      output_index=self._index(), content_index=0, delta=e.text, logprobs=[]))
            elif e.kind == "reasoning":
                if not isinstance(self.item, ReasoningItem):
                    out += self._open(ReasoningItem(id=f"rs_{_hex()}"))
                    out.append(self._part_added(ReasoningText()))
                    self.item.content.append(ReasoningText())  # type: ignore[union-attr]
                self.item.content[0].text += e.text  # type: ignore[union-attr]
                out.append(self.event("response.reasoning_text.delta", item_id=self.item.id,
                                      output_index=self._index(), content_index=0, delta=e.text))
            elif e.kind == "call":
                assert e.call is not None
                out += self._open(self._call_item(e.call.id, e.call.name))
            elif isinstance(self.item, CustomToolCallOutput):  # its text is sent whole when it closes
                self.arguments += e.text
            else:  # argument text of the call just opened
                assert isinstance(self.item, FunctionCallOutput)
                self.item.arguments += e.text
                out.append(self.event("response.function_call_arguments.delta", item_id=self.item.id,
                                      output_index=self._index(), delta=e.text))
        return out

    def _call_item(self, call_id: str, name: str) -> OutputItem:
        """The output item of a call of the tool the model knows as `name`."""
        if name in self.names.freeform:
            return CustomToolCallOutput(id=f"ctc_{_hex()}", call_id=call_id, name=name)
        namespace, own = self.names.namespaced.get(name, (None, name))
        return FunctionCallOutput(id=f"fc_{_hex()}", call_id=call_id, name=own, namespace=namespace)

    def _index(self) -> int:
        return len(self.response.output) - 1

    def _open(self, item: OutputItem) -> list[str]:
        out = self._close("completed")
        self.response.output.append(item)
        self.item = item
        out.append(self.event("response.output_item.added", output_index=self._index(),
                              item=item.model_dump(mode="json")))
        return out

    def _part_added(self, part: Union[OutputText, ReasoningText]) -> str:
        assert self.item is not None
        return self.event("response.content_part.added", item_id=self.item.id, output_index=self._index(),
                          content_index=0, part=part.model_dump(mode="json"))

    def _close(self, status: str) -> list[str]:
        item, self.item = self.item, None
        if item is None:
            return []
        item.status = status
        index, out = self._index(), []
        if isinstance(item, (OutputMessage, ReasoningItem)):
            part = item.content[0]
            done = "response.output_text.done" if isinstance(item, OutputMessage) else "response.reasoning_text.done"
            extra = {"logprobs": []} if isinstance(item, OutputMessage) else {}
            out.append(self.event(done, item_id=item.id, output_index=index, content_index=0, text=part.text,
                                  **extra))
            out.append(self.event("response.content_part.done", item_id=item.id, output_index=index,
                                  content_index=0, part=part.model_dump(mode="json")))
        elif isinstance(item, CustomToolCallOutput):
            item.input, self.arguments = freeform_input(self.arguments), ""
            out.append(self.event("response.custom_tool_call_input.delta", item_id=item.id, output_index=index,
                                  delta=item.input))
            out.append(self.event("response.custom_tool_call_input.done", item_id=item.id, output_index=index,
                                  input=item.input))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                  name=item.name, arguments=item.arguments))
        out.append(self.event("response.output_item.done", output_index=index, item=item.model_dump(mode="json")))
        return out

    def end(self, finish_reason: Optional[str], usage: UsageInfo) -> list[str]:
        """Close the last item and the response: completed, or incomplete at max_output_tokens."""
        incomplete = finish_reason == "length"
        out = self._close("incomplete" if incomplete else "completed")
        self.response.status = "incomplete" if incomplete else "completed"
        if incomplete:
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        self.response.usage = ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                                            total_tokens=usage.total_tokens,
                                            input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens))
        out.append(self.event(f"response.{self.response.status}", response=self._snapshot()))
        return out

    def fail(self, err: APIError) -> list[str]:
        self._close("incomplete")
        self.response.status = "failed"
        self.response.error = ResponseError(code=str(err.code or err.type), message=err.message)
        return [self.event("response.failed", response=self._snapshot())]


def assistant_turn(output: list[OutputItem]) -> dict[str, Any]:
    """A response's output as the assistant message a following turn's prompt shows (its
    reasoning left out, as chat templates leave earlier turns' reasoning out)."""
    text = "".join(p.text for item in output if isinstance(item, OutputMessage) for p in item.content)
    calls = []
    for item in output:  # as the model wrote them: flat names, a freeform call's text as its argument
        if isinstance(item, FunctionCallOutput):
            function = {"name": CallNames().model_name(item.name, item.namespace), "arguments": item.arguments}
        elif isinstance(item, CustomToolCallOutput):
            function = {"name": item.name,
                        "arguments": json.dumps({FREEFORM_ARGUMENT: item.input}, ensure_ascii=False)}
        else:
            continue
        calls.append({"id": item.call_id, "type": "function", "function": function})
    return {"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})}


# ----------------------------------------------------------------------------- handlers


class ResponsesStream(StreamRenderer):
    """The typed events of a streamed response; the finished response goes to the store."""

    def __init__(self, builder: ResponseBuilder, parser: OutputParser, keep: Optional[StoredResponse],
                 store: ResponseStore) -> None:
        self.builder, self.parser, self.keep, self.store = builder, parser, keep, store
        self.model = builder.response.model
        self.finish_reason: Optional[str] = None

    def start(self) -> list[str]:
        self.builder.response.model = self.model  # a fallback model may have taken the request over
        return self.builder.start()

    def render(self, prompt_index: int, output: RequestOutput) -> list[str]:
        c = output.outputs[0]
        events = self.parser.feed(c.delta_text) + (self.parser.finish() if c.finished else [])
        if c.finished:
            self.finish_reason = c.finish_reason
        return self.builder.feed(events)

    def finish(self, usage: UsageInfo) -> list[str]:
        out = self.builder.end(self.finish_reason, usage)
        self._keep()
        return out

    def error(self, err: APIError) -> list[str]:
        out = self.builder.fail(err)
        self._keep()
        return out

    def keepalive(self) -> list[str]:
        return [self.builder.event("response.in_progress", response=self.builder.response.model_dump(mode="json"))]

    def _keep(self) -> None:
        if self.keep is not None:
            self.keep.messages.append(assistant_turn(self.builder.response.output))
            self.store.put(self.keep)


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _complete(builder: ResponseBuilder, parser: OutputParser, finals: dict[int, RequestOutput], request: Request,
              keep: Optional[StoredResponse], store: ResponseStore) -> ResponseObject:
    c = finals[0].outputs[0]
    builder.feed(parse_whole(parser, c.text))
    usage = usage_of(finals)
    record_usage(request, usage)
    builder.end(c.finish_reason, usage)
    if keep is not None:
        keep.messages.append(assistant_turn(builder.response.output))
        store.put(keep)
    return builder.response


async def create_response(body: ResponsesRequest, request: Request) -> Response:
    store = _store(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise APIError(400, f"Previous response with id {body.previous_response_id!r} not found (responses "
                           "are kept in this server's memory, a bounded number of them, until it restarts).",
                           param="previous_response_id", code="previous_response_not_found")
        if previous.task is not None:
            raise APIError(400, f"Previous response {body.previous_response_id!r} is still running.",
                           param="previous_response_id", code="previous_response_in_progress")
        history = [dict(m) for m in previous.messages]
    if body.background and not body.store:
        raise APIError(400, "background responses must be stored (store: true): GET is how their result is read.",
                       param="background")
    if body.background and store.max_responses == 0:
        raise APIError(400, "background responses need the response store, which this server has turned off "
                       "(--max-stored-responses 0).", param="background")
    if body.background and body.stream:
        raise APIError(400, "background responses cannot be streamed here; poll GET /v1/responses/{id} instead.",
                       param="background")
    conversation = history + items_to_messages(body.input_items())
    chat = body.chat_request(conversation)
    run, _, parsers = await chat_run(chat, request, f"resp_{_hex()}")
    response = ResponseObject(
        id=run.request_id, model=run.route.reported, instructions=body.instructions,
        max_output_tokens=body.max_output_tokens, metadata=body.metadata or {},
        parallel_tool_calls=body.parallel_tool_calls is not False, previous_response_id=body.previous_response_id,
        store=body.store is not False, background=bool(body.background), temperature=body.temperature,
        top_p=body.top_p, user=body.user,
        reasoning=body.reasoning.model_dump(mode="json") if body.reasoning is not None else None,
        text={"format": body.text.format.model_dump(mode="json", by_alias=True, exclude_none=True)}
        if body.text is not None and body.text.format is not None else {"format": {"type": "text"}},
        tool_choice=(body.tool_choice.model_dump(exclude_none=True) if isinstance(body.tool_choice, OpenAIModel)
                     else body.tool_choice or "auto"),
        tools=[t.model_dump(exclude_none=True) for t in body.tools or []])
    keep = StoredResponse(response, conversation) if body.store is not False else None
    builder, parser = ResponseBuilder(response, body.call_names()), parsers()

    if body.background:
        assert keep is not None
        response.status = "queued"
        run.watch_client = False
        keep.task = asyncio.create_task(_background(run, builder, parser, keep, store), name=run.request_id)
        store.put(keep)
        return run.json(response.model_dump(mode="json"))
    if body.stream:
        return await run.stream(ResponsesStream(builder, parser, keep, store))
    finals: Union[dict[int, RequestOutput], Response] = await run.collect()
    if isinstance(finals, Response):
        return finals
    return run.json(_complete(builder, parser, finals, request, keep, store).model_dump(mode="json"))


async def _background(run: Run, builder: ResponseBuilder, parser: OutputParser, keep: StoredResponse,
                      store: ResponseStore) -> None:
    builder.response.status = "in_progress"
    try:
        finals = await run.collect()
        assert not isinstance(finals, Response)  # nobody watches the connection
        _complete(builder, parser, finals, run.request, None, store)
    except asyncio.CancelledError:
        builder.response.status = "cancelled"
    except APIError as err:
        builder.fail(err)
    except Exception as exc:  # noqa: BLE001 - nobody awaits this task: the response says what went wrong
        builder.fail(run.error(exc))
    finally:
        keep.task = None
        keep.messages.append(assistant_turn(builder.response.output))
        store.refresh(keep)


async def get_response(response_id: str, request: Request) -> Response:
    entry = _store(request).get(response_id)
    if entry is None:
        raise not_found(response_id)
    return JSONResponse(entry.response.model_dump(mode="json"))


async def delete_response(response_id: str, request: Request) -> Response:
    entry = _store(request).delete(response_id)
    if entry is None:
        raise not_found(response_id)
    if entry.task is not None:
        entry.task.cancel()
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(response_id: str, request: Request) -> Response:
    entry = _store(request).get(response_id)
    if entry is None:
        raise not_found(response_id)
    if not entry.response.background:
        raise APIError(400, "Only responses created with background: true can be cancelled.",
                       param="response_id", code="not_background")
    task = entry.task
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return JSONResponse(entry.response.model_dump(mode="json"))
