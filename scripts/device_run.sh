#!/usr/bin/env bash
# The one device command of issue 52 (one H200, about 8 minutes): float8 and CPU offload
# on Llama 3 8B-sized steps, the trainer's validation and profiling under CUDA, Inductor's
# overlap scheduler beside our auto wrapping (compiled, fake process group of 8), and the
# quick tier plus tests/test_reliability.py on the device's torch.
#   OUT=/some/folder bash scripts/device_run.sh
# Writes $OUT/log (the console) and $OUT/dc/ (results.json, train_metrics.csv). Every
# subprocess section has a timeout, and --deadline-s cuts the later ones to what is left.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT/dc"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python scripts/device_check.py --out "$OUT/dc" \
    --only env,float8,cpu_offload,train_tools,overlap_8b,pytest_cuda \
    --deadline-s 465 --budget-float8 100 --budget-offload 80 --budget-train 80 \
    --budget-overlap 220 --budget-pytest 130 \
    2>&1 | tee "$OUT/log"
