#!/usr/bin/env bash
# What API keys cost: output tok/s at concurrency 32 with and without them, side by side in one run.
#
#   benchmarks/access_overhead.sh            3 rounds (no keys, keys) of 96 requests each
#   ROUNDS=5 benchmarks/access_overhead.sh
#
# "keys" serves with --api-keys-file: ten keys, the client's with every per-key limit set (rpm,
# tpm, max_concurrent, allowed models) high enough never to refuse, so each request pays for the
# whole path (ten digest comparisons, the scope lookup, the buckets, the per-token charging, the
# x-ratelimit headers, the per-key metrics). Rounds alternate so both variants see the same
# machine; the medians are compared. Results: $RESULTS/access_overhead.json.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
MODEL=${MODEL:-smollm2-135m}
RESULTS=${RESULTS:-$REPO/benchmarks/results/access_overhead}
ROUNDS=${ROUNDS:-3}
PORT=${PORT:-8131}
NUM_PROMPTS=${NUM_PROMPTS:-96}
WORKLOAD_ARGS=${WORKLOAD_ARGS:-"--prompt-words 50:200 --max-tokens 32:96"}
SECRET=sk-bench-$(date +%s)
mkdir -p "$RESULTS"
KEYS=$RESULTS/keys.toml
: > "$KEYS"
for i in $(seq 1 9); do
  printf '[[key]]\nname = "other-%d"\nsha256 = "%s"\n\n' "$i" "$(printf %s "sk-other-$i" | sha256sum | cut -d' ' -f1)" >> "$KEYS"
done
printf '[[key]]\nname = "bench"\nsha256 = "%s"\nscopes = ["admin"]\nrpm = 1000000\ntpm = 1000000000\nmax_concurrent = 1000\nmodels = ["%s"]\n' \
  "$(printf %s "$SECRET" | sha256sum | cut -d' ' -f1)" "$MODEL" >> "$KEYS"

SERVER_PID=
stop_server() { if [[ -n $SERVER_PID ]]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; SERVER_PID=; fi; }
trap stop_server EXIT INT TERM

run() {  # run VARIANT ROUND
  local variant=$1 round=$2 extra=() key=()
  if [[ $variant == keys ]]; then extra=(--api-keys-file "$KEYS"); key=(--api-key "$SECRET"); fi
  PYTHONPATH=$REPO "$PY" -m tessera serve "$MODEL" --port "$PORT" --max-num-seqs 32 --disable-log-stats \
    "${extra[@]}" > "$RESULTS/server_${variant}_$round.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
  # shellcheck disable=SC2086
  PYTHONPATH=$REPO "$PY" -m tessera bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" "${key[@]}" \
    --concurrency 32 --num-prompts "$NUM_PROMPTS" --seed "$round" $WORKLOAD_ARGS --no-progress \
    --output "$RESULTS/${variant}_$round.json" > "$RESULTS/bench_${variant}_$round.log" 2>&1
  stop_server
}

for round in $(seq 1 "$ROUNDS"); do
  run none "$round"
  run keys "$round"
done

"$PY" - "$RESULTS" "$ROUNDS" <<'PY'
import json, statistics, sys
from pathlib import Path
folder, rounds = Path(sys.argv[1]), int(sys.argv[2])
tps = {v: [json.loads((folder / f"{v}_{r}.json").read_text())["runs"][0]["summary"]["output_tokens_per_s"]
           for r in range(1, rounds + 1)] for v in ("none", "keys")}
med = {v: statistics.median(x) for v, x in tps.items()}
doc = {"output_tokens_per_s": tps, "median": med, "keys_vs_none": med["keys"] / med["none"]}
(folder / "access_overhead.json").write_text(json.dumps(doc, indent=1) + "\n")
print(json.dumps(doc, indent=1))
PY
