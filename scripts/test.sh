#!/usr/bin/env bash
# Set up (torch: a supported installed one is kept, 2.13.0 installed only where none is;
# the package with its test tools), check style, and run the tests.
#   bash scripts/test.sh            the whole suite (what CI runs)
#   bash scripts/test.sh --quick    the tests marked `quick` (pytest -m quick): minutes
# Other arguments go to pytest, e.g. bash scripts/test.sh tests/test_docs.py -x
# SIMPLEFSDP_TEST_WORKERS=N (N > 1) runs test files on N pytest-xdist workers, a whole
# file per worker (its module fixtures run once). Default 1 (one pytest process): on 2
# cores two workers ran slower than one (docs/performance.md, "The test suite").
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
workers=(); n="${SIMPLEFSDP_TEST_WORKERS:-1}"
if [[ "$n" != 1 ]]; then
    workers=(-n "$n" --dist loadfile)
fi
python -m pytest -q --durations=40 "${workers[@]}" "${tier[@]}" "$@"
