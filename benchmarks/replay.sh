#!/usr/bin/env bash
# Record real traffic on Tessera, then replay the trace against Tessera and vLLM's CPU build.
#
#   benchmarks/replay.sh                         record a chat trace, replay it at 1x on both servers
#   SERVERS=tessera SPEEDS="1x 2x" benchmarks/replay.sh
#
# 1. `tessera serve MODEL --record-traffic trace.jsonl` takes a multi-turn chat load (conversations behind
#    shared system prompts, Poisson arrivals at $RATE conversations/s) from `tessera bench serve`; the
#    trace keeps arrival times, token counts, sampling settings and prefix-block hashes, not the text.
# 2. `tessera bench replay trace.jsonl` sends the same arrivals, lengths and prefix sharing (synthetic
#    text) to each server in turn, started fresh, at each speed in $SPEEDS; one report for all.
# vLLM comes from benchmarks/peers/setup_peers.sh (vllm, then hf for its Hugging Face folder).
# Results: benchmarks/results/replay/ (trace.jsonl, <server>_<speed>.json, summary.md, plots).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
MODEL=${MODEL:-smollm2-135m}
PEERS_DIR=${PEERS_DIR:-/work/peers}
OUT=${OUT:-$REPO/benchmarks/results/replay}
SERVERS=${SERVERS:-"tessera vllm"}
SPEEDS=${SPEEDS:-"1x"}
RATE=${RATE:-0.5}            # conversations per second while recording
CONVERSATIONS=${CONVERSATIONS:-48}
SLO_ARGS=${SLO_ARGS:-"--slo-ttft 1 --slo-itl 0.05"}
PORT=${PORT:-8751}
VLLM_KV_GIB=${VLLM_KV_GIB:-2}
TCMALLOC=${TCMALLOC:-/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
SERVER_PID=""
stop_server() {
  [[ -n "$SERVER_PID" ]] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}
trap stop_server EXIT
start_server() {  # start_server NAME LOG [tessera flags...]
  local name=$1 log=$2; shift 2
  case "$name" in
    tessera) "$PY" -m tessera serve "$MODEL" --port "$PORT" --no-ui --max-model-len 2048 "$@" > "$log" 2>&1 & ;;
    vllm)
      LD_PRELOAD="$TCMALLOC" VLLM_CPU_KVCACHE_SPACE="$VLLM_KV_GIB" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
        DO_NOT_TRACK=1 "$PEERS_DIR/vllm-venv/bin/vllm" serve "$PEERS_DIR/hf/$MODEL" --served-model-name "$MODEL" \
        --host 127.0.0.1 --port "$PORT" --max-num-seqs 32 --max-model-len 2048 --dtype bfloat16 > "$log" 2>&1 & ;;
    *) echo "unknown server $name (tessera, vllm)" >&2; exit 2 ;;
  esac
  SERVER_PID=$!
  for _ in $(seq 400); do
    curl -sf "$URL/health" > /dev/null 2>&1 && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "$name exited during startup, see $log" >&2; tail -20 "$log" >&2; exit 1; }
    sleep 1
  done
  echo "$name not ready after 400 s, see $log" >&2; exit 1
}
{ lscpu | grep "Model name"; uptime; } > "$OUT/host.txt"
if [[ ! -f "$OUT/trace.jsonl" ]]; then
  start_server tessera "$OUT/record_server.log" --record-traffic "$OUT/trace.jsonl"
  # shellcheck disable=SC2086
  "$PY" -m tessera bench serve --base-url "$URL" --model "$MODEL" --label recorded --dataset chat --turns 3 \
    --request-rate "$RATE" --num-prompts "$CONVERSATIONS" --max-tokens 16:128 --warmup 0 --no-progress $SLO_ARGS \
    --output "$OUT/recorded.json" | tail -3
  stop_server
fi
for server in $SERVERS; do
  for speed in $SPEEDS; do
    start_server "$server" "$OUT/${server}_${speed}_server.log"
    # shellcheck disable=SC2086
    "$PY" -m tessera bench replay "$OUT/trace.jsonl" --base-url "$URL" --model "$MODEL" --label "$server-$speed" \
      --tokenizer "$MODEL" --speed "$speed" --warmup 2 --no-progress $SLO_ARGS --output "$OUT/${server}_${speed}.json" | tail -3
    stop_server
  done
done
uptime >> "$OUT/host.txt"
"$PY" -m tessera bench report "$OUT"/recorded.json "$OUT"/*_*x.json --output "$OUT/summary.md" --plot "$OUT/replay.png"
