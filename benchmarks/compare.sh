#!/usr/bin/env bash
# Side-by-side comparison: Tessera vs llama.cpp server vs vLLM (CPU build), same model,
# same workloads, same client (`tessera bench serve` / `tessera bench capacity`).
#
#   benchmarks/compare.sh                  full timed run (takes a while; run on a quiet machine)
#   benchmarks/compare.sh --smoke          start each server, 6 short requests 2 at a time, stop (no results kept)
#   benchmarks/compare.sh --servers tessera,vllm --no-capacity
#   benchmarks/compare.sh --servers tessera@bursty,tessera@multi-agent,tessera@fixed,vllm
#   benchmarks/compare.sh --servers tessera=main~3,tessera --no-capacity   (before/after a change)
#
# `tessera@PROFILE` runs Tessera with `--profile PROFILE` and its preset's own sequence cap
# (results labelled tessera-PROFILE); `tessera@fixed` is the fixed-budget scheduler of the
# fixed token budget (`--target-itl-ms 0 --max-num-batched-tokens 512`), the baseline for the
# latency-targeted one; `tessera@ngram` the default profile with n-gram speculation (4 tokens,
# looked up by their last 1-4 tokens in the context). Plain `tessera` uses the default profile with 32 sequences
# like the peers.
# `tessera=REV` runs the same settings on the Tessera source of git revision REV (a detached
# worktree under $REV_TREES, imported ahead of the installed package; results labelled
# tessera-REV), so a change is measured against its parent in the same run.
#
# Each server is started in turn on its own port with equivalent settings (32 concurrent
# sequences, 2048 tokens of context each), the runs are serialised by flock on $LOCK, and
# llama.cpp is restarted before every run because its prompt cache would otherwise serve
# prompts from the previous run. Per-level seeds differ (seed + 1000 × level), so no server's
# prefix cache sees a previous level's prompts either.
#
# Peers are built by benchmarks/peers/setup_peers.sh (default location /work/peers).
# Results: $RESULTS/<server>_<dataset>_c<N>.json, <server>_<dataset>_capacity.json, PNG plots
# beside them, summary_<dataset>.md (the table for docs/performance.md) and compare_<dataset>.png.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PEERS_DIR=${PEERS_DIR:-/work/peers}
MODEL=${MODEL:-smollm2-135m}
PY=${PY:-$REPO/.venv/bin/python}
RESULTS=${RESULTS:-$REPO/benchmarks/results}
LOCK=${LOCK:-/tmp/tessera-bench.lock}
REV_TREES=${REV_TREES:-/tmp/tessera-revs}
DATASET=${DATASET:-random}
SEED=${SEED:-0}
THREADS=${THREADS:-2}
CONCURRENCY=${CONCURRENCY-"1 4 16 32"}
NUM_PROMPTS=${NUM_PROMPTS-"8 16 48 96"}   # requests per concurrency level, same order ("" with CONCURRENCY="": capacity only)
WORKLOAD_ARGS=${WORKLOAD_ARGS:-"--prompt-words 50:400 --max-tokens 16:256"}
CAPACITY_ARGS=${CAPACITY_ARGS:-"--start-rate 0.25 --growth 2 --max-probes 7 --rel-tol 0.15 --probe-duration 20 --min-requests 10 --max-requests 60 --probe-timeout 90"}
SLO_ARGS=${SLO_ARGS:-"--slo-ttft 1 --slo-itl 0.05"}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-400}
VLLM_KV_GIB=${VLLM_KV_GIB:-2}
TESSERA_ARGS=${TESSERA_ARGS:-""}
LLAMA_SERVER=${LLAMA_SERVER:-$PEERS_DIR/llama.cpp/build/bin/llama-server}
VLLM_BIN=${VLLM_BIN:-$PEERS_DIR/vllm-venv/bin/vllm}
HF_DIR=${HF_DIR:-$PEERS_DIR/hf/$MODEL}
TCMALLOC=${TCMALLOC:-/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4}
declare -A PORT=([tessera]=8101 [llamacpp]=8102 [vllm]=8103)

SERVERS="tessera,llamacpp,vllm"
SMOKE=0
CAPACITY=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --servers) SERVERS=$2; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --no-capacity) CAPACITY=0; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

