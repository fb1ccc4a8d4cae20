#!/usr/bin/env bash
# The peer table in one run, on one host: the rows of docs/performance.md's per-machine tables,
# Tessera against llama.cpp server and vLLM's CPU build (benchmarks/peers):
#   1. smollm2-135m, random workload, 1/4/16/32 concurrent users: Tessera, llama.cpp, vLLM;
#   2. qwen2.5-coder-1.5b, code-edit prompts, one user: Tessera, Tessera with n-gram
#      speculation, llama.cpp (vLLM's CPU build cannot run the Q4_K_M file);
#   3. qwen2.5-coder-1.5b, 512-token prompts, one output token (the prefill): Tessera, llama.cpp.
# Each part is one benchmarks/compare.sh run (one server at a time, same client); then one
# table of all rows with the host it ran on: $OUT/summary.md. About 35 minutes on 2 cores.
#
#   benchmarks/peer_table.sh                                  # OUT=benchmarks/results/peer_table
#   OUT=DIR PARTS="smollm2 qwen1.5b" benchmarks/peer_table.sh # some parts only
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/benchmarks/results/peer_table}
PARTS=${PARTS:-"smollm2 qwen1.5b prefill512"}
PY=${PY:-$REPO/.venv/bin/python}
mkdir -p "$OUT"

for part in $PARTS; do
  case "$part" in
    smollm2)
      CONCURRENCY="1 4 16 32" NUM_PROMPTS="16 32 48 96" RESULTS="$OUT/smollm2" \
        "$REPO/benchmarks/compare.sh" --servers tessera,llamacpp,vllm --no-capacity ;;
    qwen1.5b)
      MODEL=qwen2.5-coder-1.5b DATASET=code-edit CONCURRENCY=1 NUM_PROMPTS=8 WORKLOAD_ARGS="--max-tokens 128:256" \
        RESULTS="$OUT/qwen1.5b" "$REPO/benchmarks/compare.sh" --servers tessera,tessera@ngram,llamacpp --no-capacity ;;
    prefill512)
      MODEL=qwen2.5-coder-1.5b DATASET=random CONCURRENCY=1 NUM_PROMPTS=6 \
        WORKLOAD_ARGS="--prompt-words 510:510 --max-tokens 1:1" RESULTS="$OUT/prefill512" \
        "$REPO/benchmarks/compare.sh" --servers llamacpp,tessera --no-capacity ;;
    *) echo "unknown part $part (smollm2, qwen1.5b, prefill512)" >&2; exit 2 ;;
  esac
done

shopt -s nullglob
files=()
for part in $PARTS; do files+=("$OUT/$part"/*_c*.json); done
"$PY" -m tessera bench report "${files[@]}" --output "$OUT/summary.md"
echo "table: $OUT/summary.md"
