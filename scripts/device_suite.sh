#!/usr/bin/env bash
# The whole test suite on the device machine's torch (2.11 with CUDA there; CI runs 2.13
# on CPU): does the library still pass on the oldest torch it admits? One pytest-xdist
# worker per file (the device has 16 cores), a hard timeout, the console as it goes.
#   OUT=/some/folder [WORKERS=10] [BUDGET_S=300] [SELECT="tests/test_x.py ..."] bash scripts/device_suite.sh
# Wheels the device image lacks (transformers >= 5.24, datasets, wandb, torchao, peft)
# travel in .whl/ (ignored; see scripts/README.md) and go to /tmp/site, ahead of the
# image's own. Writes $OUT/suite.log, each failure's traceback to $OUT/failures.log as it
# comes (a run cut by the timeout keeps them), and, if pytest finishes, $OUT/suite.xml.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the output folder}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda',
    torch.cuda.is_available(), 'transformers', transformers.__version__)"
CI=true PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTEST_FAILURES_LOG="$OUT/failures.log" timeout -k 5 "${BUDGET_S:-300}" \
    python3 -m pytest ${SELECT:-tests} -n "${WORKERS:-10}" --dist loadfile -p no:cacheprovider -p scripts.pytest_failures_log -v \
    -rfE --tb=short --durations=25 --junitxml="$OUT/suite.xml" 2>&1 | tee "$OUT/suite.log" \
    | grep -E "FAILED|ERROR|passed|failed|^torch " 
echo "device_suite: pytest exit ${PIPESTATUS[0]}"
