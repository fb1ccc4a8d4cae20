#!/usr/bin/env bash
# Reliability on a real model: the hostile-body corpus, a 1,000-stream cancel storm and
# schemathesis fuzzing of the OpenAPI schema, against one `tessera serve`.
#
#   benchmarks/reliability.sh                         # smollm2-135m
#   MODEL=qwen2.5-coder-0.5b EXAMPLES=50 benchmarks/reliability.sh
#
# The server runs with --max-model-len 512 so that fuzzed max_tokens values stay short (a request
# without max_tokens still generates up to 512 tokens: hence the 300 s client timeout). Writes
# $RESULTS/hostile.json, cancel_storm.json, schemathesis.txt (+ its JUnit report) and server.log.
# Overload and soak have their own scripts (benchmarks/overload.py, benchmarks/soak.py).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
ST=${ST:-$REPO/.venv/bin/st}
MODEL=${MODEL:-smollm2-135m}
EXAMPLES=${EXAMPLES:-100}
PORT=${PORT:-8117}
RESULTS=${RESULTS:-$REPO/benchmarks/results/reliability_${MODEL}}
LOCK=${LOCK:-/tmp/tessera-bench.lock}
mkdir -p "$RESULTS"
exec 9>"$LOCK"; flock 9
"$PY" -m tessera serve "$MODEL" --port "$PORT" --max-model-len 512 > "$RESULTS/server.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
  kill -0 $pid 2>/dev/null || { echo "server died, see $RESULTS/server.log" >&2; exit 1; }
  sleep 1
done
url="http://127.0.0.1:$PORT"
status=0
"$PY" -m tessera bench hostile --base-url "$url" --model "$MODEL" --output "$RESULTS/hostile.json" \
  > "$RESULTS/hostile.txt" || status=1
tail -1 "$RESULTS/hostile.txt"
"$PY" -m tessera bench cancel-storm --base-url "$url" --model "$MODEL" --requests 1000 \
  --output "$RESULTS/cancel_storm.json" > /dev/null || status=1
"$PY" -c 'import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ("requests","cut_before_response","cut_after_output","completed","errors","leaked_blocks","aborts_counted")})' "$RESULTS/cancel_storm.json"
# Positive and negative cases from the server's own schema; the check is "no 5xx".
"$ST" run "$url/openapi.json" --checks not_a_server_error --max-examples "$EXAMPLES" --workers 4 \
  --request-timeout 300 \
  --report junit --report-dir "$RESULTS/schemathesis-report" > "$RESULTS/schemathesis.txt" 2>&1 || status=1
grep -E "passed|failed|cases" "$RESULTS/schemathesis.txt" | tail -5
curl -s "$url/v1/engine/stats" | "$PY" -c 'import json,sys; s=json.load(sys.stdin)["scheduler"]; print("after all: blocks free", s["num_blocks_free"], "of", s["num_blocks_total"], "running", s["num_running"], "waiting", s["num_waiting"])'
exit $status
