#!/usr/bin/env bash
# vLLM (CPU build) with speculative decoding: the peer's side of benchmarks/speculative.sh, same
# client, workload, seeds and levels, so its results sit beside Tessera's and compare directly.
#
#   benchmarks/peers/vllm_speculative.sh                     # qwen2.5-coder-1.5b, code-edit, concurrency 1
#   LEVELS="1 4" NUM="4 8" CONFIGS='ngram-k4={"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}' \
#     benchmarks/peers/vllm_speculative.sh
#   RESULTS=/tmp/smoke LEVELS=1 NUM=1 WORKLOAD_ARGS="--max-tokens 16:16" benchmarks/peers/vllm_speculative.sh
#
# For each configuration in CONFIGS (label=JSON for --speculative-config, "none" = no speculation)
# vLLM's OpenAI server is started on the Hugging Face folder of MODEL (compare.sh's vllm environment
# and flags, except --max-model-len 4096 as speculative.sh and libiomp, below), `tessera bench serve` runs each concurrency level (seed 1000 × level index,
# as speculative.sh), the vllm:spec_decode counters are read from /metrics, and the server is
# stopped. Writes $RESULTS/vllm-<label>_<dataset>_c<N>.json, vllm-<label>_<dataset>_metrics.txt,
# logs/vllm-<label>.log and summary_vllm_<dataset>.md. Runs hold flock on $LOCK.
#
# The folders come from the GGUFs Tessera serves (benchmarks/peers/setup_peers.sh hf):
# $PEERS_DIR/hf/qwen2.5-coder-1.5b (target) and $PEERS_DIR/hf/qwen2.5-coder-0.5b (draft).
# vLLM's start-up takes 2–3 minutes per configuration on 2 cores (compilation).
#
# LD_PRELOAD carries tcmalloc as in compare.sh and, unless IOMP="", the venv's Intel OpenMP
# (libiomp5.so): vLLM's CPU docs ask for both on x86, and its worker warns that speculative decoding
# without libiomp "will cause significant performance loss". Note that vLLM's automatic thread
# binding keeps one core for its scheduler process: on 2 cores the model runs on core 0 alone
# ("core ids=[0], reserved_cpus=[1]" in the log). VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU
# in the environment reach the server unchanged, to try otherwise.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PEERS_DIR=${PEERS_DIR:-/work/peers}
PY=${PY:-$REPO/.venv/bin/python}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
DRAFT_MODEL=${DRAFT_MODEL:-qwen2.5-coder-0.5b}
HF_DIR=${HF_DIR:-$PEERS_DIR/hf/$MODEL}
DRAFT_DIR=${DRAFT_DIR:-$PEERS_DIR/hf/$DRAFT_MODEL}
VLLM_BIN=${VLLM_BIN:-$PEERS_DIR/vllm-venv/bin/vllm}
TCMALLOC=${TCMALLOC:-/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4}
IOMP=${IOMP-$PEERS_DIR/vllm-venv/lib/libiomp5.so}
VLLM_KV_GIB=${VLLM_KV_GIB:-2}
VLLM_ARGS=${VLLM_ARGS:-""}
DATASET=${DATASET:-code-edit}
LEVELS=${LEVELS:-"1"}
NUM=${NUM:-"4"}
PORT=${PORT:-8113}
RESULTS=${RESULTS:-$REPO/benchmarks/results/speculative_${MODEL}}
WORKLOAD_ARGS=${WORKLOAD_ARGS:-"--max-tokens 256:384"}
CONFIGS=${CONFIGS:-"none=none ngram-k4={\"method\":\"ngram\",\"num_speculative_tokens\":4,\"prompt_lookup_max\":4} draft-k4={\"model\":\"$DRAFT_DIR\",\"num_speculative_tokens\":4}"}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-600}
LOCK=${LOCK:-/tmp/tessera-bench.lock}

[[ -x "$VLLM_BIN" ]] || { echo "no $VLLM_BIN: run benchmarks/peers/setup_peers.sh vllm" >&2; exit 1; }
[[ -f "$HF_DIR/config.json" ]] || { echo "no $HF_DIR: see benchmarks/peers/setup_peers.sh hf" >&2; exit 1; }
read -r -a levels <<< "$LEVELS"; read -r -a nums <<< "$NUM"
(( ${#levels[@]} == ${#nums[@]} )) || { echo "LEVELS and NUM need the same length" >&2; exit 2; }
PRELOAD=$TCMALLOC
if [[ -n "$IOMP" ]]; then
  [[ -f "$IOMP" ]] || { echo "no $IOMP (IOMP= to run without Intel OpenMP)" >&2; exit 1; }
  PRELOAD+=":$IOMP"
fi
mkdir -p "$RESULTS/logs"
log() { echo "[vllm_speculative $(date +%H:%M:%S)] $*"; }

exec 9>"$LOCK"
if ! flock -n 9; then log "waiting for $LOCK (another benchmark is running)"; flock 9; fi

pid=""
stop_server() {
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  pid=""
}
trap stop_server EXIT INT TERM

note_environment() {  # what else was running, kept with the results
  { echo "== $(date -Is) $*"; uptime; ps -eo pid,ni,pcpu,rss,comm --sort=-pcpu | head -8; } >> "$RESULTS/logs/environment.txt"
}

files=()
for entry in $CONFIGS; do
  label=${entry%%=*}; spec=${entry#*=}
  name=vllm-$label
  args=(serve "$HF_DIR" --served-model-name "$MODEL" --host 127.0.0.1 --port "$PORT"
        --max-num-seqs 32 --max-model-len 4096 --dtype bfloat16)
  [[ $spec != none ]] && args+=(--speculative-config "$spec")
  log "starting $name (speculative config: $spec)"
  # shellcheck disable=SC2086
  LD_PRELOAD="$PRELOAD" VLLM_CPU_KVCACHE_SPACE="$VLLM_KV_GIB" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 "$VLLM_BIN" "${args[@]}" $VLLM_ARGS > "$RESULTS/logs/$name.log" 2>&1 &
  pid=$!
  t0=$SECONDS
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$name exited during start-up; last lines of $RESULTS/logs/$name.log:" >&2
      tail -20 "$RESULTS/logs/$name.log" >&2; exit 1
    fi
    if (( SECONDS - t0 > STARTUP_TIMEOUT )); then
      echo "$name not ready after ${STARTUP_TIMEOUT}s; see $RESULTS/logs/$name.log" >&2; exit 1
    fi
    sleep 2
  done
  log "$name ready after $((SECONDS - t0)) s"
  for i in "${!levels[@]}"; do
    c=${levels[$i]}; n=${nums[$i]}
    note_environment "$name serve c=$c"
    # shellcheck disable=SC2086
    "$PY" -m tessera bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --label "$name" \
      --dataset "$DATASET" --endpoint chat --concurrency "$c" --num-prompts "$n" --seed $((1000 * i)) \
      --warmup 1 --no-progress $WORKLOAD_ARGS --output "$RESULTS/${name}_${DATASET}_c${c}.json"
    files+=("$RESULTS/${name}_${DATASET}_c${c}.json")
  done
  curl -s "http://127.0.0.1:$PORT/metrics" | grep '^vllm:spec_decode' > "$RESULTS/${name}_${DATASET}_metrics.txt" || true
  stop_server
done
"$PY" -m tessera bench report "${files[@]}" --output "$RESULTS/summary_vllm_${DATASET}.md"
log "done: $RESULTS/summary_vllm_${DATASET}.md"
