"""The replies capture.py gives an agent CLI: just enough to keep it going.

Anthropic Messages, OpenAI Responses and chat completions (JSON or SSE per `stream`), a model
list; the text answer is ANSWER. With --tool-call, a request that offers a shell tool and ends
in a user turn holding a `command` gets one call of that tool, and the request carrying its
result a text quoting the tool's output. Stdlib only.
"""
from __future__ import annotations

import itertools
import json
import re
import time
import uuid

ANSWER = "ready"


def sse(events: list[tuple[str, dict]]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def rough_tokens(body) -> int:
    return max(1, len(json.dumps(body)) // 4) if body is not None else 1


SHELL_TOOL_NAMES = ("Bash", "shell_command", "exec_command", "shell", "local_shell")


def pick_shell_tool(tools) -> dict | None:
    """The shell tool a client offers, with a name and the schema its arguments follow."""
    by_name = {}
    for t in tools or []:
        if not isinstance(t, dict):
            continue
        if t.get("type") == "local_shell":
            by_name.setdefault("local_shell", t)
            continue
        name = t.get("name") or (t.get("function") or {}).get("name")
        if name:
            by_name.setdefault(name, t)
    for name in SHELL_TOOL_NAMES:
        if name in by_name:
            return {"name": name, "tool": by_name[name]}
    return None


def shell_arguments(choice: dict, command: str) -> dict:
    tool = choice["tool"]
    schema = tool.get("input_schema") or tool.get("parameters") or (tool.get("function") or {}).get("parameters") or {}
    props = schema.get("properties") or {}
    args: dict = {}
    if "command" in props:
        args["command"] = ["bash", "-lc", command] if props["command"].get("type") == "array" else command
    elif "cmd" in props:
        args["cmd"] = command
    else:
        args["command"] = command
    if "description" in (schema.get("required") or []) or "description" in props:
        args["description"] = "Print the token"
    return args


def text_of(content) -> str:
    """Flatten a tool result / message content (string, list of blocks, dict) to text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(text_of(c) for c in content)
    if isinstance(content, dict):
        for key in ("text", "output", "content"):
            if key in content:
                return text_of(content[key])
    return ""


BACKTICKED = re.compile(r"`([^`\n]+)`")


def requested_command(text: str) -> str | None:
    m = BACKTICKED.search(text or "")
    return m.group(1).strip() if m else None


def tool_output_answer(output: str) -> str:
    output = output.strip()
    # Codex wraps outputs ("Exit code: 0\nWall time: ...\nOutput:\n..."); quote the last lines.
    tail = [ln for ln in output.splitlines() if ln.strip()][-3:]
    return f"{ANSWER}. The command printed: {' / '.join(tail) if tail else '(nothing)'}"


def anthropic_plan(body: dict, opts) -> dict:
    """What to answer to a Messages request: {'kind': 'text', 'text'} or {'kind': 'tool', ...}."""
    # Claude Code may put a role "system" turn (environment notes) after the user turn.
    msgs = [m for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") != "system"]
    last = msgs[-1] if msgs else {}
    content = last.get("content")
    blocks = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
    results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"]
    if results:
        return {"kind": "text", "text": tool_output_answer(text_of(results[-1].get("content")))}
    command = requested_command(text_of(blocks))
    if opts.tool_call and last.get("role") == "user" and command:
        choice = pick_shell_tool(body.get("tools"))
        if choice and choice["name"] == "Bash":
            return {"kind": "tool", "name": choice["name"], "input": shell_arguments(choice, command)}
    return {"kind": "text", "text": ANSWER}


def anthropic_answer(body: dict, opts) -> tuple[bytes, str]:
    model = body.get("model") or "model"
    plan = anthropic_plan(body, opts)
    mid = new_id("msg")
    usage = {"input_tokens": rough_tokens(body), "output_tokens": 5,
             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    if plan["kind"] == "tool":
        block = {"type": "tool_use", "id": new_id("toolu"), "name": plan["name"], "input": plan["input"]}
        stop = "tool_use"
    else:
        block = {"type": "text", "text": plan["text"]}
        stop = "end_turn"
    if not body.get("stream"):
        return json.dumps({"id": mid, "type": "message", "role": "assistant", "model": model,
                           "content": [block], "stop_reason": stop, "stop_sequence": None,
                           "usage": usage}).encode(), "application/json"
    start_block = dict(block, input={}) if plan["kind"] == "tool" else dict(block, text="")
    delta = ({"type": "input_json_delta", "partial_json": json.dumps(block["input"])} if plan["kind"] == "tool"
             else {"type": "text_delta", "text": block["text"]})
    events = [
        ("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": dict(usage, output_tokens=1)}}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": start_block}),
        ("ping", {"type": "ping"}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                           "usage": {"output_tokens": 5}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return sse(events), "text/event-stream"


def responses_plan(body: dict, opts) -> dict:
    items = body.get("input")
    if isinstance(items, str) or not items:
        items = [{"type": "message", "role": "user", "content": items or ""}]
    items = [i for i in items if isinstance(i, dict) and i.get("role") not in ("system", "developer")] or [{}]
    last = items[-1]
    kind = last.get("type") or ("message" if "role" in last else "")
    if kind in ("function_call_output", "local_shell_call_output", "custom_tool_call_output"):
        return {"kind": "text", "text": tool_output_answer(text_of(last.get("output")))}
    command = requested_command(text_of(last.get("content")))
    if opts.tool_call and kind == "message" and last.get("role") == "user" and command:
        choice = pick_shell_tool(body.get("tools"))
        if choice:
            return {"kind": "tool", "name": choice["name"], "choice": choice, "command": command,
                    "arguments": shell_arguments(choice, command)}
    return {"kind": "text", "text": ANSWER}


def responses_answer(body: dict, opts) -> tuple[bytes, str]:
    model = body.get("model") or "model"
    plan = responses_plan(body, opts)
    rid, created = new_id("resp"), int(time.time())
    in_tok = rough_tokens(body)
    usage = {"input_tokens": in_tok, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": in_tok + 5}

    def resp(status, output, with_usage=False):
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
                "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                "store": body.get("store", False), "error": None, "incomplete_details": None,
                "usage": usage if with_usage else None}

    seq = itertools.count()
    ev = lambda name, **data: (name, {"type": name, "sequence_number": next(seq), **data})  # noqa: E731

    if plan["kind"] == "tool":
        args = json.dumps(plan["arguments"])
        call_id, item_id = new_id("call"), new_id("fc")
        if plan["name"] == "local_shell":
            done = {"type": "local_shell_call", "id": item_id, "call_id": call_id, "status": "completed",
                    "action": {"type": "exec", "command": plan["arguments"]["command"]
                               if isinstance(plan["arguments"].get("command"), list)
                               else ["bash", "-lc", plan["command"]]}}
            added, middle = dict(done, status="in_progress"), []
        else:
            done = {"type": "function_call", "id": item_id, "call_id": call_id, "name": plan["name"],
                    "arguments": args, "status": "completed"}
            added = dict(done, arguments="", status="in_progress")
            middle = [ev("response.function_call_arguments.delta", item_id=item_id, output_index=0, delta=args),
                      ev("response.function_call_arguments.done", item_id=item_id, output_index=0, arguments=args)]
        if not body.get("stream"):
            return json.dumps(resp("completed", [done], True)).encode(), "application/json"
        events = [ev("response.created", response=resp("in_progress", [])),
                  ev("response.in_progress", response=resp("in_progress", [])),
                  ev("response.output_item.added", output_index=0, item=added), *middle,
                  ev("response.output_item.done", output_index=0, item=done),
                  ev("response.completed", response=resp("completed", [done], True))]
        return sse(events), "text/event-stream"

    text, mid = plan["text"], new_id("msg")
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {"type": "message", "id": mid, "status": "completed", "role": "assistant", "content": [part]}
    if not body.get("stream"):
        return json.dumps(resp("completed", [item], True)).encode(), "application/json"
    events = [
        ev("response.created", response=resp("in_progress", [])),
        ev("response.in_progress", response=resp("in_progress", [])),
        ev("response.output_item.added", output_index=0,
           item={"type": "message", "id": mid, "status": "in_progress", "role": "assistant", "content": []}),
        ev("response.content_part.added", item_id=mid, output_index=0, content_index=0,
           part={"type": "output_text", "text": "", "annotations": []}),
        ev("response.output_text.delta", item_id=mid, output_index=0, content_index=0, delta=text),
        ev("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=text),
        ev("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part),
        ev("response.output_item.done", output_index=0, item=item),
        ev("response.completed", response=resp("completed", [item], True)),
    ]
    return sse(events), "text/event-stream"


def chat_answer(body: dict, opts) -> tuple[bytes, str]:
    model, cid, created = body.get("model") or "model", new_id("chatcmpl"), int(time.time())
    if not body.get("stream"):
        return json.dumps({"id": cid, "object": "chat.completion", "created": created, "model": model,
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": ANSWER}}],
                           "usage": {"prompt_tokens": rough_tokens(body), "completion_tokens": 1,
                                     "total_tokens": rough_tokens(body) + 1}}).encode(), "application/json"
    chunk = lambda delta, fin=None: {"id": cid, "object": "chat.completion.chunk", "created": created,  # noqa: E731
                                     "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": fin}]}
    data = [chunk({"role": "assistant", "content": ""}), chunk({"content": ANSWER}), chunk({}, "stop")]
    return b"".join(f"data: {json.dumps(d)}\n\n".encode() for d in data) + b"data: [DONE]\n\n", "text/event-stream"


def models_answer(opts) -> bytes:
    now = int(time.time())
    data = [{"id": m, "object": "model", "created": now, "owned_by": "capture",
             "type": "model", "display_name": m, "created_at": "2025-01-01T00:00:00Z"} for m in opts.models]
    return json.dumps({"object": "list", "data": data, "has_more": False,
                       "first_id": data[0]["id"] if data else None,
                       "last_id": data[-1]["id"] if data else None}).encode()
