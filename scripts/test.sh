#!/usr/bin/env bash
# Set up (torch: a supported installed one is kept, 2.13.0 installed only where none is;
# the package with its test tools), check style, and run the tests.
#   bash scripts/test.sh            the whole suite (what CI runs)
#   bash scripts/test.sh --quick    the tests marked `quick` (pytest -m quick): minutes
# Other arguments go to pytest, e.g. bash scripts/test.sh tests/test_docs.py -x
# Test files run on SIMPLEFSDP_TEST_WORKERS pytest-xdist workers (default 2, one per core
# of the project's machines), a whole file per worker (its module fixtures run once): a
# single-process test (a planner trace) keeps one core busy while the other runs ranks.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/pip.sh  # ensure_torch, quiet_pip (pip install -q without the root warning)
ensure_torch
quiet_pip -e ".[dev]"
ruff check .

tier=()
if [[ "${1:-}" == "--quick" ]]; then
    shift
    tier=(-m quick)
fi
python -m pytest -q --durations=40 -n "${SIMPLEFSDP_TEST_WORKERS:-2}" --dist loadfile \
    --no-loadscope-reorder "${tier[@]}" "$@"
