"""Manual wrapping: bucket collectives by a list of module names (paper section 3.3.1).

A plan is a list of entries; an entry is a module FQN (``"layers.0"``) or a list of FQNs
merged into one bucket (``["norm", "output"]``). A collective belongs to the entry whose
name is the longest prefix of its module's FQN; collectives outside every entry stay
unbucketed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import fx

from .collectives import Collective

PlanEntry = str | Sequence[str]
_LAYER = re.compile(r"^(layers\.\d+)(\.|$)")


def default_plan(collectives: list[Collective], backward: bool = False) -> list[PlanEntry]:
    """The usual FSDP wrapping: embeddings, each block, then everything after the blocks
    (final norm + head) as one bucket. For a model without ``layers``, each top-level
    child is a bucket. A backward graph runs the model in reverse; we read it forwards."""
    modules = [c.module for c in collectives]
    if backward:
        modules.reverse()
    if not any(_LAYER.match(m) for m in modules):
        return list(dict.fromkeys(m.split(".")[0] for m in modules if m))
    plan: list[PlanEntry] = []
    before, after, seen_layer = [], [], False
    for m in modules:
        layer = _LAYER.match(m)
        if layer:
            seen_layer = True
            if layer.group(1) not in plan:
                plan.append(layer.group(1))
        elif m:
            top = m.split(".")[0]
            target = after if seen_layer else before
            if top not in before + after:
                target.append(top)
    return ([before] if before else []) + plan + ([after] if after else [])


def bucket_names(plan: Sequence[PlanEntry]) -> list[tuple[str, tuple[str, ...]]]:
    """(bucket name, module prefixes) per plan entry."""
    out = []
    for entry in plan:
        prefixes = (entry,) if isinstance(entry, str) else \
            tuple(entry) if isinstance(entry, list | tuple) else ()
        if not prefixes or not all(isinstance(p, str) for p in prefixes):
            raise ValueError(f"module_plan entries must be module names or lists of names, "
                             f"got {entry!r}")
        out.append(("+".join(prefixes), prefixes))
    return out


def assign(collectives: list[Collective], plan: Sequence[PlanEntry]
           ) -> tuple[dict[fx.Node, str], list[str]]:
    """Map each collective's start node to its bucket name; also return unused entries."""
    buckets = bucket_names(plan)
    assignment, used = {}, set()
    for c in collectives:
        best, best_len = None, -1
        for name, prefixes in buckets:
            for p in prefixes:
                if (c.module == p or c.module.startswith(p + ".") or p == "") and \
                        len(p) > best_len:
                    best, best_len = name, len(p)
        if best is not None:
            assignment[c.start] = best
            used.add(best)
    unused = [name for name, _ in buckets if name not in used]
    return assignment, unused
