#!/usr/bin/env bash
# Throughput cost of structured output: output tok/s at concurrency 16 with every
# request constrained by its own JSON schema, against the same prompts unconstrained.
#
#   benchmarks/structured_output.sh                     # qwen2.5-coder-0.5b, 3 rounds of 48 requests
#   MODEL=smollm2-135m ROUNDS=1 benchmarks/structured_output.sh
#
# One server; the two arms alternate (free, json, free, json, ...) so drift hits both alike.
# The json-schema dataset asks each request for an object with given fields; the constrained
# arm sends the schema as response_format, the free arm the same prompt without it (the model
# usually writes JSON anyway, so output lengths are alike). Both run at temperature 0.8 and
# end where the model ends (no ignore_eos). Writes $RESULTS/{free,json}_r<N>.json, the
# server's grammar metrics (metrics.txt) and summary.md (`tessera bench report`).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
MODEL=${MODEL:-qwen2.5-coder-0.5b}
CONCURRENCY=${CONCURRENCY:-16}
NUM=${NUM:-48}
ROUNDS=${ROUNDS:-3}
PORT=${PORT:-8113}
RESULTS=${RESULTS:-$REPO/benchmarks/results/structured_output_${MODEL}}
LOCK=${LOCK:-/tmp/tessera-bench.lock}
mkdir -p "$RESULTS"
exec 9>"$LOCK"; flock 9
"$PY" -m tessera serve "$MODEL" --port "$PORT" --num-threads 2 --max-num-seqs "$CONCURRENCY" \
  > "$RESULTS/server.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
  kill -0 $pid 2>/dev/null || { echo "server died, see $RESULTS/server.log" >&2; exit 1; }
  sleep 1
done
files=()
for r in $(seq 1 "$ROUNDS"); do
  for arm in free json; do
    extra=(); [[ $arm == free ]] && extra=(--no-constraint)
    "$PY" -m tessera bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --label "$arm" \
      --dataset json-schema --temperature 0.8 --max-tokens 400:400 --concurrency "$CONCURRENCY" \
      --num-prompts "$NUM" --seed "$r" --warmup 2 --no-progress "${extra[@]}" --output "$RESULTS/${arm}_r$r.json"
    files+=("$RESULTS/${arm}_r$r.json")
  done
done
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^tessera:(structured_output|grammar_compile)' > "$RESULTS/metrics.txt" || true
"$PY" -m tessera bench report "${files[@]}" --output "$RESULTS/summary.md"
"$PY" - "$RESULTS" <<'PY'
import json, statistics, sys
from pathlib import Path
d = Path(sys.argv[1])
def tput(arm):
    vals = []
    for f in sorted(d.glob(f"{arm}_r*.json")):
        run = json.loads(f.read_text())
        runs = run["runs"] if "runs" in run else [run]
        vals += [x["summary"]["output_tokens_per_s"] for x in runs]
    return vals
free, js = tput("free"), tput("json")
out = {"free_tok_s": free, "json_tok_s": js, "median_free": statistics.median(free),
       "median_json": statistics.median(js), "ratio": statistics.median(js) / statistics.median(free)}
(d / "ratio.json").write_text(json.dumps(out, indent=2))
print(json.dumps(out, indent=2))
PY
