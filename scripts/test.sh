#!/usr/bin/env bash
# Set up (torch: a supported installed one is kept, 2.13.0 installed only where none is;
# the package with its test tools), check style, and run the tests.
#   bash scripts/test.sh            the whole suite (what CI runs)
#   bash scripts/test.sh --quick    the tests marked `quick` (pytest -m quick): minutes
# Other arguments go to pytest, e.g. bash scripts/test.sh tests/test_docs.py -x
# Two pytest-xdist workers by default (--dist loadgroup): the tests marked many_ranks (more
# than 2 processes at once) one after another in one worker, every other test file whole
# on whichever worker is free (tests/conftest.py). SIMPLEFSDP_TEST_WORKERS=1 runs one
# pytest process; N > 2 runs test files on N workers, a whole file per worker (more cores):
# on 2 cores two files of 4 ranks at once ran slower than one (docs/performance.md).
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
n="${SIMPLEFSDP_TEST_WORKERS:-2}"
case "$n" in
    1) workers=() ;;
    2) workers=(-n 2 --dist loadgroup) ;;
    *) workers=(-n "$n" --dist loadfile) ;;
esac
python -m pytest -q --durations=40 "${workers[@]}" "${tier[@]}" "$@"
