"""Messages between the API process and an engine-core process (ZeroMQ frames, msgspec msgpack).

Everything crossing per step is plain data: requests go in as token ids and
sampling parameters, outputs come back as *deltas* (the text, token ids and
logprobs new this step), never as the cumulative objects LLMEngine hands its
in-process callers, so a step's message stays small however long a reply gets.
`OutputAssembler` on the API side rebuilds the RequestOutputs the server and
the offline API expect. msgspec encodes the engine's dataclasses as they are
(SamplingParams, SchedulerStats, IterationStats, RequestMetrics, TokenLogprob),
so there is one definition of each, not a wire copy to keep in step. Only the
start-up message carries a pickle (the resolved EngineConfig, once).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Union

import msgspec

from tessera.engine.input_processor import PreparedRequest
from tessera.engine.outputs import CompletionOutput, KVTransfer, RequestMetrics, RequestOutput, TokenLogprob
from tessera.engine.stats import IterationStats, SchedulerStats
from tessera.models.adapters import AdapterSpec

# -- API process -> engine core ----------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    request: PreparedRequest  # as the API process checked it (its grammar is compiled in the core)


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class AddLoRA(msgspec.Struct, tag="add_lora"):
    spec: AdapterSpec  # checked by the API process (models/adapters.py)


class RemoveLoRA(msgspec.Struct, tag="remove_lora"):
    name: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


CoreRequest = Union[AddRequest, AbortRequests, AddLoRA, RemoveLoRA, Shutdown]

# -- engine core -> API process ----------------------------------------------------------------


class CompletionDelta(msgspec.Struct, array_like=True):
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]


class OutputDelta(msgspec.Struct, array_like=True):
    request_id: str
    finished: bool
    num_cached_tokens: int
    completions: list[CompletionDelta]
    metrics: Optional[RequestMetrics]
    kv_transfer: Optional[KVTransfer] = None
    embedding: Optional[list[float]] = None


class EngineInfo(msgspec.Struct):
    """What /v1/engine/stats shows of the core, refreshed about once a second."""

    kv_cache_info: dict
    cost_model_stats: dict


class Ready(msgspec.Struct, tag="ready"):
    pid: int
    config: bytes  # pickle of the engine's resolved EngineConfig (once per start)
    kv_capacity_tokens: int  # the longest sequence its KV cache holds (InputLimits)
    scheduler: SchedulerStats
    info: EngineInfo


NO_CLASS = -(2**63)  # the forecast class of a newcomer with no waiting request ahead of it


class StepResult(msgspec.Struct, tag="step"):
    outputs: list[OutputDelta]
    scheduler: SchedulerStats
    iteration: Optional[IterationStats]
    num_waiting: int
    # The wait forecast for a newcomer is linear in its prompt: base + per_token * tokens.
    forecast: Optional[tuple[float, float]]
    failed: list[str]  # requests a failed step ended (their blocks are freed)
    failure: Optional[str]  # what that step raised
    info: Optional[EngineInfo]
    seen: int  # messages from the API process the core had applied when it sent this
    idle: bool  # nothing left to run or compile: no further result until new messages
    # Under the priority policy, the forecast per class: (priority, base, per_token), ascending; a
    # newcomer takes the last entry at or below its priority (the first, NO_CLASS, has nothing ahead).
    forecast_by_priority: tuple[tuple[int, float, float], ...] = ()
    # A prompt's own computation on an idle engine, linear too: (base, per_token).
    forecast_prompt: Optional[tuple[float, float]] = None


class RequestRefused(msgspec.Struct, tag="refused"):
    """An add the core could not take (an unsatisfiable grammar, a duplicate id)."""

    request_id: str
    message: str
    invalid: bool  # True: the request's fault (HTTP 400)


class StartFailed(msgspec.Struct, tag="start_failed"):
    message: str


CoreOutput = Union[Ready, StepResult, RequestRefused, StartFailed]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def request_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreRequest)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreOutput)


def to_delta(out: RequestOutput) -> OutputDelta:
    """The wire form of one in-process RequestOutput: only what is new since the last one."""
    return OutputDelta(out.request_id, out.finished, out.num_cached_tokens,
                       [CompletionDelta(c.index, c.delta_text, c.delta_token_ids, c.delta_logprobs,
                                        c.finish_reason, c.stop_reason) for c in out.outputs],
                       out.metrics, out.kv_transfer, out.embedding)


@dataclass
class _Assembly:
    prompt: Optional[str]
    prompt_token_ids: list[int]
    completions: dict[int, CompletionOutput] = field(default_factory=dict)


class OutputAssembler:
    """Rebuilds cumulative RequestOutputs from deltas (API side; one per engine core).

    `text` is what has been emitted so far (the core holds back a possible stop string's
    start until it is decided); once finished it is the whole reply, as in process.
    """

    def __init__(self) -> None:
        self._requests: dict[str, _Assembly] = {}

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int]) -> None:
        self._requests[request_id] = _Assembly(prompt, prompt_token_ids)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def apply(self, delta: OutputDelta) -> Optional[RequestOutput]:
        """The RequestOutput after this delta; None for a request no longer tracked (aborted here)."""
        a = self._requests.get(delta.request_id)
        if a is None:
            return None
        for d in delta.completions:
            c = a.completions.get(d.index)
            if c is None:
                c = a.completions[d.index] = CompletionOutput(index=d.index,
                                                              logprobs=[] if d.logprobs is not None else None)
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            if d.logprobs is not None and c.logprobs is not None:
                c.logprobs.extend(d.logprobs)
            c.delta_text, c.delta_token_ids, c.delta_logprobs = d.text, d.token_ids, d.logprobs
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        if delta.finished:
            del self._requests[delta.request_id]
        outputs = [replace(c, token_ids=list(c.token_ids),
                           logprobs=list(c.logprobs) if c.logprobs is not None else None)
                   for _, c in sorted(a.completions.items())]
        return RequestOutput(delta.request_id, a.prompt, a.prompt_token_ids, outputs, delta.finished,
                             delta.num_cached_tokens, delta.metrics, delta.kv_transfer, delta.embedding)
