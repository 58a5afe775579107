"""Step extraction: a graph's data-parallel collectives as the planners' steps, one
:class:`.simulate.CollectiveCost` per collective in issue order (its bytes, the compute
that uses what it gathered, the memory live meanwhile, and in backward the bytes of the
reductions of the same parameters), and a plan of steps back as bucket names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import fx

from ..gloo_kernel import uses_gloo
from . import cost
from .collectives import Collective
from .simulate import CollectiveCost


def _segments(nodes: list[fx.Node], anchors: list[fx.Node]) -> list[list[int]]:
    """Per anchor, the positions strictly between it and the next anchor (the last one
    runs to the end of the graph): the work done after one wait and before the next."""
    index = {n: i for i, n in enumerate(nodes)}
    marks = [index[a] for a in anchors] + [len(nodes)]
    return [list(range(marks[k] + 1, marks[k + 1])) for k in range(len(anchors))]


def _segment_memory(live: list[int], segment: list[int], start: int) -> int:
    """Peak growth of live bytes within ``segment`` over the bytes live at ``start``."""
    if not segment:
        return 0
    return max(0, max(live[j] for j in segment) - live[start])


def profile_steps(graph: fx.Graph, primary: list[Collective], mirrored: list[Collective],
                  node_seconds: list[float], owner: dict[fx.Node, int],
                  reverse: bool = False, all_reduces: Sequence[tuple[int, int]] = ()
                  ) -> list[CollectiveCost]:
    """Steps for the greedy from a graph's collectives (before any bucketing).

    ``primary``: the collectives that define steps (all-gathers; backward reduce-scatters
    when there is no re-gather). A step's computation is what runs between its wait and
    the next step's wait (forward), or between the previous reduce-scatter and its own
    (``reverse``: reduce-scatters hide behind the computation that follows them, so the
    greedy walks them backwards). ``mirrored``: reduce-scatters mirrored onto the
    all-gather of the same module (or, failing that, the step whose segment holds them):
    ``owner`` from :func:`owner_steps`. Memory: the gathered (or reduced) bytes plus the
    segment's peak growth in live bytes (``memory_bytes``), and the segment's peak live
    bytes less the gathered ones (``base_bytes``).
    """
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    _, live = cost.peak_memory_estimate(graph)
    if reverse:
        anchors = [c.start for c in primary]
        bounds = [-1] + [index[a] for a in anchors]
        segments = [list(range(bounds[k] + 1, bounds[k + 1])) for k in range(len(anchors))]
        starts = [max(b, 0) for b in bounds[:-1]]
    else:
        segments = _segments(nodes, [c.wait for c in primary])
        starts = [index[c.wait] for c in primary]
    scatter_bytes = [0] * len(primary)
    for c in mirrored:
        scatter_bytes[owner[c.start]] += c.nbytes
    all_reduce_bytes = [0] * len(primary)
    for k, nbytes in all_reduces:
        all_reduce_bytes[k] += nbytes
    steps = [CollectiveCost(c.module, c.nbytes, sum(node_seconds[j] for j in seg),
                  c.nbytes + _segment_memory(live, seg, s), ob,
                  max(0, max((live[j] for j in seg), default=live[s]) - c.nbytes), ab)
             for c, seg, s, ob, ab in zip(primary, segments, starts, scatter_bytes,
                                          all_reduce_bytes, strict=True)]
    return steps[::-1] if reverse else steps


def owner_steps(graph: fx.Graph, primary: list[Collective], mirrored: list[Collective]
                ) -> dict[fx.Node, int]:
    """For each ``mirrored`` collective, the index of the ``primary`` step it follows: the
    first step of the same module, else the last step whose wait precedes it."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    by_module: dict[str, int] = {}
    for k, c in enumerate(primary):
        by_module.setdefault(c.module, k)
    waits = [index[c.wait] for c in primary]
    owner = {}
    for c in mirrored:
        if c.module in by_module:
            owner[c.start] = by_module[c.module]
        else:
            before = [k for k, w in enumerate(waits) if w < index[c.start]]
            owner[c.start] = before[-1] if before else 0
    return owner


def quantise_seconds(t: float, steps_per_decade: int = 20) -> float:
    """``t`` rounded to a geometric grid (20 per decade: within 6%), so that run-to-run
    noise in measured compute rarely changes the numbers a plan is chosen from."""
    if t <= 0:
        return 0.0
    return 10.0 ** (round(math.log10(t) * steps_per_decade) / steps_per_decade)


def in_flight_scratch(collectives: Sequence[Collective]) -> dict[str, float] | None:
    """The process group's in-flight temporaries for these collectives
    (``cost.memory.IN_FLIGHT_SCRATCH``): gloo's for CPU tensors on a gloo group."""
    for c in collectives:
        val = c.start.meta.get("val")
        if getattr(val, "device", None) is not None and val.device.type == "cpu" \
                and uses_gloo(c.group_name):
            return cost.memory.IN_FLIGHT_SCRATCH["gloo"]
    return None


def bucket_assignment(primary: list[Collective], mirrored: list[Collective],
                      owner: dict[fx.Node, int], reverse: bool, buckets: list[list[int]],
                      names: list[str]) -> dict[fx.Node, str]:
    """``{collective start: bucket name}`` for ``buckets`` of step indices (``names``:
    the steps' modules); reduce-scatters follow their owner step's bucket."""
    in_graph_order = primary[::-1] if reverse else primary
    assignment: dict[fx.Node, str] = {}
    bucket_of = {}
    for k, members in enumerate(buckets):
        first, last = names[members[0]], names[members[-1]]
        name = f"auto{k}:{first}" + (f"..{last}" if len(members) > 1 else "")
        for j in members:
            assignment[in_graph_order[j].start] = name
            bucket_of[j] = name
    for c in mirrored:
        assignment[c.start] = bucket_of[owner[c.start]]
    return assignment
