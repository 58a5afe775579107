#!/usr/bin/env bash
# Set up (CPU torch 2.13.0, the package, test tools) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

# pip, without its warning about running as root (a container's usual user); on failure
# everything it said is shown and the script stops.
quiet_pip() {
    local said
    if ! said=$(PIP_ROOT_USER_ACTION=ignore python -m pip install -q "$@" 2>&1); then
        printf '%s\n' "$said" >&2
        return 1
    fi
    printf '%s\n' "$said" | grep -v -e "Running pip as the 'root' user" -e '^$' || true
}
quiet_pip "torch==2.13.0"
quiet_pip -e ".[dev]"
ruff check .
python -m pytest -q --durations=10 "$@"