TESSERA=("$PY" -P -m tessera)  # -P: the source on PYTHONPATH (tessera=REV), not the current directory's
# The bench client; BENCH_CMD overrides it (e.g. "python -m tessera.bench.cli").
read -r -a BENCH <<< "${BENCH_CMD:-$PY -m tessera bench}"
LOGS=$RESULTS/logs
[[ $SMOKE == 1 ]] && { RESULTS=$(mktemp -d /tmp/tessera-smoke.XXXXXX); LOGS=$RESULTS/logs; }
mkdir -p "$RESULTS" "$LOGS"
log() { echo "[compare $(date +%H:%M:%S)] $*"; }

# One timed run at a time on this machine.
exec 9>"$LOCK"
if ! flock -n 9; then
  log "waiting for $LOCK (another benchmark is running)"
  flock 9
fi

GGUF=$("$PY" -c 'import sys; from tessera.models import registry; print(registry.ensure_model(sys.argv[1], progress=False))' "$MODEL")
SERVER_PID=""

stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT INT TERM

base_of() { local b=${1%%@*}; echo "${b%%=*}"; }  # tessera@PROFILE and tessera=REV are tessera
port_of() { echo "${PORT[$(base_of "$1")]}"; }  # ... and listen where it does
label_of() { local l=${1/@/-}; l=${l/=/-}; echo "${l//[~^\/]/_}"; }

rev_tree() {  # rev_tree REV: a worktree of that revision's source (made once)
  local dir
  dir=$REV_TREES/$(git -C "$REPO" rev-parse --short "$1")
  [[ -d $dir/tessera ]] || git -C "$REPO" worktree add --detach --force "$dir" "$1" >&2
  echo "$dir"
}

tessera_profile_args() {  # the flags of a tessera@PROFILE variant
  case "$1" in
    fixed) echo "--max-num-seqs 32 --target-itl-ms 0 --max-num-batched-tokens 512" ;;
    ngram) echo '--max-num-seqs 32 --speculative-config {"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}' ;;
    *) echo "--profile $1" ;;
  esac
}

start_server() {  # start_server NAME LOGFILE
  local name=$1 logfile=$2 port
  port=$(port_of "$1")
  stop_server
  case "$name" in
    tessera|tessera@*|tessera=*)
      local extra="--max-num-seqs 32" src=""
      [[ $name == tessera@* ]] && extra=$(tessera_profile_args "${name#tessera@}")
      [[ $name == tessera=* ]] && src=$(rev_tree "${name#tessera=}")
      # shellcheck disable=SC2086
      PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" "${TESSERA[@]}" serve "$MODEL" --host 127.0.0.1 --port "$port" \
        --served-model-name "$MODEL" --max-model-len 2048 --num-threads "$THREADS" $extra $TESSERA_ARGS \
        > "$logfile" 2>&1 &
      ;;
    llamacpp)
      [[ -x "$LLAMA_SERVER" ]] || { echo "no $LLAMA_SERVER: run benchmarks/peers/setup_peers.sh llama" >&2; exit 1; }
      # 32 slots × 2048 tokens; continuous batching is on by default.
      "$LLAMA_SERVER" -m "$GGUF" --alias "$MODEL" --host 127.0.0.1 --port "$port" \
        -np 32 -c 65536 -t "$THREADS" -tb "$THREADS" > "$logfile" 2>&1 &
      ;;
    vllm)
      [[ -x "$VLLM_BIN" ]] || { echo "no $VLLM_BIN: run benchmarks/peers/setup_peers.sh vllm" >&2; exit 1; }
      [[ -f "$HF_DIR/config.json" ]] || { echo "no $HF_DIR: run benchmarks/peers/setup_peers.sh hf" >&2; exit 1; }
      LD_PRELOAD="$TCMALLOC" VLLM_CPU_KVCACHE_SPACE="$VLLM_KV_GIB" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
        DO_NOT_TRACK=1 "$VLLM_BIN" serve "$HF_DIR" --served-model-name "$MODEL" --host 127.0.0.1 \
        --port "$port" --max-num-seqs 32 --max-model-len 2048 --dtype bfloat16 > "$logfile" 2>&1 &
      ;;
    *) echo "unknown server $name (tessera, llamacpp, vllm)" >&2; exit 2 ;;
  esac
  SERVER_PID=$!
  local t0=$SECONDS
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "$name exited during startup; last lines of $logfile:" >&2; tail -20 "$logfile" >&2; exit 1
    fi
    if (( SECONDS - t0 > STARTUP_TIMEOUT )); then
      echo "$name not ready after ${STARTUP_TIMEOUT}s; see $logfile" >&2; exit 1
    fi
    sleep 2
  done
  log "$name ready on port $port after $((SECONDS - t0)) s"
}

