#!/usr/bin/env bash
# One user, one model: Tessera's streamed output tok/s at concurrency 1 and the server's peak
# resident memory, against the GGUF file size and the KV cache budget.
#
#   MODEL=qwen2.5-coder-1.5b benchmarks/single_user.sh
#
# Starts `tessera serve` with --kv-cache-memory $KV (default 512MiB), streams NUM_PROMPTS requests
# of the random workload one at a time (prompts of ~300 tokens, outputs of 128-256), then reads the
# server's VmHWM (peak RSS) summed over its processes (benchmarks/memory.py sets that beside
# llama.cpp's). Writes $RESULTS/single_user_<model>.json (bench results + memory).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
MODEL=${MODEL:-qwen2.5-coder-1.5b}
KV=${KV:-512MiB}
PORT=${PORT:-8111}
NUM_PROMPTS=${NUM_PROMPTS:-6}
RESULTS=${RESULTS:-$REPO/benchmarks/results/single_user}
TESSERA_ARGS=${TESSERA_ARGS:-""}
WORKLOAD_ARGS=${WORKLOAD_ARGS:-"--prompt-words 200:240 --max-tokens 128:256"}
mkdir -p "$RESULTS"
LOG=$RESULTS/logs/single_user_$MODEL.log
mkdir -p "$(dirname "$LOG")"

t0=$(date +%s.%N)
# shellcheck disable=SC2086
"$PY" -m tessera serve "$MODEL" --port "$PORT" --kv-cache-memory "$KV" $TESSERA_ARGS >"$LOG" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
  kill -0 $pid 2>/dev/null || { echo "server died, see $LOG" >&2; exit 1; }
  sleep 0.5
done
startup=$(echo "$(date +%s.%N) - $t0" | bc)
echo "server ready in ${startup}s"
# shellcheck disable=SC2086
"$PY" -m tessera bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --label tessera \
  --concurrency 1 --num-prompts "$NUM_PROMPTS" $WORKLOAD_ARGS --no-progress \
  --output "$RESULTS/single_user_${MODEL}_bench.json"
# Summed over the server's processes: the engine core runs in a child process of the front-end.
hwm_kib=$("$PY" -c "import sys; from tessera.hostinfo import process_tree
print(sum(int(l.split()[1]) for p in process_tree($pid) for l in open(f'/proc/{p}/status') if l.startswith('VmHWM')))")
gguf=$("$PY" -c "from tessera.models.registry import resolve_model; import os; print(os.path.getsize(resolve_model('$MODEL')))")
kv_bytes=$("$PY" -c "from tessera.engine.args import parse_size; print(parse_size('$KV'))")
"$PY" - "$RESULTS/single_user_${MODEL}_bench.json" "$RESULTS/single_user_$MODEL.json" <<PY
import json, sys
bench = json.load(open(sys.argv[1]))
out = {"model": "$MODEL", "startup_s": $startup, "peak_rss_bytes": $hwm_kib * 1024, "gguf_bytes": $gguf,
       "kv_cache_bytes": $kv_bytes, "tessera_args": "$TESSERA_ARGS", "bench": bench}
out["rss_over_gguf_plus_kv"] = out["peak_rss_bytes"] / (out["gguf_bytes"] + out["kv_cache_bytes"])
json.dump(out, open(sys.argv[2], "w"), indent=1)
out["output_tokens_per_s"] = bench["runs"][0]["summary"]["output_tokens_per_s"]
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(json.dumps({k: out[k] for k in ("model", "startup_s", "output_tokens_per_s", "peak_rss_bytes", "gguf_bytes",
                                      "rss_over_gguf_plus_kv")}))
PY
