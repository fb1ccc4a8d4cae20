#!/usr/bin/env python3
"""Record the exact HTTP requests an agent CLI sends, answering just enough to keep it going.

Stdlib only. Two sub-commands:

  serve   an HTTP server on 127.0.0.1 that writes every request (method, path with query,
          headers minus credentials, body) to DIR as numbered JSON files and answers:
            POST /v1/messages[?...]               Anthropic Messages, JSON or SSE per `stream`
            POST /v1/messages/count_tokens[?...]  {"input_tokens": N}
            POST /v1/responses[?...]              OpenAI Responses, SSE or JSON per `stream`
            POST /v1/chat/completions             OpenAI chat completion, SSE or JSON
            GET  /v1/models, /models              a model list (OpenAI and Anthropic fields)
            anything else                         404 JSON
          The text answer is "ready". With --tool-call, a request that offers a shell tool
          (Claude Code's Bash; Codex's shell / shell_command / exec_command / local_shell) and
          ends in a user text turn holding a command in backticks (`echo hi`) is answered with
          one call of that tool running that command; the request carrying the tool result is
          answered with a text that quotes the tool's output, so a full tool round trip (and
          the shape of the second turn) can be captured and run_agents.sh can be checked
          without a model.

  export  turn recorded requests into test fixtures: method, path, the headers that matter
          and the whole body (never truncated), with credentials dropped and session / user
          ids, hostnames and usernames replaced by stable placeholders.

  python benchmarks/agents/capture.py serve --dir /tmp/cap --port 0 --port-file /tmp/cap.port
  python benchmarks/agents/capture.py export --out tests/fixtures/agents --prefix codex /tmp/cap/a /tmp/cap/b

benchmarks/agents/capture_clients.sh drives both clients through it and writes the fixtures.
"""
from __future__ import annotations

import argparse
import base64
import getpass
import gzip
import itertools
import json
import os
import re
import socket
import sys
import threading
import time
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization", "openai-organization",
                  "openai-project", "chatgpt-account-id"}
ANSWER = "ready"

# ----------------------------------------------------------------------------- answers


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


# ----------------------------------------------------------------------------- server


def decode_body(raw: bytes, encoding: str) -> tuple[bytes | None, str | None]:
    encoding = (encoding or "").strip().lower()
    try:
        if encoding in ("", "identity"):
            return raw, None
        if encoding in ("gzip", "x-gzip"):
            return gzip.decompress(raw), None
        if encoding == "deflate":
            return zlib.decompress(raw), None
        if encoding == "zstd":
            import zstandard  # not stdlib; optional

            return zstandard.ZstdDecompressor().decompressobj().decompress(raw), None
    except Exception as exc:  # noqa: BLE001
        return None, f"cannot decode {encoding}: {exc}"
    return None, f"unsupported content-encoding {encoding}"


class Recorder:
    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        existing = [int(p.name.split("_", 1)[0]) for p in folder.glob("[0-9]*_*.json")]
        self.counter = itertools.count(max(existing, default=0) + 1)
        self.lock = threading.Lock()

    def write(self, record: dict) -> Path:
        with self.lock:
            n = next(self.counter)
        target = record["path"] if record["method"] == "CONNECT" else urlsplit(record["path"]).path
        slug = re.sub(r"[^A-Za-z0-9]+", "_", target).strip("_")[:60] or "root"
        path = self.folder / f"{n:04d}_{record['method']}_{slug}.json"
        record = {"seq": n, **record}
        path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
        return path


