#!/usr/bin/env bash
# Set up (CPU torch 2.13.0, the package, test tools) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "root user" || true
python -m pip install -q -e ".[dev]" 2>&1 | grep -v "root user" || true
ruff check .
python -m pytest -q --durations=10 "$@"
