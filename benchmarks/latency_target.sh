#!/usr/bin/env bash
# Measurement of latency-targeted scheduling.
#
#   benchmarks/latency_target.sh            all three parts (about an hour on 2 cores)
#   PARTS="c32" benchmarks/latency_target.sh
#
# c32:       closed loop at 32 concurrent requests, random workload: the fixed token budget of the
#            fixed-budget scheduler (tessera@fixed) against the bursty and multi-agent profiles (ITL p50/p95, tok/s).
# capacity:  highest Poisson rate meeting TTFT p95 <= 1 s and ITL p50 <= 50 ms, random workload:
#            Tessera (bursty, fixed budget) and vLLM's CPU build, one after the other in one run.
# workloads: the same capacity search on the shared-prefix and multi-turn workloads, Tessera
#            (bursty) against vLLM.
# Everything goes through benchmarks/compare.sh (same client, flock, one server at a time).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/benchmarks/results/latency_target}
PARTS=${PARTS:-"c32 capacity workloads"}
for part in $PARTS; do
  case "$part" in
    c32)
      RESULTS=$OUT/c32 CONCURRENCY=32 NUM_PROMPTS=96 \
        "$REPO/benchmarks/compare.sh" --servers tessera@fixed,tessera@bursty,tessera@multi-agent --no-capacity ;;
    capacity)
      RESULTS=$OUT/capacity_random CONCURRENCY="" NUM_PROMPTS="" \
        "$REPO/benchmarks/compare.sh" --servers tessera@bursty,tessera@fixed,vllm ;;
    workloads)
      for ds in shared-prefix multi-turn; do
        RESULTS=$OUT/capacity_$ds DATASET=$ds CONCURRENCY="" NUM_PROMPTS="" \
          "$REPO/benchmarks/compare.sh" --servers tessera@bursty,vllm
      done ;;
    *) echo "unknown part $part (c32, capacity, workloads)" >&2; exit 2 ;;
  esac
done
