"""The lines of an Ollama /api/chat or /api/generate answer (`OllamaReply`): streamed pieces and
the final object with Ollama's statistics, built from the engine's outputs."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Optional

from tessera.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tessera.server.errors import APIError
from tessera.server.openai.response_models import UsageInfo
from tessera.server.serving import StreamRenderer, clamp_logprob
from tessera.server.tools import OutputParser



def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _done_reason(finish_reason: Optional[str]) -> str:
    return "length" if finish_reason == "length" else "stop"


def _logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token": e.token, "logprob": clamp_logprob(e.logprob), "bytes": list(e.token.encode("utf-8")),
             "top_logprobs": [{"token": text, "logprob": clamp_logprob(lp), "bytes": list(text.encode("utf-8"))}
                              for _, text, lp in e.top]}
            for e in entries]


def _tool_call(call_id: str, index: int, name: str, arguments: str) -> Optional[dict[str, Any]]:
    """Ollama's form of a parsed call, its arguments an object; None when they are not one."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return None
    if not isinstance(args, dict):
        return None
    return {"id": call_id, "function": {"index": index, "name": name, "arguments": args}}


@dataclass
class Timing:
    """When the request began and how long it waited for its model to load (perf_counter_ns)."""

    start: int
    load: int = 0


class OllamaReply(StreamRenderer):
    """The lines of one /api/chat or /api/generate answer: the streamed pieces and the final
    object with the statistics; a whole (non-streamed) answer is the same final object with
    all the text in it, parsed by the same code."""

    def __init__(self, kind: str, model: str, timing: Timing, parser: Optional[OutputParser], logprobs: bool) -> None:
        self.kind = kind  # "chat" | "generate"
        self.model = model
        self.timing = timing
        self.logprobs = logprobs
        self.parser = parser  # the model's parsers when the request has tools or the model reasons
        self.sent_calls = 0
        self.final: Optional[RequestOutput] = None

    # -- pieces ---------------------------------------------------------------------
    def _piece(self, text: str, calls: list[dict[str, Any]], logprobs: Optional[list[TokenLogprob]],
               done: bool = False, thinking: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = text
        if self.logprobs and logprobs:
            out["logprobs"] = _logprobs(logprobs)
        out["done"] = done
        return out

    def _text_and_calls(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]], str]:
        """Content, the tool calls completed by `text` (after what came before) and reasoning."""
        parser = self.parser
        if parser is None:
            return text, [], ""
        events = parser.feed(text) + (parser.finish() if finished else [])
        content = "".join(e.text for e in events if e.kind == "content")
        thinking = "".join(e.text for e in events if e.kind == "reasoning")
        # Ollama sends each call whole: the last one is complete once another follows or the text ends.
        complete = len(parser.calls) if finished else max(len(parser.calls) - 1, 0)
        calls = []
        for i, c in enumerate(parser.calls[self.sent_calls:complete], start=self.sent_calls):
            call = _tool_call(c.id, i, c.name, c.arguments)
            if call is not None:
                calls.append(call)
            else:  # arguments that are not an object (only unconstrained text has them): left as text
                content += f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}'
        self.sent_calls = max(self.sent_calls, complete)
        return content, calls, thinking

    # -- the StreamRenderer protocol (serving.Run.stream) ---------------------------
    def start(self) -> list[str]:
        return []

    def render(self, prompt_index: int, output: RequestOutput) -> list[str]:
        c = output.outputs[0]
        if output.finished:
            self.final = output
        text, calls, thinking = self._text_and_calls(c.delta_text, c.finished)
        if not (text or calls or thinking or (self.logprobs and c.delta_logprobs)):
            return []
        return [json.dumps(self._piece(text, calls, c.delta_logprobs, thinking=thinking)) + "\n"]

    def finish(self, usage: UsageInfo) -> list[str]:
        assert self.final is not None
        return [json.dumps(self._last(self._piece("", [], None, done=True), self.final)) + "\n"]

    def error(self, err: APIError) -> list[str]:
        """Ollama ends a failed stream with one {"error": ...} line."""
        return [json.dumps({"error": err.message}) + "\n"]

    # -- the final object ------------------------------------------------------------
    def whole(self, output: RequestOutput) -> dict[str, Any]:
        c = output.outputs[0]
        text, calls, thinking = self._text_and_calls(c.text, True)
        return self._last(self._piece(text, calls, c.logprobs, done=True, thinking=thinking), output)

    def _last(self, body: dict[str, Any], output: RequestOutput) -> dict[str, Any]:
        c: CompletionOutput = output.outputs[0]
        m = output.metrics
        prompt_s = eval_s = 0.0
        if m is not None and m.first_token_time is not None:
            prompt_s = m.first_token_time - (m.first_scheduled_time or m.arrival_time)
            eval_s = (m.last_token_time or m.first_token_time) - m.first_token_time
        body["done_reason"] = _done_reason(c.finish_reason)
        if self.kind == "generate":
            body["context"] = list(output.prompt_token_ids) + list(c.token_ids)
        body.update(total_duration=time.perf_counter_ns() - self.timing.start, load_duration=self.timing.load,
                    prompt_eval_count=len(output.prompt_token_ids), prompt_eval_cached_count=output.num_cached_tokens,
                    prompt_eval_duration=_ns(prompt_s),
                    eval_count=len(c.token_ids), eval_duration=_ns(eval_s))
        return body


# ----------------------------------------------------------------------------- chat and generate
