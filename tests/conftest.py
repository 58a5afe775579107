"""Shared test set-up.

pytest puts this folder on ``sys.path`` (rootdir-relative, no package), so every test
imports its helpers one way: ``from rank_runner import run_ranks`` and ``from toy import ...``.
Spawned rank processes inherit that path, so they import the same modules.
"""

import os

# Tests never reach the network: Hugging Face libraries, if a test uses them, stay offline.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")

# Inductor compiles in the test's own process: its default pool of compile workers is
# a set of fresh interpreters per rank process (4 ranks: 8 more torch imports) on 2 cores.
# Measured on the debug model's first Inductor step, one process, load 8-13: 92-97 s
# in-process against 118-210 s with the pool.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
