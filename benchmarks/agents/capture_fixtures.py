"""capture.py's `export` (recorded requests into scrubbed test fixtures: credentials dropped,
ids, hostnames and usernames replaced by stable placeholders) and `summarize` (markdown notes
on fixtures: what a server must accept). Stdlib only.
"""
from __future__ import annotations

import getpass
import json
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization", "openai-organization",
                  "openai-project", "chatgpt-account-id"}

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
