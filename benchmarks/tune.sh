#!/usr/bin/env bash
# `tessera tune` against the default profile, verified by separate capacity runs.
#
#   benchmarks/tune.sh                       both workloads: random mix, then chat
#   WORKLOADS=chat BUDGET=30m benchmarks/tune.sh
#   SKIP_TUNE=1 ORDER="tuned default" SUFFIX=_run2 CAP_PROBES=6 benchmarks/tune.sh   # verify again, other order
#
# For each workload: `tessera tune smollm2-135m` within $BUDGET (the default profile first: the trials after it
# start their search at its capacity, so one that cannot beat it stops after one probe), then `tessera bench
# capacity` twice with the same workload and SLO: against `tessera serve
# smollm2-135m` (no flags: the default profile) and against `tessera serve --config tuned.toml`.
# The tuned settings count only by the second pair of figures, not by the tuner's own.
# Results: benchmarks/results/tune/<workload>/ (tune_report.json, tuned.toml, plots, capacity_*.json).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python}
MODEL=${MODEL:-smollm2-135m}
OUT=${OUT:-$REPO/benchmarks/results/tune}
WORKLOADS=${WORKLOADS:-"random chat"}
BUDGET=${BUDGET:-12m}
SLO_TTFT=${SLO_TTFT:-10}       # seconds, TTFT p95
SLO_ITL=${SLO_ITL:-1}       # seconds, ITL p50
SLO="ttft_p95<=${SLO_TTFT}s,itl_p50<=$(awk "BEGIN{print $SLO_ITL*1000}")ms"
MAX_TOKENS=${MAX_TOKENS:-4:32}
PROMPT_WORDS=${PROMPT_WORDS:-10:60}
PROBE=${PROBE:-30}
SKIP_TUNE=${SKIP_TUNE:-0}
ORDER=${ORDER:-"default tuned"}
SUFFIX=${SUFFIX:-}
CAP_PROBES=${CAP_PROBES:-5}
START_RATE=${START_RATE:-0.1}   # req/s of the first probe, tuner and capacity runs alike
TUNE_PROBES=${TUNE_PROBES:-4}   # most probes a tuner trial
PORT=${PORT:-8731}  # one pipeline per workload may run at once: give each its own PORT
common_workload() {  # the same requests for the tuner and the capacity runs
  case "$1" in
    random) echo "--prompt-words $PROMPT_WORDS --max-tokens $MAX_TOKENS" ;;
    chat) echo "--turns 3 --max-tokens $MAX_TOKENS" ;;
  esac
}
capacity() {  # label, workload, server flags...
  local label=$1 wl=$2; shift 2
  "$PY" -m tessera serve "$@" --port "$PORT" --no-ui --disable-log-stats --log-level warning \
      > "$OUT/$wl/server_$label.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
  "$PY" -m tessera bench capacity --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --label "$label" \
      --dataset "$wl" $(common_workload "$wl") --slo-ttft "$SLO_TTFT" --slo-itl "$SLO_ITL" \
      --start-rate "$START_RATE" --growth 1.5 --max-probes "$CAP_PROBES" --min-rate 0.03 --probe-duration "$PROBE" --min-requests 6 \
      --no-progress --output "$OUT/$wl/capacity_$label.json" | tail -3
  kill -TERM "$pid"; wait "$pid" || true
}
for wl in $WORKLOADS; do
  mkdir -p "$OUT/$wl"
  lscpu | grep "Model name" > "$OUT/$wl/host.txt"; uptime >> "$OUT/$wl/host.txt"
  [ "$SKIP_TUNE" = 1 ] || /usr/bin/time -f "tune wall %e s" "$PY" -m tessera tune "$MODEL" --workload "$wl" --slo "$SLO" \
      --time-budget "$BUDGET" --output-dir "$OUT/$wl" --start-rate "$START_RATE" --min-rate 0.03 --max-probes "$TUNE_PROBES" \
      --probe-duration "$PROBE" --min-requests 6 $(common_workload "$wl") 2>&1 | tee "$OUT/$wl/tune.log"
  for which in $ORDER; do
    case "$which" in
      default) capacity "default$SUFFIX" "$wl" "$MODEL" ;;
      tuned) capacity "tuned$SUFFIX" "$wl" --config "$OUT/$wl/tuned.toml" ;;
    esac
  done
  uptime >> "$OUT/$wl/host.txt"
done
