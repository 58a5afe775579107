"""Auto wrapping: choose the buckets under time and memory constraints (SimpleFSDP
section 3.3.2), by an exact search over a simulated step or by the paper's greedy.

The pieces, one module each:

* :mod:`.steps`: a graph becomes a list of :class:`.simulate.CollectiveCost` (one per
  collective in issue order: its bytes, the compute that uses its parameters, the memory
  live meanwhile, and in backward the bytes of the reduce-scatters of the same
  parameters), and a plan becomes bucket names again;
* the planners: ``"auto"`` (default), :func:`.bucket_search.optimal_buckets`, dynamic
  programming over contiguous bucket boundaries minimising the step time of
  :mod:`.simulate` (compute and communication streams, the measured fraction of a
  collective that compute hides, copy-in/copy-out) with the predicted step peak under
  ``memory_limit_gb``; ``"greedy"``, :func:`.greedy.greedy_buckets`, Algorithm 1 of the
  paper, whose memory rule is the paper's (a bucket's own memory), kept for comparison;
* :mod:`.fit_limit`: the chosen plan held to the limit on the graph the passes leave
  (:func:`.passes.apply_passes`, the backend's own pipeline, run on a copy).

Both plans are simulated and reported. :func:`plan` (here) measures a graph's compute on
one rank (quantised), decides on the first rank of the agreement and shares the
decision through the store, so every rank buckets identically, and returns a
``{collective start node: bucket name}`` map for the passes; reduce-scatters follow the
bucket of the all-gather of the same parameters.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import fx

from ..agreement import StoreAgreement
from . import cost
from .bucket_search import optimal_buckets
from .collectives import Collective, feeding_reduce_scatter
from .fit_limit import applied_peak, fit_to_limit
from .greedy import Decision, greedy_buckets
from .manual_wrap import DEFAULT_ALL_REDUCE_BUCKET_MB
from .simulate import CollectiveCost, Estimate, simulate
from .steps import (
    bucket_assignment,
    in_flight_scratch,
    owner_steps,
    profile_steps,
    quantise_seconds,
)

METHODS = ("auto", "greedy")

GB = 1e9  # memory_limit_gb counts decimal gigabytes


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


@dataclass
class Plan:
    """What :func:`plan` decided for one graph. ``estimates``: the simulated step of
    each planner's buckets ("auto", "greedy"); ``method`` names the one applied."""

    assignment: dict[fx.Node, str]
    steps: list[CollectiveCost]
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


def decide(steps: list[CollectiveCost], comm: cost.CommModel, memory_limit_bytes: float | None,
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


def plan(graph: fx.Graph, collectives: list[Collective], comm: cost.CommModel,
         memory_limit_bytes: float | None, measure: bool = True,
         compute_cache: dict | None = None, agreement: StoreAgreement | None = None,
         method: str = "auto", cached: dict | None = None, reordering: bool = True,
         all_reduce_bucket_mb: float = DEFAULT_ALL_REDUCE_BUCKET_MB) -> Plan:
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
            primary, mirrored, owner, reverse, buckets, step_names), reordering, scratch,
            all_reduce_bucket_mb)

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
    steps = [CollectiveCost(**s) for s in decided["steps"]]
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
