#!/usr/bin/env bash
# Drive the real agent CLIs (Claude Code over /v1/messages, Codex CLI over /v1/responses) against
# a local OpenAI/Anthropic-compatible server and record whether each check passes.
#
# Checks (CHECKS selects a subset, space separated):
#   claude_text  claude -p "<prompt>"                       ok: exit 0 and a non-empty final answer
#   codex_text   codex exec "<prompt>"                      ok: exit 0 and a non-empty final answer
#   claude_tool  claude -p "Run the shell command `echo tessera-<token>` and tell me its output."
#                ok: exit 0, the transcript holds a Bash tool_use whose command has the token and a
#                tool_result with the token (the command ran), and the final answer has the token
#   codex_tool   the same prompt through codex exec
#                ok: exit 0, a completed command_execution whose output has the token, and the
#                final agent message has the token
#
# Environment:
#   BASE_URL       server root, no /v1 (default http://127.0.0.1:8000)
#   MODEL          served model name (default qwen2.5-coder-1.5b)
#   SERVER_LABEL   names the run: tessera, llamacpp, ... (default tessera)
#   OUT            results folder (default benchmarks/results/agents/<UTC date-time>-<label>)
#   AGENTS_DIR     where install_clients.sh installed the CLIs (default /work/agents)
#   TIMEOUT        seconds per client run (default 600)
#   API_KEY        sent as the API key (default dummy)
#   CONTEXT_TOKENS the model's context window, told to both clients (default 32768; empty = unset)
#   MAX_OUTPUT_TOKENS  Claude Code's max_tokens (CLAUDE_CODE_MAX_OUTPUT_TOKENS; default 4096;
#                  empty = the client's default, 32000). Codex sends no max_output_tokens.
#   MAX_RETRIES    client retries on a failed request (default 1)
#   CHECKS         default "claude_text codex_text claude_tool codex_tool"
#   KEEP_HOMES=1   keep the throwaway HOME / CODEX_HOME folders (under $AGENTS_DIR/homes)
#   FORCE=1        run the clients even when nothing answers at BASE_URL (else exit 2 at once)
#
# Nothing but BASE_URL's host is reached: the proxy variables point at a closed port on
# 127.0.0.1 (BLOCK_PROXY), with NO_PROXY covering BASE_URL's host, so the clients' update checks,
# telemetry and plugin syncs fail fast on this machine. Outputs per check in $OUT:
#   <check>.stdout (claude: stream-json --verbose events; codex: --json events), <check>.stderr,
#   <check>.last.txt (codex -o), and summary.json with exit status, ok, seconds and the answer.
# Exit status: 0 when every selected check is ok, 1 otherwise, 2 when the server is unreachable
# or the clients are missing.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
BASE_URL="${BASE_URL:-http://127.0.0.1:8000}"
BASE_URL="${BASE_URL%/}"
BASE_URL="${BASE_URL%/v1}"
MODEL="${MODEL:-qwen2.5-coder-1.5b}"
SERVER_LABEL="${SERVER_LABEL:-tessera}"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
OUT="${OUT:-$repo/benchmarks/results/agents/$stamp-$SERVER_LABEL}"
AGENTS_DIR="${AGENTS_DIR:-/work/agents}"
TIMEOUT="${TIMEOUT:-600}"
API_KEY="${API_KEY:-dummy}"
CONTEXT_TOKENS="${CONTEXT_TOKENS-32768}"
MAX_OUTPUT_TOKENS="${MAX_OUTPUT_TOKENS-4096}"
MAX_RETRIES="${MAX_RETRIES:-1}"
CHECKS="${CHECKS:-claude_text codex_text claude_tool codex_tool}"
BLOCK_PROXY="${BLOCK_PROXY:-http://127.0.0.1:9}"
PY="${PYTHON:-python3}"
TEXT_PROMPT="${TEXT_PROMPT:-Reply with the single word: ready}"
TOKEN="tessera-$(od -An -N4 -tx1 /dev/urandom | tr -d ' \n')"
TOOL_PROMPT="Run the shell command \`echo $TOKEN\` and tell me its output."

