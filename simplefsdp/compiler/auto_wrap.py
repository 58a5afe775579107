"""Auto wrapping: choose the buckets under time and memory constraints (SimpleFSDP
section 3.3.2), by an exact search over a simulated step or by the paper's greedy.

A graph becomes a list of :class:`Step` (one per collective in issue order: its bytes,
the compute that uses its parameters, the memory live meanwhile, and in backward the
bytes of the reduce-scatters of the same parameters). Two planners read them:

* ``"auto"`` (default): :func:`plan_search.optimal_buckets`, dynamic programming over
  contiguous bucket boundaries minimising the step time of :mod:`.simulate` (compute
  and communication streams, the measured fraction of a collective that compute hides,
  copy-in/copy-out) with the predicted step peak under ``memory_limit_gb``;
* ``"greedy"``: :func:`greedy_buckets`, Algorithm 1 of the paper (see its docstring);
  its memory rule is the paper's (a bucket's own memory), kept for comparison.

Both plans are simulated and reported. :func:`plan` turns a graph into steps (compute
measured by ``cost.compute`` on one rank, quantised), decides on the first rank of the
agreement and shares the decision through the store, so every rank buckets identically,
and returns a ``{collective start node: bucket name}`` map for
``bucketing.bucket_collectives``; reduce-scatters follow the bucket of the all-gather of
the same parameters.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx

from ..agreement import StoreAgreement
from ..gloo_kernel import uses_gloo
from . import cost
from .bucketing import bucket_collectives
from .collectives import Collective, feeding_reduce_scatter, is_backward, stable_topological_sort
from .manual_wrap import assign_all_reduces
from .plan_search import optimal_buckets
from .reordering import reorder
from .simulate import Estimate, Step, reduction_seconds, simulate

METHODS = ("auto", "greedy")

GB = 1e9  # memory_limit_gb counts decimal gigabytes
FIT_ROUNDS = 6  # searches under lower targets when the applied graph's peak is over


@dataclass(frozen=True)
class Decision:
    """Why step ``index`` did or did not join the open bucket: the numbers Algorithm 1
    compares (seconds and bytes) and the outcome."""

    index: int
    name: str
    merged: bool
    reason: str
    comm_s: float  # T_(m+mi): the bucket's communication if the step joined it
    scatter_s: float  # T_m^RS: the reduce-scatter sharing the window (backward)
    compute_s: float  # T_c: the window the bucket is prefetched behind (x comm.hidden_fraction)
    memory_bytes: int  # M_c + M_ci
    memory_limit_bytes: float | None
    exposed_if_merged_s: float
    exposed_if_split_s: float

    def __str__(self) -> str:
        limit = "none" if self.memory_limit_bytes is None else f"{self.memory_limit_bytes:.3g}"
        return (f"{'merge' if self.merged else 'close'} before {self.name}: {self.reason} "
                f"(comm {self.comm_s * 1e3:.3f} ms + rs {self.scatter_s * 1e3:.3f} ms vs "
                f"window {self.compute_s * 1e3:.3f} ms; memory {self.memory_bytes} B, "
                f"limit {limit}; exposed merged/split {self.exposed_if_merged_s * 1e3:.3f}/"
                f"{self.exposed_if_split_s * 1e3:.3f} ms)")


def check_memory_limit(memory_limit_gb: float | None) -> float | None:
    """``memory_limit_gb`` in bytes; None means no limit. Raises on a non-positive value."""
    if memory_limit_gb is None:
        return None
    if isinstance(memory_limit_gb, bool) or not isinstance(memory_limit_gb, int | float) \
            or not memory_limit_gb > 0:
        raise ValueError(f"memory_limit_gb must be a positive number of GB (1e9 bytes), or "
                         f"None for no limit; got {memory_limit_gb!r}")
    return float(memory_limit_gb) * GB


def check_outside_bytes(state_bytes_outside_graphs: int,
                        memory_limit_bytes: float | None) -> int:
    """``state_bytes_outside_graphs`` checked: a non-negative int that leaves the graphs
    some of ``memory_limit_bytes``."""
    n = state_bytes_outside_graphs
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"state_bytes_outside_graphs must be a non-negative int (bytes held "
                         f"outside the compiled graphs, e.g. cost.optimizer_state_bytes(...)); "
                         f"got {n!r}")
    if memory_limit_bytes is not None and n >= memory_limit_bytes:
        raise ValueError(f"memory_limit_gb ({memory_limit_bytes / GB:.4g} GB) leaves nothing "
                         f"for the compiled graphs: {n / GB:.4g} GB are held outside them "
                         f"(state_bytes_outside_graphs, e.g. the optimizer state); raise "
                         f"memory_limit_gb or shard over more ranks")
    return n


def _comm(model: cost.CommModel, kind: str, nbytes: int) -> float:
    """Time of one collective; no bytes means no collective, hence no latency either."""
    return model.predict(kind, nbytes) if nbytes > 0 else 0.0


def _reductions(model: cost.CommModel, kind: str, steps: Sequence[Step],
                members: Sequence[int]) -> float:
    """The backward reductions of ``members``: one ``kind`` collective (reduce-scatter)
    over their ``scatter_bytes``, then (HSDP) one all-reduce of the reduced shards."""
    return reduction_seconds(model, kind, sum(steps[j].scatter_bytes for j in members),
                             sum(steps[j].all_reduce_bytes for j in members))


def greedy_buckets(steps: Sequence[Step], comm: cost.CommModel,
                   memory_limit_bytes: float | None = None, kind: str = "all_gather",
                   scatter_kind: str = "reduce_scatter"
                   ) -> tuple[list[list[int]], list[Decision]]:
    """Algorithm 1 over ``steps``: buckets as lists of step indices, and one decision per
    step after the first.

    The bucket being built is prefetched behind the computation of the previous closed
    bucket (the window; zero for the first bucket, which nothing precedes) while, in
    backward, the reduce-scatter of the bucket before that is also in flight. A step joins
    when the memory fits and merging exposes no more communication than a split would
    (which includes every case where the merged bucket still fits in its window). A
    window hides only ``comm.hidden_fraction`` of its computation's time: where collectives and
    compute share cores (gloo on CPU) prefetching hides little, and fewer, larger buckets
    win. Pure and deterministic: same inputs, same buckets.
    """
    if memory_limit_bytes is not None and memory_limit_bytes <= 0:
        raise ValueError(f"memory_limit_bytes must be positive, got {memory_limit_bytes}")
    if not steps:
        return [], []
    buckets: list[list[int]] = []
    decisions: list[Decision] = []
    current = [0]
    window, rs_window, rs_before = 0.0, 0.0, 0.0  # see the docstring

    def total(idx: list[int], field: str) -> float:
        return sum(getattr(steps[j], field) for j in idx)

    def hides(idx: list[int]) -> float:  # what the computation of ``idx`` can hide
        return comm.hidden_fraction * comm.compute_slowdown * total(idx, "compute_s")

    for i in range(1, len(steps)):
        step = steps[i]
        merged_comm = _comm(comm, kind, int(total(current, "nbytes")) + step.nbytes)
        alone_comm = _comm(comm, kind, int(total(current, "nbytes")))
        memory = int(total(current, "memory_bytes")) + step.memory_bytes
        exposed_merged = max(0.0, rs_before + merged_comm - window)
        # split: the bucket closes as is; the step is prefetched behind its computation
        # while the reduce-scatter of the window's bucket is in flight.
        exposed_split = max(0.0, rs_before + alone_comm - window) + max(
            0.0, rs_window + _comm(comm, kind, step.nbytes) - hides(current))
        memory_ok = memory_limit_bytes is None or memory <= memory_limit_bytes
        if not memory_ok:
            merged, reason = False, "memory over the limit"
        elif rs_before + merged_comm <= window:
            merged, reason = True, "fits under compute"
        elif exposed_merged <= exposed_split:
            merged, reason = True, "exposed either way; one collective exposes less"
        else:
            merged, reason = False, "would expose more communication than a new bucket"
        decisions.append(Decision(i, step.name, merged, reason, merged_comm, rs_before,
                                  window, memory, memory_limit_bytes, exposed_merged,
                                  exposed_split))
        if merged:
            current.append(i)
            continue
        buckets.append(current)
        rs_before, rs_window = rs_window, _reductions(comm, scatter_kind, steps, current)
        window = hides(current)
        current = [i]
    buckets.append(current)
    return buckets, decisions


def estimate_exposed(steps: Sequence[Step], buckets: Sequence[Sequence[int]],
                     comm: cost.CommModel, kind: str = "all_gather",
                     scatter_kind: str = "reduce_scatter") -> float:
    """Seconds of communication left exposed by ``buckets`` in the simulated step."""
    return simulate(steps, buckets, comm, kind, scatter_kind).exposed_s


# ---------------------------------------------------------------------------- FX side


@dataclass
class Plan:
    """What :func:`plan` decided for one graph. ``estimates``: the simulated step of
    each planner's buckets ("auto", "greedy"); ``method`` names the one applied."""

    assignment: dict[fx.Node, str]
    steps: list[Step]
    buckets: list[list[int]]
    decisions: list[Decision]
    estimates: dict[str, Estimate]
    method: str
    kind: str
    memory_limit_bytes: float | None = None
    profile_s: float = 0.0  # time spent measuring the graph's compute (0: from a cache)
    decided: dict | None = None  # the JSON form, for the plan cache
    # the liveness peak of the graph as bucketed and reordered (``applied_peak``): what
    # ``memory_limit_bytes`` is held to; None from a plan cache written before it existed
    peak_bytes: int | None = None

    @property
    def estimated_exposed_s(self) -> float:
        """The applied plan's simulated step beyond its one-rank compute (exposed
        communication, copies, contention): comparable with a measured step minus a
        compute-only step (``Estimate.overhead_s``)."""
        return self.estimates[self.method].overhead_s if self.estimates else 0.0


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
                  ) -> list[Step]:
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
    steps = [Step(c.module, c.nbytes, sum(node_seconds[j] for j in seg),
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


def fit_to_limit(steps: list[Step], comm: cost.CommModel, memory_limit_bytes: float,
                 kind: str, buckets: list[list[int]],
                 peak_of: Callable[[list[list[int]]], int]) -> tuple[list[list[int]], int]:
    """``buckets`` (the search's plan under ``memory_limit_bytes``) or, when ``peak_of``
    (the peak of the graph as those buckets leave it) is over the limit, the fastest
    plan found whose peak is under it: the search is re-run under lower targets, first
    the plan's own step-model peak lowered by its overshoot (until a plan fits), then
    bisecting between the highest target whose plan fits and the lowest whose plan does
    not, ``FIT_ROUNDS`` searches in all; failing that, the lowest-peaking plan tried,
    one collective per bucket included. Returns the plan and its peak.

    The search's step model (``simulate.bucket_peak``) sees each bucket's neighbours
    only; the applied graph also holds what the passes add around them (copy-out
    buffers, collective inputs until their deferred waits, the process group's
    temporaries), so the limit is checked on it. Lowering by the overshoot alone
    undershoots: on the debug model it jumped from a 2-bucket backward over the limit
    straight to 38 single collectives, where 6 buckets fit."""
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


def decide(steps: list[Step], comm: cost.CommModel, memory_limit_bytes: float | None,
           method: str, kind: str,
           peak_of: Callable[[list[list[int]]], int] | None = None) -> dict[str, Any]:
    """Both planners over ``steps`` (compute quantised first), simulated: the JSON form of
    a decision (what ranks share through the store and the plan cache keeps).
    ``peak_of``: the peak of the graph a plan leaves (``applied_peak``); with it the
    "auto" plan is held to ``memory_limit_bytes`` on that peak (``fit_to_limit``) and
    the applied plan's peak is kept as ``peak_bytes``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    steps = [dataclasses.replace(s, compute_s=quantise_seconds(s.compute_s)) for s in steps]
    greedy, decisions = greedy_buckets(steps, comm, memory_limit_bytes, kind)
    best = optimal_buckets(steps, comm, memory_limit_bytes, kind)
    peak = None
    if peak_of is not None and method == "auto" and memory_limit_bytes is not None:
        best, peak = fit_to_limit(steps, comm, memory_limit_bytes, kind, best, peak_of)
    applied = best if method == "auto" else greedy
    if peak_of is not None and peak is None:
        peak = peak_of(applied)
    return {"kind": kind, "method": method, "steps": [dataclasses.asdict(s) for s in steps],
            "buckets": applied, "peak_bytes": peak,
            "decisions": [dataclasses.asdict(d) for d in decisions],
            "estimates": {"auto": dataclasses.asdict(simulate(steps, best, comm, kind)),
                          "greedy": dataclasses.asdict(simulate(steps, greedy, comm, kind))}}


def in_flight_scratch(collectives: Sequence[Collective]) -> dict[str, float] | None:
    """The process group's in-flight temporaries for these collectives
    (``cost.memory.IN_FLIGHT_SCRATCH``): gloo's for CPU tensors on a gloo group."""
    for c in collectives:
        val = c.start.meta.get("val")
        if getattr(val, "device", None) is not None and val.device.type == "cpu" \
                and uses_gloo(c.group_name):
            return cost.memory.IN_FLIGHT_SCRATCH["gloo"]
    return None


def applied_peak(graph: fx.Graph, collectives: list[Collective],
                 assignment: dict[fx.Node, str], reordering: bool = True,
                 scratch: dict[str, float] | None = None) -> int:
    """Liveness peak (``cost.peak_memory_estimate``) of ``graph`` once bucketed by
    ``assignment`` (all-reduces as the backend buckets them) and reordered, as the
    backend's passes leave it; computed on a copy, ``graph`` is not changed. The larger
    of two placements of a bucket's copy-out: where the pass puts it (eager execution)
    and sunk into each parameter's use (Inductor: the gathered buffer then lives until
    the bucket's last use)."""
    copy = fx.Graph()
    nodes: dict[fx.Node, fx.Node] = {}
    copy.output(copy.graph_copy(graph, nodes))
    mapped = [dataclasses.replace(c, start=nodes[c.start], wait=nodes[c.wait])
              for c in collectives]
    moved = {nodes[n]: name for n, name in assignment.items()}
    moved.update(assign_all_reduces(mapped, moved))
    buckets = bucket_collectives(copy, mapped, moved)
    stable_topological_sort(copy)
    if reordering:
        reorder(copy, buckets, is_backward(graph))
    return max(cost.peak_memory_estimate(copy, scratch, alias_of)[0]
               for alias_of in (cost.memory.alias_bases, cost.memory.sunk_copies))


def plan(graph: fx.Graph, collectives: list[Collective], comm: cost.CommModel,
         memory_limit_bytes: float | None, measure: bool = True,
         compute_cache: dict | None = None, agreement: StoreAgreement | None = None,
         method: str = "auto", cached: dict | None = None, reordering: bool = True) -> Plan:
    """Bucket assignment for one graph (before bucketing).

    ``cached``: a decision from the plan cache (then nothing is measured or exchanged).
    ``memory_limit_bytes`` holds the peak of the graph as the passes leave it
    (``applied_peak``, with the process group's in-flight temporaries and, with
    ``reordering``, the prefetches and deferred waits): ``Plan.peak_bytes``.
    Otherwise the first rank of ``agreement`` measures its nodes' compute, decides, and
    shares the decision through the store; the other ranks wait for it. Without an
    agreement (one rank, a fake group) this rank decides alone.
    """
    gathers = [c for c in collectives if c.kind == "all_gather"]
    scatters = [c for c in collectives if c.kind == "reduce_scatter"]
    if gathers:
        primary, mirrored, kind, reverse = gathers, scatters, "all_gather", False
    else:
        primary, mirrored, kind, reverse = scatters, [], "reduce_scatter", True
    if not primary:
        return Plan({}, [], [], [], {}, method, kind, memory_limit_bytes)
    owner = owner_steps(graph, primary, mirrored)
    # HSDP: the all-reduce of a reduce-scattered shard rides on its reduce-scatter's step.
    all_reduces = [(owner[source], c.nbytes) for c in collectives if c.kind == "all_reduce"
                   for source in [feeding_reduce_scatter(c.start)] if source in owner]
    profile_s = [0.0]
    scratch = in_flight_scratch(primary)

    step_names = [c.module for c in (primary[::-1] if reverse else primary)]

    def peak_of(buckets: list[list[int]]) -> int:
        return applied_peak(graph, collectives, bucket_assignment(
            primary, mirrored, owner, reverse, buckets, step_names), reordering, scratch)

    def measure_and_decide() -> dict[str, Any]:
        started = time.perf_counter()
        seconds = cost.estimate_graph_compute(graph, measure=measure, cache=compute_cache)
        profile_s[0] = time.perf_counter() - started
        steps = profile_steps(graph, primary, mirrored, seconds, owner, reverse, all_reduces)
        return decide(steps, comm, memory_limit_bytes, method, kind, peak_of)

    if cached is not None:
        decided = cached
    elif agreement is not None:
        decided = agreement.from_first(measure_and_decide)
    else:
        decided = measure_and_decide()
    steps = [Step(**s) for s in decided["steps"]]
    buckets = [list(b) for b in decided["buckets"]]
    if len(steps) != len(primary) or sorted(j for b in buckets for j in b) != \
            list(range(len(primary))):
        raise ValueError(f"the plan has {len(steps)} steps but the graph {len(primary)} "
                         f"collectives: a stale plan cache? Delete it (see "
                         f"simplefsdp.compiler.plan_cache) and compile again")
    assignment = bucket_assignment(primary, mirrored, owner, reverse, buckets,
                             [s.name for s in steps])
    return Plan(assignment, steps, buckets, [Decision(**d) for d in decided["decisions"]],
                {k: Estimate(**e) for k, e in decided["estimates"].items()},
                decided["method"], kind, memory_limit_bytes, profile_s[0], decided,
                decided.get("peak_bytes"))


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