def make_handler(opts, recorder: Recorder):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "capture/1"

        def log_message(self, fmt, *args):  # quiet default logging; we print our own line
            pass

        def _read_body(self) -> bytes:
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                out = b""
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return out
                    out += self.rfile.read(size)
                    self.rfile.readline()
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _handle(self):
            raw = self._read_body()
            record: dict = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "method": self.command,
                            "path": self.path, "http_version": self.request_version,
                            "headers": {k.lower(): v for k, v in self.headers.items()
                                        if k.lower() not in SECRET_HEADERS},
                            "dropped_headers": sorted({k.lower() for k in self.headers.keys()} & SECRET_HEADERS)}
            body = None
            if raw:
                plain, err = decode_body(raw, self.headers.get("Content-Encoding"))
                if plain is None:
                    record["body_error"], record["body_base64"] = err, base64.b64encode(raw).decode()
                else:
                    try:
                        body = json.loads(plain)
                        record["body"] = body
                    except ValueError:
                        record["body_text"] = plain.decode("utf-8", "replace")
            status, payload, ctype = self._route(body)
            record["response"] = {"status": status, "content_type": ctype}
            written = recorder.write(record)
            print(f"{self.command} {self.path} -> {status} {ctype} [{written.name}]", flush=True)
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            if ctype == "text/event-stream":
                self.send_header("Cache-Control", "no-cache")
            self.send_header("request-id", new_id("req"))
            self.send_header("x-request-id", new_id("req"))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _route(self, body) -> tuple[int, bytes, str]:
            path = urlsplit(self.path).path.rstrip("/") or "/"
            if path.startswith(opts.strip_prefix) and opts.strip_prefix:
                path = path[len(opts.strip_prefix):] or "/"
            if self.command == "CONNECT":  # the client tried to reach the outside through us as a proxy
                self.close_connection = True
                return 403, json.dumps({"error": "capture server refuses to proxy"}).encode(), "application/json"
            post = self.command == "POST"
            body = body if isinstance(body, dict) else {}
            if post and path == "/v1/messages":
                payload, ctype = anthropic_answer(body, opts)
                return 200, payload, ctype
            if post and path == "/v1/messages/count_tokens":
                return 200, json.dumps({"input_tokens": rough_tokens(body)}).encode(), "application/json"
            if post and path in ("/v1/responses", "/responses"):
                payload, ctype = responses_answer(body, opts)
                return 200, payload, ctype
            if post and path in ("/v1/chat/completions", "/chat/completions"):
                payload, ctype = chat_answer(body, opts)
                return 200, payload, ctype
            if self.command in ("GET", "HEAD") and path in ("/v1/models", "/models"):
                return 200, models_answer(opts), "application/json"
            err = {"type": "error", "error": {"type": "not_found_error", "message": f"no route {self.command} {path}",
                                              "code": "not_found", "param": None}}
            return 404, json.dumps(err).encode(), "application/json"

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_CONNECT = _handle

    return Handler


def serve(opts) -> None:
    recorder = Recorder(Path(opts.dir))
    httpd = ThreadingHTTPServer(("127.0.0.1", opts.port), make_handler(opts, recorder))
    httpd.daemon_threads = True
    port = httpd.server_address[1]
    if opts.port_file:
        Path(opts.port_file).write_text(f"{port}\n")
    print(f"capture listening on http://127.0.0.1:{port} -> {opts.dir}", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()


# ----------------------------------------------------------------------------- export

DROP_HEADERS = SECRET_HEADERS | {"host", "content-length", "connection", "accept-encoding"}
UUID_RE = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I)
HEX64_RE = re.compile(r"\b[0-9a-f]{64}\b", re.I)


class Scrubber:
    """Stable placeholders for ids, hostnames and usernames across one export."""

    def __init__(self, extra: list[str]):
        self.ids: dict[str, str] = {}
        self.hexes: dict[str, str] = {}
        self.words: list[tuple[str, str]] = []
        host = socket.gethostname()
        names = {host: "capture-host", host.split(".")[0]: "capture-host"}
        try:
            fqdn, aliases, addrs = socket.gethostbyname_ex(host)
            names.update({n: "capture-host" for n in [fqdn, *aliases]})
            names.update({a: "192.0.2.1" for a in addrs if not a.startswith("127.")})  # this machine's IPs
        except OSError:
            pass
        user = getpass.getuser()
        if user and user not in ("root",) and len(user) > 2:
            names[user] = "capture-user"
        for w in extra:
            names[w] = "scrubbed"
        # longest first so an fqdn is replaced before its first label
        self.words = sorted(((k, v) for k, v in names.items() if k and k not in ("localhost", "localhost.localdomain")),
                            key=lambda kv: -len(kv[0]))

    def _uuid(self, m: re.Match) -> str:
        key = m.group(0).lower()
        if key not in self.ids:
            self.ids[key] = f"00000000-0000-4000-8000-{len(self.ids) + 1:012d}"
        return self.ids[key]

    def _hex(self, m: re.Match) -> str:
        key = m.group(0).lower()
        if key not in self.hexes:
            self.hexes[key] = f"{len(self.hexes) + 1:064x}"
        return self.hexes[key]

    def text(self, s: str) -> str:
        s = UUID_RE.sub(self._uuid, s)
        s = HEX64_RE.sub(self._hex, s)
        for word, repl in self.words:
            s = re.sub(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", repl, s)
        return s

    def any(self, v):
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, list):
            return [self.any(x) for x in v]
        if isinstance(v, dict):
            return {self.text(k): self.any(x) for k, x in v.items()}
        return v