export PATH="$AGENTS_DIR/bin:$PATH"
for bin in claude codex; do
  command -v "$bin" >/dev/null || { echo "$bin not found in $AGENTS_DIR/bin; run benchmarks/agents/install_clients.sh" >&2; exit 2; }
done

host="$("$PY" -c 'import sys, urllib.parse as u; print(u.urlsplit(sys.argv[1]).hostname or "")' "$BASE_URL")"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
HOMES="$AGENTS_DIR/homes/run-$stamp-$SERVER_LABEL-$$"
WORKDIR="$HOMES/work"   # the clients' cwd: empty, outside the repository
mkdir -p "$HOMES" "$WORKDIR"
cleanup() { [ "${KEEP_HOMES:-0}" = 1 ] || rm -rf "$HOMES"; }
trap cleanup EXIT

versions="$(printf 'claude=%s\ncodex=%s\n' "$(DISABLE_AUTOUPDATER=1 claude --version 2>/dev/null | head -n1)" \
  "$(codex --version 2>/dev/null | head -n1)")"
echo "$versions"
echo "server: $SERVER_LABEL at $BASE_URL, model $MODEL, token $TOKEN, results in $OUT"

# One look at the server before the clients (recorded, not fatal).
preflight="$("$PY" - "$BASE_URL" "$API_KEY" <<'EOF'
import json, sys, urllib.error, urllib.request
url, key = sys.argv[1] + "/v1/models", sys.argv[2]
try:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}", "x-api-key": key})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # straight to BASE_URL
    with opener.open(req, timeout=10) as r:
        ids = [m.get("id") for m in json.load(r).get("data", [])]
    print(json.dumps({"reachable": True, "models_ok": True, "models": ids}))
except urllib.error.HTTPError as exc:  # it answered: let the clients try
    print(json.dumps({"reachable": True, "models_ok": False, "error": f"HTTP {exc.code}"}))
except Exception as exc:  # noqa: BLE001
    print(json.dumps({"reachable": False, "models_ok": False, "error": str(exc)[:300]}))
EOF
)"
echo "preflight: $preflight"
if [[ "$preflight" == *'"reachable": false'* && "${FORCE:-0}" != 1 ]]; then
  # Codex waits for the network until TIMEOUT when nothing listens; don't spend that per check.
  printf '{"server_label": "%s", "base_url": "%s", "model": "%s", "started_utc": "%s", "preflight": %s, "checks": {}, "passed": 0, "total": 0, "error": "server unreachable; FORCE=1 runs the clients anyway"}\n' \
    "$SERVER_LABEL" "$BASE_URL" "$MODEL" "$stamp" "$preflight" >"$OUT/summary.json"
  echo "server unreachable at $BASE_URL (FORCE=1 to run the clients anyway)" >&2
  exit 2
fi

isolation_env() {  # home
  mkdir -p "$1/tmp"  # keep the clients' scratch files (/tmp/claude-<uid>, ...) in the throwaway home
  echo HOME="$1" TMPDIR="$1/tmp" PATH="$PATH" TERM=dumb LANG=C.UTF-8 NO_COLOR=1 \
    HTTP_PROXY="$BLOCK_PROXY" HTTPS_PROXY="$BLOCK_PROXY" ALL_PROXY="$BLOCK_PROXY" \
    http_proxy="$BLOCK_PROXY" https_proxy="$BLOCK_PROXY" all_proxy="$BLOCK_PROXY" \
    NO_PROXY="$host,127.0.0.1,localhost" no_proxy="$host,127.0.0.1,localhost"
}