note_environment() {  # what else was running, kept with the results
  { echo "== $(date -Is) $*"; uptime; ps -eo pid,ni,pcpu,rss,comm --sort=-pcpu | head -8; } >> "$LOGS/environment.txt"
}

bench_serve() {  # bench_serve SERVER LEVEL_INDEX CONCURRENCY NUM_PROMPTS
  local name=$1 i=$2 c=$3 n=$4 port label
  port=$(port_of "$1"); label=$(label_of "$1")
  note_environment "$name serve c=$c"
  # shellcheck disable=SC2086
  "${BENCH[@]}" serve --base-url "http://127.0.0.1:$port" --model "$MODEL" --label "$label" \
    --dataset "$DATASET" --seed $((SEED + 1000 * i)) --concurrency "$c" --num-prompts "$n" --warmup 2 \
    $WORKLOAD_ARGS $SLO_ARGS --output "$RESULTS/${label}_${DATASET}_c${c}.json"
}

bench_capacity() {
  local name=$1 port label
  port=$(port_of "$1"); label=$(label_of "$1")
  note_environment "$name capacity"
  # shellcheck disable=SC2086
  "${BENCH[@]}" capacity --base-url "http://127.0.0.1:$port" --model "$MODEL" --label "$label" \
    --dataset "$DATASET" --seed $((SEED + 500000)) --warmup 2 $WORKLOAD_ARGS $SLO_ARGS $CAPACITY_ARGS \
    --output "$RESULTS/${label}_${DATASET}_capacity.json"
}

smoke() {
  local name=$1 port label
  port=$(port_of "$1"); label=$(label_of "$1")
  start_server "$name" "$LOGS/$label.log"
  "${BENCH[@]}" serve --base-url "http://127.0.0.1:$port" --model "$MODEL" --label "$label" \
    --concurrency 2 --num-prompts 6 --max-tokens 8 --prompt-words 20 --warmup 0 --no-progress \
    --output "$RESULTS/${label}_smoke.json"
  stop_server
}

IFS=, read -r -a SERVER_LIST <<< "$SERVERS"
read -r -a LEVELS <<< "$CONCURRENCY"
read -r -a COUNTS <<< "$NUM_PROMPTS"
(( ${#LEVELS[@]} == ${#COUNTS[@]} )) || { echo "CONCURRENCY and NUM_PROMPTS need the same length" >&2; exit 2; }

for name in "${SERVER_LIST[@]}"; do
  [[ -n "${PORT[$(base_of "$name")]:-}" ]] || { echo "unknown server $name (tessera[@PROFILE|=REV], llamacpp, vllm)" >&2; exit 2; }
  label=$(label_of "$name")
  if [[ $SMOKE == 1 ]]; then smoke "$name"; continue; fi
  log "== $label"
  for i in "${!LEVELS[@]}"; do
    if [[ $name == llamacpp || -z "$SERVER_PID" ]]; then
      start_server "$name" "$LOGS/${label}_${DATASET}_c${LEVELS[$i]}.log"
    fi
    bench_serve "$name" "$i" "${LEVELS[$i]}" "${COUNTS[$i]}"
  done
  if [[ $CAPACITY == 1 ]]; then
    [[ $name == llamacpp || -z "$SERVER_PID" ]] && start_server "$name" "$LOGS/${label}_${DATASET}_capacity.log"
    bench_capacity "$name"
  fi
  stop_server
done

if [[ $SMOKE == 1 ]]; then
  log "smoke results in $RESULTS"
  "${BENCH[@]}" report "$RESULTS"/*_smoke.json
  exit 0
fi
shopt -s nullglob
files=()
for name in "${SERVER_LIST[@]}"; do files+=("$RESULTS/$(label_of "$name")_${DATASET}"_*.json); done
"${BENCH[@]}" report "${files[@]}" --output "$RESULTS/summary_${DATASET}.md" \
  --plot "$RESULTS/compare_${DATASET}.png"
log "done: $RESULTS/summary_${DATASET}.md"