def export(opts) -> None:
    """Number the records of every SRC folder, in order, as PREFIX_1.json, PREFIX_2.json, ..."""
    dst = Path(opts.out)
    dst.mkdir(parents=True, exist_ok=True)
    scrub = Scrubber(opts.scrub or [])
    n = 0
    for src in map(Path, opts.src):
        files = sorted(src.glob("[0-9]*_*.json"), key=lambda p: int(p.name.split("_", 1)[0]))
        for f in files:
            rec = json.loads(f.read_text())
            if rec["method"] == "CONNECT" or (opts.only_posts and rec["method"] != "POST"):
                continue  # CONNECTs are the client trying to go outside through the proxy variables
            n += 1
            headers = {k: v for k, v in rec.get("headers", {}).items() if k not in DROP_HEADERS}
            out = {"method": rec["method"], "path": rec["path"], "headers": scrub.any(headers)}
            if rec.get("dropped_headers"):
                out["credential_headers_sent"] = rec["dropped_headers"]
            for key in ("body", "body_text", "body_error", "body_base64"):
                if key in rec:
                    out[key] = scrub.any(rec[key])
            out["_capture"] = {"client": opts.client or opts.prefix, "scenario": src.name,
                               "answered": rec.get("response", {})}
            target = dst / f"{opts.prefix}_{n}.json"
            target.write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
            print(f"{src.name}/{f.name} -> {target}")


# ----------------------------------------------------------------------------- summarize

SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "max_output_tokens", "stop_sequences", "stop",
            "seed", "frequency_penalty", "presence_penalty", "n", "logprobs", "top_logprobs")


def _short(v, n=160) -> str:
    s = (v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)).replace("\n", "\\n")
    return s if len(s) <= n else s[:n] + f"... ({len(s)} chars)"


def _block_types(content) -> str:
    if isinstance(content, str):
        return "string"
    if not isinstance(content, list):
        return type(content).__name__
    out = []
    for b in content:
        if not isinstance(b, dict):
            out.append(type(b).__name__)
            continue
        t = b.get("type", "?")
        if "cache_control" in b:
            t += f"+cache_control{_short(b['cache_control'], 60)}"
        if t.startswith("tool_result"):
            t += f"(content={_block_types(b.get('content'))}, is_error={b.get('is_error')})"
        out.append(t)
    return "[" + ", ".join(out) + "]"


def summarize_messages(body: dict) -> list[str]:
    lines = []
    system = body.get("system")
    if isinstance(system, list):
        cc = [i for i, b in enumerate(system) if isinstance(b, dict) and "cache_control" in b]
        lines.append(f"- system: list of {len(system)} blocks {_block_types(system)}; "
                     f"cache_control on block(s) {cc} ({', '.join(_short(system[i]['cache_control'], 60) for i in cc)})")
    else:
        lines.append(f"- system: {type(system).__name__}" + (f" ({len(system)} chars)" if isinstance(system, str) else ""))
    msgs = body.get("messages") or []
    lines.append(f"- messages ({len(msgs)}), roles in order: {[m.get('role') for m in msgs]}")
    for i, m in enumerate(msgs):
        lines.append(f"  - [{i}] {m.get('role')}: {_block_types(m.get('content'))}")
    tools = body.get("tools") or []
    typed = [t for t in tools if isinstance(t, dict) and "type" in t]
    extra_keys = sorted({k for t in tools if isinstance(t, dict) for k in t} - {"name", "description", "input_schema"})
    lines.append(f"- tools: {len(tools)}: {[t.get('name') for t in tools]}")
    lines.append(f"  - tool entries with a `type` field: {[(t.get('type'), t.get('name')) for t in typed] or 'none'}")
    lines.append(f"  - tool keys besides name/description/input_schema: {extra_keys or 'none'}")
    for t in tools:
        odd = {k: v for k, v in t.items() if k not in ("name", "description", "input_schema")}
        if odd:
            lines.append(f"    - {t.get('name')}: {_short(odd, 200)}")
    for key in ("tool_choice", "thinking", "metadata", "context_management", "output_config", "stream",
                "service_tier", "container", "mcp_servers"):
        if key in body:
            lines.append(f"- {key}: {_short(body[key], 220)}")
    return lines


