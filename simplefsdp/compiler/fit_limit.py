"""Fit to limit: hold a plan to ``memory_limit_bytes`` on the graph the passes leave.

The search's step model (``simulate.bucket_peak``) sees each bucket's neighbours only;
the applied graph also holds what the passes add around them (copy-out buffers,
collective inputs until their deferred waits, the process group's temporaries), so the
limit is checked on it (:func:`applied_peak`), and a plan over it is searched again under
lower targets (:func:`fit_to_limit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import fx

from . import cost
from .bucket_search import optimal_buckets
from .collectives import Collective
from .manual_wrap import DEFAULT_ALL_REDUCE_BUCKET_MB
from .passes import apply_passes
from .simulate import CollectiveCost, simulate

FIT_ROUNDS = 6  # searches under lower targets when the applied graph's peak is over


def fit_to_limit(steps: list[CollectiveCost], comm: cost.CommModel, memory_limit_bytes: float,
                 kind: str, buckets: list[list[int]],
                 peak_of: Callable[[list[list[int]]], int]) -> tuple[list[list[int]], int]:
    """``buckets`` (the search's plan under ``memory_limit_bytes``) or, when ``peak_of``
    (the peak of the graph as those buckets leave it) is over the limit, the fastest
    plan found whose peak is under it: the search is re-run under lower targets, first
    the plan's own step-model peak lowered by its overshoot (until a plan fits), then
    bisecting between the highest target whose plan fits and the lowest whose plan does
    not, ``FIT_ROUNDS`` searches in all; failing that, the lowest-peaking plan tried,
    one collective per bucket included. Returns the plan and its peak. Bisecting, not
    lowering by the overshoot alone, which can jump past every fitting plan with
    several buckets to one collective per bucket (README, auto wrapping)."""
    peak = peak_of(buckets)
    if peak <= memory_limit_bytes:
        return buckets, peak

    def lowered(plan: list[list[int]], peak: int) -> float:
        """A target that excludes ``plan``: its step-model peak less its overshoot."""
        return simulate(steps, plan, comm, kind).peak_bytes - (peak - memory_limit_bytes)

    plans = {_plan_key(buckets): (buckets, peak)}  # every plan tried, with its peak
    over, under = memory_limit_bytes, None  # search targets whose plans are over / fit
    target = lowered(buckets, peak)
    for _ in range(FIT_ROUNDS):
        if target <= 0:
            break
        candidate = optimal_buckets(steps, comm, target, kind)
        key = _plan_key(candidate)
        if key not in plans:
            plans[key] = (candidate, peak_of(candidate))
        peak = plans[key][1]
        if peak <= memory_limit_bytes:
            under = target
        else:
            over = target
        target = (under + over) / 2 if under is not None else lowered(candidate, peak)
    fitting = [p for p in plans.values() if p[1] <= memory_limit_bytes]
    if fitting:
        return min(fitting, key=lambda p: simulate(steps, p[0], comm, kind).step_s)
    singles = [[i] for i in range(len(steps))]
    plans.setdefault(_plan_key(singles), (singles, peak_of(singles)))
    return min(plans.values(), key=lambda p: p[1])


def _plan_key(buckets: list[list[int]]) -> tuple:
    return tuple(map(tuple, buckets))



def applied_peak(graph: fx.Graph, collectives: list[Collective],
                 assignment: dict[fx.Node, str], reordering: bool = True,
                 scratch: dict[str, float] | None = None,
                 all_reduce_bucket_mb: float = DEFAULT_ALL_REDUCE_BUCKET_MB) -> int:
    """Liveness peak (``cost.peak_memory_estimate``) of ``graph`` once the backend's
    passes (:func:`.passes.apply_passes`) have bucketed it by ``assignment`` and
    reordered it; computed on a copy, ``graph`` is not changed. The larger of two
    placements of a bucket's copy-out: where the pass puts it (eager execution) and sunk
    into each parameter's use (Inductor: the gathered buffer then lives until the
    bucket's last use)."""
    copy = fx.Graph()
    nodes: dict[fx.Node, fx.Node] = {}
    copy.output(copy.graph_copy(graph, nodes))
    mapped = [dataclasses.replace(c, start=nodes[c.start], wait=nodes[c.wait])
              for c in collectives]
    moved = {nodes[n]: name for n, name in assignment.items()}
    apply_passes(copy, mapped, moved, reordering, all_reduce_bucket_mb)
    return max(cost.peak_memory_estimate(copy, scratch, alias_of)[0]
               for alias_of in (cost.memory.alias_bases, cost.memory.sunk_copies))
