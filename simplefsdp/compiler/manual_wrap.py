"""Manual wrapping: bucket collectives by a list of module names (paper section 3.3.1).

A plan is a list of entries; an entry is a module FQN (``"layers.0"``) or a list of FQNs
merged into one bucket (``["norm", "output"]``). A collective belongs to the entry whose
name is the longest prefix of its module's FQN; collectives outside every entry stay
unbucketed.

All-reduces are not planned by module: an HSDP all-reduce (of a reduce-scattered shard)
joins the bucket of its reduce-scatter, and replicate-mode all-reduces are bucketed by
size in backward order, as DDP does (:func:`assign_all_reduces`, for manual and auto).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import fx

from .collectives import Collective, feeding_reduce_scatter

DEFAULT_ALL_REDUCE_BUCKET_MB = 25.0  # DDP's bucket_cap_mb

PlanEntry = str | Sequence[str]
_LAYER = re.compile(r"^(layers\.\d+)(\.|$)")


def default_plan(collectives: list[Collective], backward: bool = False) -> list[PlanEntry]:
    """The usual FSDP wrapping: embeddings, each block, then everything after the blocks
    (final norm + head) as one bucket. For a model without ``layers``, each top-level
    child is a bucket. A backward graph runs the model in reverse; we read it forwards."""
    modules = [c.module for c in collectives if c.kind != "all_reduce"]
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
        if c.kind == "all_reduce":
            continue  # see assign_all_reduces
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


def assign_all_reduces(collectives: list[Collective], assignment: dict[fx.Node, str],
                       bucket_mb: float = DEFAULT_ALL_REDUCE_BUCKET_MB) -> dict[fx.Node, str]:
    """Bucket names for the all-reduces of a backward graph.

    HSDP: an all-reduce of a reduce-scattered shard takes its reduce-scatter's bucket (one
    all-reduce per reduce-scatter bucket, on the replicate group); unbucketed
    reduce-scatter, unbucketed all-reduce. Replicate: in graph (= backward) order, a
    bucket closes once it holds ``bucket_mb`` MB (1e6 bytes) or more, so a step issues at
    most ``total bytes / cap + 1`` all-reduces.
    """
    cap = check_bucket_mb(bucket_mb) * 1e6
    names: dict[fx.Node, str] = {}
    index, filled = 0, 0
    for c in collectives:
        if c.kind != "all_reduce":
            continue
        source = feeding_reduce_scatter(c.start)
        if source is not None:
            if source in assignment:
                names[c.start] = assignment[source]
            continue
        names[c.start] = f"all_reduce{index}"
        filled += c.nbytes
        if filled >= cap:
            index, filled = index + 1, 0
    return names


def check_bucket_mb(bucket_mb: float) -> float:
    """``bucket_mb`` as a float; raises on a non-positive or non-number value."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, int | float) or \
            not bucket_mb > 0:
        raise ValueError(f"all_reduce_bucket_mb must be a positive number of MB (1e6 bytes), "
                         f"got {bucket_mb!r}")
    return float(bucket_mb)