def summarize_responses(body: dict) -> list[str]:
    lines = []
    inp = body.get("input")
    if isinstance(inp, str):
        lines.append(f"- input: string ({len(inp)} chars)")
    else:
        lines.append(f"- input items ({len(inp or [])}):")
        for i, it in enumerate(inp or []):
            desc = it.get("type", "(no type)")
            if "role" in it:
                desc += f" role={it['role']}"
            if isinstance(it.get("content"), list):
                desc += f" content={_block_types(it['content'])}"
            elif "content" in it:
                desc += f" content={type(it['content']).__name__}"
            keys = sorted(set(it) - {"type", "role", "content"})
            desc += f" keys={keys}"
            if it.get("type") == "function_call":
                desc += f" name={it.get('name')} arguments={_short(it.get('arguments'), 80)}"
            if it.get("type", "").endswith("_output"):
                desc += f" output={_short(it.get('output'), 60)}"
            lines.append(f"  - [{i}] {desc}")
    tools = body.get("tools") or []
    lines.append(f"- tools ({len(tools)}):")
    for t in tools:
        keys = sorted(set(t) - {"type", "name", "description", "parameters"})
        extra = f" nested={[(n.get('type'), n.get('name')) for n in t['tools']]}" if "tools" in t else ""
        lines.append(f"  - type={t.get('type')} name={t.get('name')} other keys={keys}{extra}")
    if "instructions" in body:
        ins = body["instructions"]
        lines.append(f"- instructions: {type(ins).__name__} ({len(ins) if isinstance(ins, str) else ''} chars)")
    else:
        lines.append("- instructions: absent (the base prompt is a `developer` input message)")
    for key in ("stream", "store", "include", "prompt_cache_key", "reasoning", "text", "tool_choice",
                "parallel_tool_calls", "previous_response_id", "service_tier", "truncation", "user",
                "safety_identifier", "prompt", "metadata", "client_metadata", "background", "conversation"):
        if key in body:
            lines.append(f"- {key}: {_short(body[key], 220)}")
    return lines


def summarize(opts) -> None:
    out = []
    for f in opts.files:
        rec = json.loads(Path(f).read_text())
        body = rec.get("body")
        split = urlsplit(rec["path"])
        cap = rec.get("_capture", {})
        out.append(f"### {Path(f).name}  ({cap.get('client', '')}, scenario `{cap.get('scenario', '')}`)")
        out.append(f"- {rec['method']} `{split.path}` query=`{split.query or '(none)'}`; "
                   f"capture answered {cap.get('answered', {}).get('content_type', '?')}")
        hdr = {k: v for k, v in rec.get("headers", {}).items() if not k.startswith("x-stainless")}
        stainless = sorted(k for k in rec.get("headers", {}) if k.startswith("x-stainless"))
        for k, v in hdr.items():
            out.append(f"- header `{k}`: `{_short(v, 300)}`")
        if stainless:
            out.append(f"- also {len(stainless)} x-stainless-* headers ({', '.join(stainless)})")
        if rec.get("credential_headers_sent"):
            out.append(f"- credential headers sent (dropped from the fixture): {rec['credential_headers_sent']}")
        if not isinstance(body, dict):
            out.append(f"- body: {type(body).__name__}")
            out.append("")
            continue
        out.append(f"- body: {len(json.dumps(body))} bytes; top-level keys: {list(body)}")
        sampling = {k: body[k] for k in SAMPLING if k in body}
        out.append(f"- model: `{body.get('model')}`; sampling / length fields: {sampling or 'none'}")
        if "messages" in body:
            out.extend(summarize_messages(body))
        elif "input" in body:
            out.extend(summarize_responses(body))
        out.append("")
    print("\n".join(out))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="record requests and answer them")
    s.add_argument("--dir", required=True, help="folder for the numbered request records")
    s.add_argument("--port", type=int, default=0, help="0 picks a free port")
    s.add_argument("--port-file", help="write the bound port here")
    s.add_argument("--models", nargs="*", default=["qwen2.5-coder-1.5b", "claude-sonnet-4-5"],
                   help="ids listed by GET /v1/models")
    s.add_argument("--tool-call", action="store_true",
                   help="answer a user turn that offers a shell tool and names a `command` with one call of it")
    s.add_argument("--strip-prefix", default="", help="path prefix to ignore when routing")
    e = sub.add_parser("export", help="turn records into scrubbed fixtures")
    e.add_argument("src", nargs="+", help="record folders, numbered in this order")
    e.add_argument("--out", required=True, help="fixture folder")
    e.add_argument("--prefix", required=True, help="fixture name prefix, e.g. claude_code or codex")
    e.add_argument("--client", help="client label stored under _capture (default: the prefix)")
    e.add_argument("--scrub", nargs="*", help="extra words to replace with 'scrubbed'")
    e.add_argument("--only-posts", action="store_true", help="skip GET/HEAD records")
    m = sub.add_parser("summarize", help="markdown notes on fixtures (what a server must accept)")
    m.add_argument("files", nargs="+")
    opts = ap.parse_args(argv)
    {"serve": serve, "export": export, "summarize": summarize}[opts.cmd](opts)


if __name__ == "__main__":
    sys.exit(main())
