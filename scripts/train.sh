#!/usr/bin/env bash
# Set up (torch: a supported installed one is kept, 2.13.0 installed only where none is;
# the package with its training extras) and run the default training job: the debug
# Llama on Shakespeare, 2 CPU processes, 200 steps.
# Extra arguments are config overrides, e.g.:
#   bash scripts/train.sh --training.steps 50 --metrics.output_dir outputs/short
# Output (metrics.csv, loss.png, memory.png) goes to outputs/ unless overridden; the last
# two lines of a run say its loss and where everything went. A configuration error stops
# before anything starts, with exit status 78. Exit statuses: docs/training.md.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/pip.sh  # ensure_torch, quiet_pip (pip install -q without the root warning)
ensure_torch
quiet_pip -e ".[train]"

NPROC=2
# One process checks the config for NPROC processes first: a mistake is one plain line
# (and exit status 78), not one per rank under torchrun's failure report.
python -m simplefsdp.train --check --world-size "$NPROC" --config configs/debug.toml "$@"
# torchrun would set 1 thread per process anyway, with a warning banner saying so.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --standalone --nproc_per_node="$NPROC" -m simplefsdp.train \
    --config configs/debug.toml "$@"
