"""Turns the tokens a step appended into what callers receive: text, stop strings, n > 1, deltas.

The step loop hands over each request's new tokens; this module detokenizes them
incrementally, ends a sequence at a stop string (asking the scheduler to free it
through `stop`), gathers the n samples of a request into one `RequestOutput`, and
cuts the deltas a stream sends (holding back what could still be the start of a
stop string). It reads requests' progress but never schedules or computes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from tessera.engine.core.request import Request, RequestStatus
from tessera.engine.input_processor import PreparedRequest
from tessera.engine.outputs import CompletionOutput, KVTransfer, RequestOutput, TokenLogprob
from tessera.engine.stats import FinishedRequestStats, IterationStats
from tessera.tokenizer import IncrementalDetokenizer, Tokenizer

Logprob = tuple[float, list[tuple[int, float]]]


@dataclass
class _Child:
    req: Request
    detok: IncrementalDetokenizer
    out: CompletionOutput
    emitted: int = 0  # characters of out.text already handed out as deltas
    tokens_sent: int = 0
    logprobs_sent: int = 0


@dataclass
class _Parent:
    prepared: PreparedRequest
    children: dict[str, _Child] = field(default_factory=dict)  # by child request id, in index order
    embedding: Optional[list[float]] = None  # an embedding request's result

    @property
    def finished(self) -> bool:
        return all(c.out.finished for c in self.children.values())


class OutputProcessor:
    """Per request (parent): its n sequences' text so far and what was already handed out."""

    def __init__(self, tokenizer: Tokenizer, stop: Callable[[Request], None],
                 export: Callable[[Request], KVTransfer]) -> None:
        self.tokenizer = tokenizer
        self._stop = stop  # a stop string ended the sequence: the scheduler frees it
        self._export = export  # a finished request's prompt blocks, for --pd
        self.parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, str] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.parents

    def __len__(self) -> int:
        return len(self.parents)

    def add(self, prepared: PreparedRequest, children: list[Request]) -> None:
        parent = _Parent(prepared)
        for i, req in enumerate(children):
            detok = IncrementalDetokenizer(self.tokenizer, prepared.prompt_token_ids, prepared.params.skip_special_tokens)
            out = CompletionOutput(index=i, logprobs=[] if prepared.params.logprobs is not None else None)
            parent.children[req.request_id] = _Child(req, detok, out)
            self._child_parent[req.request_id] = prepared.request_id
        self.parents[prepared.request_id] = parent

    def requests_of(self, request_id: str) -> list[Request]:
        parent = self.parents.get(request_id)
        return [c.req for c in parent.children.values()] if parent is not None else []

    def parent_of(self, child_id: str) -> Optional[str]:
        return self._child_parent.get(child_id)

    def drop(self, request_id: str) -> list[Request]:
        """Forget a parent without further output (its step failed); returns its sequences."""
        parent = self.parents.pop(request_id)
        for child_id in parent.children:
            self._child_parent.pop(child_id, None)
        return [c.req for c in parent.children.values()]

    def process(self, appended: dict[str, list[int]], logprobs: dict[str, list[Logprob]], now: float,
                stats: IterationStats, touched: set[str],
                pooled: Optional[dict[str, list[float]]] = None) -> list[RequestOutput]:
        """Outputs for every parent that gained tokens (or, embedding, its vector: `pooled`) this
        step, plus `touched` ones (aborted)."""
        for child_id, vector in (pooled or {}).items():
            parent_id = self._child_parent.get(child_id)
            if parent_id is None:
                continue
            touched.add(parent_id)
            parent = self.parents[parent_id]
            parent.embedding = vector
            parent.children[child_id].out.finish_reason = "stop"
        for child_id, tokens in appended.items():
            parent_id = self._child_parent.get(child_id)
            if parent_id is None:
                continue
            touched.add(parent_id)
            child = self.parents[parent_id].children[child_id]
            lps = logprobs.get(child_id)
            for i, token in enumerate(tokens):
                if child.out.finished:  # a stop string ended it inside a run of accepted tokens
                    break
                self._on_token(child, token, lps[i] if lps else None, now, stats,
                               first_of_step=i == 0, last_of_step=i == len(tokens) - 1)
        return [self._make_output(self.parents[pid], stats) for pid in touched if pid in self.parents]

    def _on_token(self, child: _Child, token: int, logprob: Optional[Logprob], now: float, stats: IterationStats,
                  first_of_step: bool = True, last_of_step: bool = True) -> None:
        """One emitted token; a step may emit several for a request (verified proposals), and
        latency is recorded once per step, the request's state (stop, length) at its last one."""
        req, out = child.req, child.out
        m = req.metrics
        if first_of_step:
            if m.first_token_time is None:
                m.first_token_time = now
                stats.time_to_first_tokens.append(now - m.arrival_time)
            else:
                stats.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now
        out.token_ids.append(token)
        status = req.status if last_of_step else RequestStatus.RUNNING
        is_eos_stop = status == RequestStatus.FINISHED_STOPPED and req.stop_reason == token
        prev_len = len(out.text)
        if not is_eos_stop or not req.params.skip_special_tokens:
            out.text += child.detok.add(token)
        if logprob is not None and out.logprobs is not None:
            lp, top = logprob
            text = self.tokenizer.token_text
            out.logprobs.append(TokenLogprob(token, text(token), lp, [(t, text(t), v) for t, v in top]))
        if status == RequestStatus.FINISHED_STOPPED:
            out.finish_reason = "stop"
            out.stop_reason = req.stop_reason
        elif status == RequestStatus.FINISHED_LENGTH:
            out.finish_reason = "length"
            out.text += child.detok.flush()  # a last incomplete character, if any
        stops = req.params.stop
        if stops and not out.finished:
            tail_start = max(0, prev_len - max(len(s) for s in stops) + 1)
            hits = [(out.text.find(s, tail_start), s) for s in stops]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                out.text = out.text[:pos]
                out.finish_reason = "stop"
                out.stop_reason = s
                self._stop(req)

    def _make_output(self, parent: _Parent, stats: IterationStats) -> RequestOutput:
        p = parent.prepared
        children = list(parent.children.values())
        holdback = max((len(s) for s in p.params.stop), default=1) - 1
        for c in children:
            out = c.out
            if c.req.status == RequestStatus.FINISHED_ABORTED and out.finish_reason is None:
                out.finish_reason = "abort"
            end = len(out.text) if out.finished else max(c.emitted, len(out.text) - holdback)
            out.delta_text = out.text[c.emitted:end]
            c.emitted = end
            out.delta_token_ids = out.token_ids[c.tokens_sent:]
            c.tokens_sent = len(out.token_ids)
            if out.logprobs is not None:
                out.delta_logprobs = out.logprobs[c.logprobs_sent:]
                c.logprobs_sent = len(out.logprobs)
        finished = parent.finished
        first = children[0].req
        transfer = self._export(first) if finished and p.kv_export else None
        if finished:
            self.drop(p.request_id)
            for c in children:
                stats.finished.append(FinishedRequestStats(
                    request_id=c.req.request_id, finish_reason=c.out.finish_reason or "abort",
                    num_prompt_tokens=c.req.num_prompt_tokens,
                    num_generation_tokens=len(c.out.token_ids),
                    num_cached_tokens=c.req.num_cached_tokens, metrics=c.req.metrics, params=p.params))
        return RequestOutput(
            request_id=p.request_id, prompt=p.prompt, prompt_token_ids=p.prompt_token_ids,
            outputs=[replace(c.out, token_ids=list(c.out.token_ids),
                             logprobs=list(c.out.logprobs) if c.out.logprobs is not None else None)
                     for c in children],
            finished=finished, num_cached_tokens=first.num_cached_tokens, metrics=first.metrics,
            kv_transfer=transfer, embedding=parent.embedding)
