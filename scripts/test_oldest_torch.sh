#!/usr/bin/env bash
# The test suite on the oldest torch the package admits (2.11): CI runs 2.13 only, and
# torch-version differences (DTensor's redistribute planner, DCP's staging, pipelining's
# input checks, Inductor) break code that 2.13 passes.
#   bash scripts/test_oldest_torch.sh                      # the whole suite, two workers
#   bash scripts/test_oldest_torch.sh tests/test_etp.py   # or any pytest arguments
# Builds once a virtual environment at $VENV (default /tmp/simplefsdp-torch2.11) over
# this Python's site-packages (so the test dependencies come from there) holding torch
# 2.11.0 from PyPI, a CUDA build that runs on the CPU (about 3 GB with its libraries).
# Each failing test's traceback also goes to $VENV/failures.log as it comes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/simplefsdp-torch2.11}
if [ ! -x "$VENV/bin/python" ]; then
    python -m venv --system-site-packages "$VENV"
    # the venv's own setuptools is older than pyproject.toml's license fields need
    "$VENV/bin/python" -m pip uninstall -y -q setuptools
    "$VENV/bin/python" -m pip install -q "torch==2.11.0"
fi
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
rm -f "$VENV/failures.log"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests -n 2 --dist loadgroup)
CI=true PYTHONPATH=$PWD PYTEST_FAILURES_LOG="$VENV/failures.log" "$VENV/bin/python" -m pytest \
    -p no:cacheprovider -p scripts.pytest_failures_log -q -rfE "${args[@]}"
