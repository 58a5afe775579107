"""Shared test set-up.

pytest puts this folder on ``sys.path`` (rootdir-relative, no package), so every test
imports its helpers one way: ``from rank_runner import run_ranks`` and ``from toy import ...``.
Spawned rank processes inherit that path, so they import the same modules.
"""

import os

# Tests never reach the network: Hugging Face libraries, if a test uses them, stay offline.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")
