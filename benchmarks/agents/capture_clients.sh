#!/usr/bin/env bash
# Capture the exact HTTP requests that the installed Claude Code and Codex CLI send, against
# benchmarks/agents/capture.py on 127.0.0.1, and write them as test fixtures:
#   tests/fixtures/agents/claude_code_<n>.json, tests/fixtures/agents/codex_<n>.json
#
# Scenarios (each with a fresh capture folder and a fresh throwaway HOME / CODEX_HOME):
#   claude_text   claude -p "Say ready."                                   (1 request)
#   claude_json   claude -p "Say ready." --output-format json              (1 request)
#   claude_tool   capture.py --tool-call answers with a Bash tool_use; the second request
#                 carries the tool_result; --output-format stream-json --verbose --allowedTools Bash
#   codex_text    codex exec --skip-git-repo-check "Say ready."            (1 request)
#   codex_tool    capture.py --tool-call answers with an exec_command function_call; the second
#                 request carries function_call_output; --json --dangerously-bypass-approvals-and-sandbox
#
# Nothing leaves the machine: HTTP(S)_PROXY point at the capture server itself, which records any
# CONNECT (a client phoning home) and refuses it; NO_PROXY keeps 127.0.0.1 direct.
#
#   AGENTS_DIR  where install_clients.sh put the CLIs (default /work/agents)
#   WORK        raw records, transcripts, work dirs (default /tmp/agent-capture, wiped)
#   HOMES       throwaway homes (default $AGENTS_DIR/homes/capture, wiped; not under /tmp because
#               codex refuses to create its helper binaries under a temporary dir)
#   FIXTURES    where the fixtures go (default <repo>/tests/fixtures/agents)
#   MODEL       model name the clients ask for (default qwen2.5-coder-1.5b)
#   TIMEOUT     seconds per client run (default 120)
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
AGENTS_DIR="${AGENTS_DIR:-/work/agents}"
WORK="${WORK:-/tmp/agent-capture}"
HOMES="${HOMES:-$AGENTS_DIR/homes/capture}"
FIXTURES="${FIXTURES:-$repo/tests/fixtures/agents}"
MODEL="${MODEL:-qwen2.5-coder-1.5b}"
TIMEOUT="${TIMEOUT:-120}"
TOKEN="tessera-capture"
PY="${PYTHON:-python3}"
export PATH="$AGENTS_DIR/bin:$PATH"

for bin in claude codex; do
  command -v "$bin" >/dev/null || { echo "$bin not found; run benchmarks/agents/install_clients.sh" >&2; exit 2; }
done
rm -rf "$WORK" "$HOMES"
mkdir -p "$WORK" "$HOMES" "$FIXTURES"

capture_pid=""
port=""
start_capture() {  # name [capture.py options...]
  local name="$1"; shift
  rm -f "$WORK/$name.port"
  "$PY" "$here/capture.py" serve --dir "$WORK/rec/$name" --port-file "$WORK/$name.port" \
    --models "$MODEL" "$@" >"$WORK/$name.capture.log" 2>&1 &
  capture_pid=$!
  for _ in $(seq 50); do [ -s "$WORK/$name.port" ] && break; sleep 0.1; done
  port="$(cat "$WORK/$name.port")"
}
stop_capture() {
  [ -n "$capture_pid" ] && kill "$capture_pid" 2>/dev/null && wait "$capture_pid" 2>/dev/null
  capture_pid=""
}
trap stop_capture EXIT

base_env() {  # home
  mkdir -p "$1/tmp"  # keep the clients' scratch files (/tmp/claude-<uid>, ...) in the throwaway home
  echo PATH="$PATH" HOME="$1" TMPDIR="$1/tmp" TERM=dumb LANG=C.UTF-8 \
    HTTP_PROXY="http://127.0.0.1:$port" HTTPS_PROXY="http://127.0.0.1:$port" ALL_PROXY="http://127.0.0.1:$port" \
    http_proxy="http://127.0.0.1:$port" https_proxy="http://127.0.0.1:$port" \
    NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost
}

run_claude() {  # name [claude args...]
  local name="$1"; shift
  local home="$HOMES/$name" cwd="$WORK/cwd-$name"
  mkdir -p "$home" "$cwd"
  (cd "$cwd" && env -i $(base_env "$home") \
    ANTHROPIC_BASE_URL="http://127.0.0.1:$port" ANTHROPIC_API_KEY=dummy \
    DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1 DISABLE_AUTOUPDATER=1 DISABLE_BUG_COMMAND=1 \
    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
    timeout "$TIMEOUT" claude -p "$@" --model "$MODEL" \
      >"$WORK/$name.stdout" 2>"$WORK/$name.stderr" </dev/null)
  echo "$name: exit $?"
}

write_codex_config() {  # home
  cat >"$1/config.toml" <<EOF
model = "$MODEL"
model_provider = "tessera"
check_for_update_on_startup = false

[model_providers.tessera]
name = "Tessera"
base_url = "http://127.0.0.1:$port/v1"
wire_api = "responses"
env_key = "TESSERA_API_KEY"

[analytics]
enabled = false

[feedback]
enabled = false
EOF
}

run_codex() {  # name [codex exec args...]
  local name="$1"; shift
  local home="$HOMES/$name" cwd="$WORK/cwd-$name"
  mkdir -p "$home" "$cwd"
  write_codex_config "$home"
  (cd "$cwd" && env -i $(base_env "$home") CODEX_HOME="$home" TESSERA_API_KEY=dummy \
    timeout "$TIMEOUT" codex exec --skip-git-repo-check "$@" \
      >"$WORK/$name.stdout" 2>"$WORK/$name.stderr" </dev/null)
  echo "$name: exit $?"
}

echo "claude $(claude --version 2>/dev/null | head -n1), codex $(codex --version 2>/dev/null | head -n1)" | tee "$WORK/versions.txt"
TOOL_PROMPT="Run the shell command \`echo $TOKEN\` and tell me its output."

start_capture claude_text;  run_claude claude_text "Say ready.";                          stop_capture
start_capture claude_json;  run_claude claude_json "Say ready." --output-format json;     stop_capture
start_capture claude_tool --tool-call
run_claude claude_tool "$TOOL_PROMPT" --output-format stream-json --verbose --allowedTools Bash
stop_capture
start_capture codex_text;   run_codex codex_text "Say ready.";                            stop_capture
start_capture codex_tool --tool-call
run_codex codex_tool --json --dangerously-bypass-approvals-and-sandbox "$TOOL_PROMPT"
stop_capture

echo "phone-home attempts (CONNECTs refused by the capture server):"
cat "$WORK"/*.capture.log | grep '^CONNECT' | sort | uniq -c || true

rm -f "$FIXTURES"/claude_code_*.json "$FIXTURES"/codex_*.json
"$PY" "$here/capture.py" export --out "$FIXTURES" --prefix claude_code --client "claude-code $(claude --version 2>/dev/null | awk '{print $1}')" \
  "$WORK/rec/claude_text" "$WORK/rec/claude_json" "$WORK/rec/claude_tool"
"$PY" "$here/capture.py" export --out "$FIXTURES" --prefix codex --client "$(codex --version 2>/dev/null | head -n1)" \
  "$WORK/rec/codex_text" "$WORK/rec/codex_tool"
"$PY" "$here/capture.py" summarize "$FIXTURES"/claude_code_*.json "$FIXTURES"/codex_*.json >"$WORK/summary.md"
echo "fixtures in $FIXTURES; transcripts and raw records in $WORK; summary in $WORK/summary.md"
