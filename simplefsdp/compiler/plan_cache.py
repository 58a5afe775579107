"""On-disk cache of auto-wrapping decisions, so a rerun compiles warm.

Deciding a plan measures the graph and talks to the other ranks, which Inductor's FX
graph cache cannot replay: a rank served from the cache would skip the exchange and hang
the others. So the decisions themselves are cached, per Dynamo graph (the key covers
its code, input shapes, the pass settings, the comm model, the world and our source):
when every rank finds them on disk, the pass needs nobody else and Inductor's caches
stay on; when any rank lacks them, the pass decides live (first rank decides, the store
shares) and every rank writes what was decided. Each rank keeps its own file (ranks on
one host write side by side, never into one file).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import fx

from .cost.comm import cache_dir

FORMAT = 1


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def graph_key(graph: fx.Graph) -> str:
    """A hash of one FX graph's structure: ops, targets, arguments, tensor shapes."""
    parts = []
    for n in graph.nodes:
        val = n.meta.get("val")
        meta = (tuple(val.shape), str(val.dtype)) if isinstance(val, torch.Tensor) else None
        parts.append(f"{n.name}|{n.op}|{n.target}|{n.args}|{n.kwargs}|{meta}")
    return _digest("\n".join(parts))


def dynamo_key(gm: fx.GraphModule, example_inputs: Any, *settings: Any) -> str:
    """The key of one Dynamo graph's decisions (see module doc)."""
    shapes = [(tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else type(x).__name__
              for x in example_inputs]
    return _digest(json.dumps([FORMAT, gm.code, repr(shapes), [repr(s) for s in settings]]))


def path(key: str, rank: int) -> Path:
    return cache_dir() / "plans" / f"{key}.rank{rank}.json"


def load(key: str, rank: int) -> dict[str, dict] | None:
    """``{graph key: decision}`` cached for ``key`` on this rank, None when absent."""
    try:
        data = json.loads(path(key, rank).read_text())
        return data if isinstance(data, dict) and data else None
    except (OSError, ValueError):
        return None


def store(key: str, rank: int, graph: str, decision: dict) -> None:
    """Add one graph's decision to this rank's file (tmp file + rename: atomic)."""
    target = path(key, rank)
    data = load(key, rank) or {}
    data[graph] = decision
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, sort_keys=True)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only cache folder only costs the next run a cold compile
