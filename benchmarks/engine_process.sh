#!/usr/bin/env bash
# The engine in its own process: output tok/s at concurrency 32 and inter-token
# latency at concurrency 1, in-process against `--engine-process`, side by side.
#
#   benchmarks/engine_process.sh                        # smollm2-135m, 2 rounds
#   MODEL=qwen2.5-coder-0.5b ROUNDS=1 benchmarks/engine_process.sh
#
# One server at a time (2 cores), the arms alternating round by round (A B C A B C) so drift
# hits them alike: `inproc` (the engine loop on the API process's main thread, 2 torch threads),
# `proc` (--engine-process, 2 torch threads in the engine process) and `proc1` (--engine-process
# --num-threads 1: one core for the engine, one for HTTP, as vLLM's CPU build does). Random
# prompts, 128 output tokens with ignore_eos. Writes $RESULTS/<arm>_c<N>_r<R>.json, the server
# logs and summary.json (medians per arm and concurrency).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
MODEL=${MODEL:-smollm2-135m}
ROUNDS=${ROUNDS:-2}
PORT=${PORT:-8117}
RESULTS=${RESULTS:-$REPO/benchmarks/results/engine_process_${MODEL}}
LOCK=${LOCK:-/tmp/tessera-bench.lock}
mkdir -p "$RESULTS"
exec 9>"$LOCK"; flock 9
declare -A FLAGS=([inproc]="--num-threads 2" [proc]="--engine-process --num-threads 2"
                  [proc1]="--engine-process --num-threads 1")
pid=""
trap '[[ -n $pid ]] && { kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null || true; }' EXIT
for r in $(seq 1 "$ROUNDS"); do
  for arm in inproc proc proc1; do
    # shellcheck disable=SC2086
    "$PY" -m tessera serve "$MODEL" --port "$PORT" --max-num-seqs 32 ${FLAGS[$arm]} \
      > "$RESULTS/server_${arm}_r$r.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
      kill -0 $pid 2>/dev/null || { echo "server died, see $RESULTS/server_${arm}_r$r.log" >&2; exit 1; }
      sleep 1
    done
    for c in 32 1; do
      n=$(( c == 1 ? 8 : 96 ))
      "$PY" -m tessera bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --label "$arm" \
        --dataset random --prompt-words 50:300 --max-tokens 128:128 --concurrency "$c" --num-prompts "$n" \
        --seed "$r" --warmup 2 --no-progress --output "$RESULTS/${arm}_c${c}_r$r.json"
    done
    kill -TERM $pid; wait $pid 2>/dev/null || true; pid=""
  done
done
"$PY" - "$RESULTS" <<'PY'
import json, statistics, sys
from pathlib import Path
d = Path(sys.argv[1])
out = {}
for arm in ("inproc", "proc", "proc1"):
    for c in (32, 1):
        runs = [json.loads(f.read_text()) for f in sorted(d.glob(f"{arm}_c{c}_r*.json"))]
        runs = [x for run in runs for x in (run["runs"] if "runs" in run else [run])]
        if not runs:
            continue
        s = [x["summary"] for x in runs]
        out[f"{arm}_c{c}"] = {
            "output_tok_s": [x["output_tokens_per_s"] for x in s],
            "median_output_tok_s": statistics.median(x["output_tokens_per_s"] for x in s),
            "median_itl_p50_ms": statistics.median(x["itl_s"]["p50"] * 1000 for x in s),
            "median_ttft_p50_ms": statistics.median(x["ttft_s"]["p50"] * 1000 for x in s)}
(d / "summary.json").write_text(json.dumps(out, indent=2))
print(json.dumps(out, indent=2))
PY