claude_env() {
  local e=(ANTHROPIC_BASE_URL="$BASE_URL" ANTHROPIC_API_KEY="$API_KEY"
    ANTHROPIC_SMALL_FAST_MODEL="$MODEL" ANTHROPIC_DEFAULT_HAIKU_MODEL="$MODEL"
    ANTHROPIC_DEFAULT_SONNET_MODEL="$MODEL" ANTHROPIC_DEFAULT_OPUS_MODEL="$MODEL" CLAUDE_CODE_SUBAGENT_MODEL="$MODEL"
    DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1 DISABLE_AUTOUPDATER=1 DISABLE_BUG_COMMAND=1
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 CLAUDE_CODE_MAX_RETRIES="$MAX_RETRIES"
    API_TIMEOUT_MS="$((TIMEOUT * 1000))")
  [ -n "$CONTEXT_TOKENS" ] && e+=(CLAUDE_CODE_MAX_CONTEXT_TOKENS="$CONTEXT_TOKENS")
  [ -n "$MAX_OUTPUT_TOKENS" ] && e+=(CLAUDE_CODE_MAX_OUTPUT_TOKENS="$MAX_OUTPUT_TOKENS")
  echo "${e[@]}"
}

write_codex_config() {  # codex_home
  {
    echo "model = \"$MODEL\""
    echo "model_provider = \"local\""
    echo "check_for_update_on_startup = false"
    [ -n "$CONTEXT_TOKENS" ] && echo "model_context_window = $CONTEXT_TOKENS"
    cat <<EOF

[model_providers.local]
name = "$SERVER_LABEL"
base_url = "$BASE_URL/v1"
wire_api = "responses"
env_key = "LOCAL_API_KEY"
request_max_retries = $MAX_RETRIES
stream_max_retries = $MAX_RETRIES
stream_idle_timeout_ms = $((TIMEOUT * 1000))

[analytics]
enabled = false

[feedback]
enabled = false
EOF
  } >"$1/config.toml"
}

declare -A RC SECS
run_check() {  # check
  local check="$1" home="$HOMES/$1" t0 rc
  mkdir -p "$home"
  t0=$(date +%s%N)
  case "$check" in
    claude_text|claude_tool)
      local prompt="$TEXT_PROMPT" extra=()
      [ "$check" = claude_tool ] && prompt="$TOOL_PROMPT" && extra=(--allowedTools Bash)
      # --dangerously-skip-permissions is refused as root; allowing Bash is enough here.
      (cd "$WORKDIR" && env -i $(isolation_env "$home") $(claude_env) \
        timeout "$TIMEOUT" claude -p "$prompt" --model "$MODEL" --output-format stream-json --verbose \
          "${extra[@]}" >"$OUT/$check.stdout" 2>"$OUT/$check.stderr" </dev/null)
      rc=$? ;;
    codex_text|codex_tool)
      local prompt="$TEXT_PROMPT" extra=()
      [ "$check" = codex_tool ] && prompt="$TOOL_PROMPT" && extra=(--dangerously-bypass-approvals-and-sandbox)
      write_codex_config "$home"
      (cd "$WORKDIR" && env -i $(isolation_env "$home") CODEX_HOME="$home" LOCAL_API_KEY="$API_KEY" \
        timeout "$TIMEOUT" codex exec --skip-git-repo-check --ephemeral --json --color never \
          -o "$OUT/$check.last.txt" "${extra[@]}" "$prompt" \
          >"$OUT/$check.stdout" 2>"$OUT/$check.stderr" </dev/null)
      rc=$? ;;
    *) echo "unknown check $check" >&2; return ;;
  esac
  RC[$check]=$rc
  SECS[$check]=$(( ($(date +%s%N) - t0) / 1000000 ))  # milliseconds
  echo "$check: exit $rc ($((SECS[$check] / 1000)) s)"
}

for check in $CHECKS; do run_check "$check"; done

rc_json="{"; sep=""
for check in $CHECKS; do
  [ -n "${RC[$check]+x}" ] || continue
  rc_json+="$sep\"$check\": {\"exit\": ${RC[$check]}, \"ms\": ${SECS[$check]:-0}}"; sep=", "
done
rc_json+="}"

"$PY" - "$OUT" "$TOKEN" "$rc_json" "$SERVER_LABEL" "$BASE_URL" "$MODEL" "$versions" "$preflight" "$stamp" <<'EOF'
import json, sys
from pathlib import Path

out, token, rcs, label, base_url, model, versions, preflight, stamp = sys.argv[1:10]
out, rcs = Path(out), json.loads(rcs)


def events(path):
    evs = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    evs.append(json.loads(line))
                except ValueError:
                    pass
    return evs


