"""The pass pipeline, once: bucket a graph's collectives by an assignment, then reorder.

The backend runs it on each graph it compiles; auto wrapping's peak check
(:func:`.fit_limit.applied_peak`) runs it on a copy of the graph, so the peak a plan is
held to is that of the very graph the backend will produce.
"""

from __future__ import annotations

from torch import fx

from .bucketing import Bucket, bucket_collectives, bucket_of_one
from .collectives import Collective, is_backward, stable_topological_sort
from .manual_wrap import DEFAULT_ALL_REDUCE_BUCKET_MB, assign_all_reduces
from .reordering import reorder


def apply_passes(graph: fx.Graph, collectives: list[Collective],
                 assignment: dict[fx.Node, str] | None, reordering: bool,
                 all_reduce_bucket_mb: float = DEFAULT_ALL_REDUCE_BUCKET_MB
                 ) -> tuple[list[Bucket], list[str]]:
    """Bucket ``collectives`` of ``graph`` in place by ``assignment`` ({collective start:
    bucket name}; the all-reduces are assigned here, by ``all_reduce_bucket_mb``; None:
    no bucketing, each collective its own bucket), then with ``reordering`` prefetch the
    all-gathers and defer the reductions' waits. Returns the buckets and the moves made."""
    backward = is_backward(graph)
    if assignment is None:
        buckets = [bucket_of_one(c, i) for i, c in enumerate(collectives)]
    else:
        assignment = dict(assignment)
        assignment.update(assign_all_reduces(collectives, assignment, all_reduce_bucket_mb))
        buckets = bucket_collectives(graph, collectives, assignment)
        stable_topological_sort(graph)
    moves = reorder(graph, buckets, backward) if reordering else []
    return buckets, moves
