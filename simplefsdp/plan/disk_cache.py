"""The planner's answers kept on disk across runs (``<cache_dir>/<kind>/<hash>.json``):
the auto layout's choice (``plan.auto_layout``) and each stage role's figures, the
memory and times ``predict`` derives from a role's two traces (``predict._role_figures``:
the Dynamo + AOTAutograd traces cost seconds each, their figures a few hundred bytes).

An entry is found by a hash of everything its computation reads: the caller's inputs,
the torch version and the source of the whole package (the planner traces the models,
their parallelisms, float8, the compiler passes and the config; a list of folders had
missed ``float8.py``, so an edit there left stale figures), so an edit makes every entry
unreachable rather than stale. A read-only or missing cache folder costs the next run
its work, nothing else.
``SIMPLEFSDP_PLAN_CACHE=0`` turns the figures' cache off (the answers' too).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

# training keys no figure or search reads (the optimizer's and the run's length)
NOT_PLANNED = ("steps", "lr", "warmup_steps", "weight_decay", "beta1", "beta2", "eps",
               "max_norm", "seed", "hang_watchdog_s")


def enabled() -> bool:
    """Whether the planner reads and writes its disk cache (``SIMPLEFSDP_PLAN_CACHE``)."""
    return os.environ.get("SIMPLEFSDP_PLAN_CACHE", "1") != "0"


@functools.cache
def sources_digest() -> str:
    """A hash of the package's code (every ``simplefsdp/**/*.py``), once per process."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for file in sorted(root.rglob("*.py")):
        digest.update(file.relative_to(root).as_posix().encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


# parallel keys that say how to search, not what a layout is (the profile and limit
# reach the planner as its ``gpu`` argument)
NOT_A_LAYOUT = ("layout", "hardware", "memory_limit_gb")


def planned_config(cfg) -> dict[str, Any]:
    """``cfg``'s sections as a prediction reads them: ``NOT_PLANNED`` and
    ``NOT_A_LAYOUT`` left out, and the sections of where a run reads and writes and how
    it names itself (the planner's traces run on fake CPU tensors whatever the job's
    device; the search's answer adds it: ``plan.auto_layout``)."""
    d = cfg.to_dict()
    d["training"] = {k: v for k, v in d["training"].items() if k not in NOT_PLANNED}
    d["parallel"] = {k: v for k, v in d["parallel"].items() if k not in NOT_A_LAYOUT}
    for section in ("metrics", "checkpoint", "data", "validation", "profiling", "job"):
        d.pop(section, None)
    return d


def entry_path(kind: str, inputs: dict[str, Any]) -> Path | None:
    """Where the entry for ``inputs`` lives (None: the cache is off)."""
    if not enabled():
        return None
    import torch

    from ..compiler.cost.comm import cache_dir

    key = {**inputs, "torch": torch.__version__, "sources": sources_digest()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode())
    return cache_dir() / kind / f"{digest.hexdigest()[:32]}.json"


def load(path: Path | None) -> Any:
    """The entry at ``path``, or None (absent, unreadable, or the cache off)."""
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def store(path: Path | None, value: Any) -> None:
    """Write ``value`` at ``path`` whole (a reader sees all of it or nothing)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{time.time_ns()}.tmp")
        tmp.write_text(json.dumps(value, indent=1, default=str))
        tmp.replace(path)
    except OSError:
        pass