def text_of(content):
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(text_of(c) for c in content)
    if isinstance(content, dict):
        return text_of(content.get("text") or content.get("content") or "")
    return ""


def claude(check, evs):
    result = next((e for e in reversed(evs) if e.get("type") == "result"), {})
    answer = result.get("result") or ""
    calls, results, texts = [], [], []
    for e in evs:
        msg = e.get("message") or {}
        content = msg.get("content") if isinstance(msg.get("content"), list) else []
        for block in content:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "tool_use":
                calls.append({"name": block.get("name"), "input": block.get("input")})
            elif block.get("type") == "tool_result":
                results.append(text_of(block.get("content")))
            elif block.get("type") == "text" and e.get("type") == "assistant":
                texts.append(block.get("text") or "")
    if not answer and texts:
        answer = texts[-1]
    info = {"answer": answer[:2000], "is_error": result.get("is_error"), "subtype": result.get("subtype"),
            "num_turns": result.get("num_turns"), "tool_calls": calls[:10], "usage": result.get("usage")}
    if check == "claude_tool":
        ran = any(c["name"] == "Bash" and token in json.dumps(c["input"]) for c in calls)
        out_ok = any(token in r for r in results)
        info.update(command_called=ran, command_output_seen=out_ok, answer_has_token=token in answer)
        info["checks_ok"] = ran and out_ok and token in answer
    else:
        info["checks_ok"] = bool(answer.strip()) and result.get("is_error") is not True
    return info


def codex(check, evs, last):
    msgs = [e["item"].get("text") or "" for e in evs
            if e.get("type") == "item.completed" and (e.get("item") or {}).get("type") == "agent_message"]
    cmds = [e["item"] for e in evs
            if e.get("type") == "item.completed" and (e.get("item") or {}).get("type") == "command_execution"]
    errors = [e for e in evs if e.get("type") in ("error", "turn.failed")]
    answer = last or (msgs[-1] if msgs else "")
    info = {"answer": answer[:2000], "commands": [{k: c.get(k) for k in ("command", "exit_code", "status",
                                                                          "aggregated_output")} for c in cmds][:10],
            "errors": errors[:5],
            "usage": next((e.get("usage") for e in reversed(evs) if e.get("type") == "turn.completed"), None)}
    if check == "codex_tool":
        ran = any(token in (c.get("command") or "") and c.get("exit_code") == 0 for c in cmds)
        out_ok = any(token in (c.get("aggregated_output") or "") for c in cmds)
        info.update(command_called=ran, command_output_seen=out_ok, answer_has_token=token in answer)
        info["checks_ok"] = ran and out_ok and token in answer
    else:
        info["checks_ok"] = bool(answer.strip()) and not any(e.get("type") == "turn.failed" for e in errors)
    return info


checks = {}
for check, rc in rcs.items():
    evs = events(out / f"{check}.stdout")
    if check.startswith("claude"):
        info = claude(check, evs)
    else:
        last_file = out / f"{check}.last.txt"
        info = codex(check, evs, last_file.read_text().strip() if last_file.exists() else "")
    info.update(exit=rc["exit"], seconds=round(rc["ms"] / 1000, 2), timed_out=rc["exit"] in (124, 137))
    info["ok"] = rc["exit"] == 0 and info.pop("checks_ok")
    checks[check] = {k: info[k] for k in ("ok", "exit", "seconds", "timed_out")} | info

summary = {"server_label": label, "base_url": base_url, "model": model, "started_utc": stamp,
           "token": token, "clients": dict(l.split("=", 1) for l in versions.splitlines() if "=" in l),
           "preflight": json.loads(preflight), "checks": checks,
           "passed": sum(c["ok"] for c in checks.values()), "total": len(checks)}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
for name, c in checks.items():
    print(f"{name}: {'ok' if c['ok'] else 'FAIL'} (exit {c['exit']}, {c['seconds']} s) answer={c['answer'][:100]!r}")
print(f"{summary['passed']} passed, {summary['total'] - summary['passed']} failed")
sys.exit(0 if summary["passed"] == summary["total"] else 1)
EOF
