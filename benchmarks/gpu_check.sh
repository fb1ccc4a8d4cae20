#!/usr/bin/env bash
# The GPU check as one device run (about 6-8 minutes on an H200): the tests of the CUDA path, then
# benchmarks/gpu_check.py for SmolLM2-135M's and Qwen2-1.5B's shapes (random weights, written on the
# machine). JSON and logs go to $OUT (the device tool's folder) or benchmarks/results/gpu/.
#
#   bash benchmarks/gpu_check.sh
#
# Needs torch with CUDA, triton, transformers, tokenizers, pytest and hypothesis (the H200 image has
# them); the server's own packages (fastapi, ...) are not used.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_runner.py tests/kernels/test_triton_attention.py \
    tests/engine/test_sampler.py 2>&1 | tail -n 30 | tee "$OUT/tests.log"
python3 benchmarks/gpu_check.py --shape smollm2-135m --concurrency 1 32 --out "$OUT/smollm2-135m.json" \
    2>&1 | tail -n 40 | tee "$OUT/smollm2-135m.log"
python3 benchmarks/gpu_check.py --shape qwen2-1.5b --out "$OUT/qwen2-1.5b.json" 2>&1 | tail -n 60 | tee "$OUT/qwen2-1.5b.log"
