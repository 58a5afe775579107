"""The paper's greedy bucketing (SimpleFSDP Algorithm 1) over a graph's collectives.

Kept next to the exact search (:mod:`.bucket_search`) for comparison: both plans are
simulated and reported. Its memory rule is the paper's (a bucket's own memory), not the
step peak the search holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .cost import CommModel
from .simulate import CollectiveCost, comm_seconds, reduction_seconds


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


def _reductions(model: CommModel, kind: str, steps: Sequence[CollectiveCost],
                members: Sequence[int]) -> float:
    """The backward reductions of ``members``: one ``kind`` collective (reduce-scatter)
    over their ``scatter_bytes``, then (HSDP) one all-reduce of the reduced shards."""
    return reduction_seconds(model, kind, sum(steps[j].scatter_bytes for j in members),
                             sum(steps[j].all_reduce_bytes for j in members))


def greedy_buckets(steps: Sequence[CollectiveCost], comm: CommModel,
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
        merged_comm = comm_seconds(comm, kind, int(total(current, "nbytes")) + step.nbytes)
        alone_comm = comm_seconds(comm, kind, int(total(current, "nbytes")))
        memory = int(total(current, "memory_bytes")) + step.memory_bytes
        exposed_merged = max(0.0, rs_before + merged_comm - window)
        # split: the bucket closes as is; the step is prefetched behind its computation
        # while the reduce-scatter of the window's bucket is in flight.
        exposed_split = max(0.0, rs_before + alone_comm - window) + max(
            0.0, rs_window + comm_seconds(comm, kind, step.nbytes) - hides(current))
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

