"""Auto wrapping: choose the buckets greedily under time and memory constraints
(SimpleFSDP section 3.3.2, Table 1, Algorithm 1).

The core, :func:`greedy_buckets`, is a pure function over a list of :class:`Step` (one
per all-gather in issue order: its bytes, the compute that uses its parameters, the
memory that compute needs, and in backward the bytes of the reduce-scatters of the same
parameters). It walks the steps and either extends the open bucket with the next step or
closes it:

* extend when the bucket's communication (plus, in backward, the reduce-scatter of the
  step before) still fits under the computation it is prefetched behind and the bucket's
  memory stays under the limit: Algorithm 1 as written;
* when it no longer fits, extend anyway if that exposes no more communication than
  issuing the step as its own collective (on a high-latency fabric one more ``alpha``
  costs more than the extra bytes), as long as the memory still fits.

:func:`plan` turns a graph into steps (compute measured by ``cost.compute``, agreed
across ranks), runs the greedy and returns a ``{collective start node: bucket name}`` map for
``bucketing.bucket_collectives``; reduce-scatters follow the bucket of the all-gather of
the same parameter. Every number a decision reads is agreed across ranks first, so all
ranks bucket identically.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from ..agreement import StoreAgreement
from . import cost
from .collectives import Collective, feeding_reduce_scatter

GB = 1e9  # memory_limit_gb counts decimal gigabytes


@dataclass(frozen=True)
class Step:
    """One collective of the greedy, in issue order.

    ``nbytes``: full (unsharded) bytes of the collective (T_mi from the comm model).
    ``compute_s``: computation that uses what it gathered (T_ci); once in a closed bucket
    it is the window the next bucket's communication hides behind.
    ``memory_bytes``: memory live while that computation runs (M_ci).
    ``scatter_bytes``: bytes of the reduce-scatters that mirror this step (backward): they
    share the following step's window (T_mi^RS).
    ``all_reduce_bytes``: HSDP: bytes of the all-reduces of those reduce-scatters' shards
    (over the replicas), which follow them in the same window.
    """

    name: str
    nbytes: int
    compute_s: float
    memory_bytes: int
    scatter_bytes: int = 0
    all_reduce_bytes: int = 0


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


def _comm(model: cost.CommModel, kind: str, nbytes: int) -> float:
    """Time of one collective; no bytes means no collective, hence no latency either."""
    return model.predict(kind, nbytes) if nbytes > 0 else 0.0


def _reductions(model: cost.CommModel, kind: str, steps: Sequence[Step],
                members: Sequence[int]) -> float:
    """The backward reductions of ``members``: one ``kind`` collective (reduce-scatter)
    over their ``scatter_bytes``, then (HSDP) one all-reduce of the reduced shards."""
    return _comm(model, kind, int(sum(steps[j].scatter_bytes for j in members))) + _comm(
        model, "all_reduce", int(sum(steps[j].all_reduce_bytes for j in members)))


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
        return comm.hidden_fraction * total(idx, "compute_s")

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
    """Seconds of communication left exposed by ``buckets`` under the greedy's model.

    Bucket k's collective runs behind bucket k-1's computation together with bucket
    k-2's reduce-scatter; the first bucket's collective is fully exposed, and after the
    last bucket its reduce-scatter and the one before it only have the last computation
    (the one before) and nothing (the last) to hide behind.
    """
    comp = [comm.hidden_fraction * sum(steps[j].compute_s for j in b) for b in buckets]
    main = [_comm(comm, kind, sum(steps[j].nbytes for j in b)) for b in buckets]
    rs = [_reductions(comm, scatter_kind, steps, b) for b in buckets]
    exposed = 0.0
    for k in range(len(buckets)):
        window = comp[k - 1] if k >= 1 else 0.0
        before = rs[k - 2] if k >= 2 else 0.0
        exposed += max(0.0, before + main[k] - window)
    if len(buckets) >= 2:
        exposed += max(0.0, rs[-2] - comp[-1])
    if buckets:
        exposed += rs[-1]
    return exposed


# ---------------------------------------------------------------------------- FX side


@dataclass
class Plan:
    """What :func:`plan` decided for one graph."""

    assignment: dict[fx.Node, str]
    steps: list[Step]
    buckets: list[list[int]]
    decisions: list[Decision]
    estimated_exposed_s: float
    kind: str
    profile_s: float = 0.0  # time spent measuring the graph's compute


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
    segment's peak growth in live bytes.
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
                  c.nbytes + _segment_memory(live, seg, s), ob, ab)
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


def _bucket_name(k: int, steps: list[Step], members: list[int]) -> str:
    first, last = steps[members[0]].name, steps[members[-1]].name
    return f"auto{k}:{first}" + (f"..{last}" if len(members) > 1 else "")


def plan(graph: fx.Graph, collectives: list[Collective], comm: cost.CommModel,
         memory_limit_bytes: float | None,
         compute_cache: dict | None = None, agreement: StoreAgreement | None = None) -> Plan:
    """Bucket assignment for one graph (before bucketing), by Algorithm 1.

    Every rank measures its nodes' compute time; with an ``agreement`` the per-step
    computation and memory are replaced by their MAX over its ranks before any decision,
    so every rank returns the same plan.
    """
    gathers = [c for c in collectives if c.kind == "all_gather"]
    scatters = [c for c in collectives if c.kind == "reduce_scatter"]
    if gathers:
        primary, mirrored, kind, reverse = gathers, scatters, "all_gather", False
    else:
        primary, mirrored, kind, reverse = scatters, [], "reduce_scatter", True
    if not primary:
        return Plan({}, [], [], [], 0.0, kind)
    started = time.perf_counter()
    seconds = cost.estimate_graph_compute(graph, cache=compute_cache)
    profile_s = time.perf_counter() - started
    owner = owner_steps(graph, primary, mirrored)
    # HSDP: the all-reduce of a reduce-scattered shard rides on its reduce-scatter's step.
    all_reduces = [(owner[source], c.nbytes) for c in collectives if c.kind == "all_reduce"
                   for source in [feeding_reduce_scatter(c.start)] if source in owner]
    steps = profile_steps(graph, primary, mirrored, seconds, owner, reverse, all_reduces)
    steps = _agree_steps(steps, agreement)
    buckets, decisions = greedy_buckets(steps, comm, memory_limit_bytes, kind)
    exposed = estimate_exposed(steps, buckets, comm, kind)
    in_graph_order = primary[::-1] if reverse else primary
    assignment: dict[fx.Node, str] = {}
    names = {}
    for k, members in enumerate(buckets):
        name = _bucket_name(k, steps, members)
        for j in members:
            assignment[in_graph_order[j].start] = name
            names[j] = name
    for c in mirrored:
        assignment[c.start] = names[owner[c.start]]
    return Plan(assignment, steps, buckets, decisions, exposed, kind, profile_s)


def _agree_steps(steps: list[Step], agreement: StoreAgreement | None) -> list[Step]:
    """Replace each step's measured computation and memory by the MAX over the agreeing
    ranks, so all decide on the same numbers (the bytes come from the graph: equal)."""
    if agreement is None:
        return steps
    flat = [float(v) for s in steps for v in (s.compute_s, s.memory_bytes)]
    agreed = agreement.max(flat)
    return [dataclasses.replace(s, compute_s=agreed[2 * k], memory_bytes=int(agreed[2 * k + 1]))
            for k, s in enumerate(steps)]
