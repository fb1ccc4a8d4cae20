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

The replies are in capture_answers.py, export and summarize in capture_fixtures.py.
benchmarks/agents/capture_clients.sh drives both clients through it and writes the fixtures.
"""
from __future__ import annotations

import argparse
import base64
import gzip
import itertools
import json
import re
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from capture_answers import anthropic_answer, chat_answer, models_answer, new_id, responses_answer, rough_tokens
from capture_fixtures import SECRET_HEADERS, export, summarize

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
