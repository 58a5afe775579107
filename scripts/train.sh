#!/usr/bin/env bash
# Set up (CPU torch 2.13.0, the package with its training extras) and run the default
# training job: the debug Llama on Shakespeare, 2 CPU processes, ~200 steps.
# Extra arguments are config overrides, e.g.:
#   bash scripts/train.sh --training.steps 50 --metrics.output_dir outputs/short
# Output (metrics.csv, loss.png, memory.png) goes to outputs/ unless overridden.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "root user" || true
python -m pip install -q -e ".[train]" 2>&1 | grep -v "root user" || true
exec torchrun --standalone --nproc_per_node=2 -m simplefsdp.train --config configs/debug.toml "$@"
