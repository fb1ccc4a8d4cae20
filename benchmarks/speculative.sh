#!/usr/bin/env bash
# Speculative decoding, side by side in one run (same client, one server at a time):
#
#   benchmarks/speculative.sh                 # qwen2.5-coder-1.5b, code-edit, concurrency 1
#   LEVELS="1 4 16 32" NUM="4 8 32 64" DATASET=random MODEL=smollm2-135m benchmarks/speculative.sh
#
# For each configuration in CONFIGS (label=JSON, "none" = no speculation) the server is started,
# `tessera bench serve` runs each concurrency level, and the acceptance counters are read from
# /metrics. Writes $RESULTS/<label>_<dataset>_c<N>.json, <label>_<dataset>_metrics.txt and
# summary_<dataset>.md.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
DATASET=${DATASET:-code-edit}
LEVELS=${LEVELS:-"1"}
NUM=${NUM:-"4"}
PORT=${PORT:-8112}
RESULTS=${RESULTS:-$REPO/benchmarks/results/speculative_${MODEL}}
WORKLOAD_ARGS=${WORKLOAD_ARGS:-"--max-tokens 256:384"}
CONFIGS=${CONFIGS:-'none=none ngram-k4={"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}'}
LOCK=${LOCK:-/tmp/tessera-bench.lock}
mkdir -p "$RESULTS/logs"
exec 9>"$LOCK"; flock 9
read -r -a levels <<< "$LEVELS"; read -r -a nums <<< "$NUM"
files=()
for entry in $CONFIGS; do
  label=${entry%%=*}; spec=${entry#*=}
  args=(serve "$MODEL" --port "$PORT" --max-model-len 4096 --num-threads 2)
  [[ $spec != none ]] && args+=(--speculative-config "$spec")
  "$PY" -m tessera "${args[@]}" > "$RESULTS/logs/$label.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 $pid 2>/dev/null || { echo "server died, see $RESULTS/logs/$label.log" >&2; exit 1; }
    sleep 1
  done
  for i in "${!levels[@]}"; do
    c=${levels[$i]}; n=${nums[$i]}
    # shellcheck disable=SC2086
    "$PY" -m tessera bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --label "$label" \
      --dataset "$DATASET" --endpoint chat --concurrency "$c" --num-prompts "$n" --seed $((1000 * i)) \
      --warmup 1 --no-progress $WORKLOAD_ARGS --output "$RESULTS/${label}_${DATASET}_c${c}.json"
    files+=("$RESULTS/${label}_${DATASET}_c${c}.json")
  done
  curl -s "http://127.0.0.1:$PORT/metrics" | grep '^tessera:spec_decode' > "$RESULTS/${label}_${DATASET}_metrics.txt" || true
  kill -TERM $pid; wait $pid 2>/dev/null || true
done
"$PY" -m tessera bench report "${files[@]}" --output "$RESULTS/summary_${DATASET}.md"
