#!/usr/bin/env bash
# Set up (CPU torch 2.13.0, the package, test tools) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/pip.sh  # quiet_pip: pip install -q, without the root warning
quiet_pip "torch==2.13.0"
quiet_pip -e ".[dev]"
ruff check .
python -m pytest -q --durations=40 "$@"
