#!/usr/bin/env bash
# Speculative decoding by method and concurrency, Tessera and vLLM's CPU build side by side
# (the table in docs/performance.md, "Speculative decoding"). About an hour on 2 cores.
#
#   benchmarks/speculative_methods.sh            # everything below, into $OUT
#   PARTS="tessera-c1 vllm-c1" benchmarks/speculative_methods.sh
#
# Parts (each runs one server at a time, under the shared benchmark lock):
#   tessera-c1   qwen2.5-coder-1.5b, code-edit, concurrency 1: none, n-gram k=4 and k=3, draft model
#                qwen2.5-coder-0.5b (int4) k=4 and k=2, layer skipping k=2
#   vllm-c1      the same workload on vLLM: none, n-gram k=4, draft model k=4 (benchmarks/peers/vllm_speculative.sh)
#   tessera-c4   qwen2.5-coder-1.5b, code-edit, concurrency 4: none, n-gram and draft with the default
#                policy (off above one running request) and with speculation kept on up to 4
#   smollm-load  smollm2-135m, random prompts, concurrency 1/4/16/32: none, n-gram and layer skipping
#                with the default policy (the ">= 0.95x at 32" check), n-gram kept on up to 4
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/benchmarks/results/spec_methods}
PARTS=${PARTS:-"tessera-c1 vllm-c1 tessera-c4 smollm-load"}
NG4='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}'
NG3='{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4}'
DR4='{"model":"qwen2.5-coder-0.5b","quantization":"int4","num_speculative_tokens":4}'
DR2='{"model":"qwen2.5-coder-0.5b","quantization":"int4","num_speculative_tokens":2}'
LS2='{"method":"layer_skip","num_speculative_tokens":2}'
NG4B4='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"disable_by_batch_size":4}'
DR4B4='{"model":"qwen2.5-coder-0.5b","quantization":"int4","num_speculative_tokens":4,"disable_by_batch_size":4}'
LSD='{"method":"layer_skip","num_speculative_tokens":2}'
mkdir -p "$OUT"
for part in $PARTS; do
  case $part in
    tessera-c1)
      RESULTS=$OUT/code-edit-c1 LEVELS=1 NUM=2 \
        CONFIGS="none=none ngram-k4=$NG4 ngram-k3=$NG3 draft-k4=$DR4 draft-k2=$DR2 layerskip-k2=$LS2" \
        "$REPO/benchmarks/speculative.sh" ;;
    vllm-c1)
      RESULTS=$OUT/code-edit-c1 LEVELS=1 NUM=2 "$REPO/benchmarks/peers/vllm_speculative.sh" ;;
    tessera-c4)
      RESULTS=$OUT/code-edit-c4 LEVELS=4 NUM=8 \
        CONFIGS="none=none ngram-k4=$NG4 ngram-k4-on4=$NG4B4 draft-k4=$DR4 draft-k4-on4=$DR4B4" \
        "$REPO/benchmarks/speculative.sh" ;;
    smollm-load)
      RESULTS=$OUT/random-smollm MODEL=smollm2-135m DATASET=random LEVELS="1 4 16 32" NUM="4 8 32 64" \
        WORKLOAD_ARGS="--prompt-words 50:400 --max-tokens 128:256" \
        CONFIGS="none=none ngram-k4=$NG4 ngram-k4-on4=$NG4B4 layerskip-k2=$LSD" \
        "$REPO/benchmarks/speculative.sh" ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
