"""A simulated training step for a bucketing plan: compute stream + communication stream.

The schedule is the one our reordering produces (paper Figure 2), prefetching one
bucket ahead. With buckets ``b_0 .. b_{m-1}`` in issue order, ``C_k`` their compute,
``A_k`` their collective, ``R_k`` (backward) the reduce-scatter of their gradients
(with HSDP followed by the all-reduce of its shards over the replicas):

* ``A_k`` is issued when the compute of ``b_{k-1}`` starts and runs during it, together
  with ``R_{k-2}`` (issued when ``b_{k-2}``'s compute ended). ``A_0`` hides behind nothing.
* Where communication ``D`` runs during compute ``C`` the pair takes
  ``C + D - f * min(C, D)``, ``f = CommModel.hidden_fraction``: the measured fraction
  of the overlapped time that is really hidden (``cost.probes.measure_hidden_fraction``
  defines it the same way): ~1 with a communication engine of its own (NCCL), ~0 where
  collectives and compute share the cores (gloo on a small CPU host).
* After the last compute, the last reduce-scatter is fully exposed.
* A bucket of several collectives pays its copy-in and copy-out (``CommModel.copy``
  seconds per byte) on the compute stream.
* Compute runs ``CommModel.compute_slowdown`` times slower than measured on one rank
  alone (every rank computes at once; on a CPU host they share cores and memory
  bandwidth). ``Estimate.overhead_s``, the step beyond its one-rank compute, is then
  what a benchmark measures as step minus a compute-only step.

Memory while bucket ``k`` computes: the step's own live bytes without its gathered
parameters (sharded state, activations: ``CollectiveCost.base_bytes``), plus bucket ``k``'s
gathered bytes, bucket ``k+1``'s prefetched bytes, the flat buffer of a merged bucket
during copy-out, and the gradients of ``b_{k-1}``'s reduce-scatter, in flight until its
deferred wait: the collective keeps its input (NCCL stashes it; gloo reduces a copy of
it and copies the shard out on the wait), even where the graph no longer uses it.

:func:`simulate` computes all of this for one plan; ``bucket_search`` optimises the very
same terms (:func:`window`, :func:`copy_seconds`, :func:`bucket_peak`), so the two agree
exactly. :func:`simulate_graph` is the same two streams over a scheduled graph, op by
op, for the planner, whose graphs are already bucketed and reordered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import fx

from .collectives import KINDS, WAIT
from .cost import CommModel


@dataclass(frozen=True)
class CollectiveCost:
    """One collective of the plan, in issue order, with what the step model reads about
    it (a plan's "steps" are these, one per collective).

    ``nbytes``: full (unsharded) bytes of the collective.
    ``compute_s``: computation that uses what it gathered (what the next bucket's
    collective hides behind once this step's bucket computes).
    ``memory_bytes``: the gathered bytes plus the segment's growth in live bytes (the
    paper's M_ci, what the greedy's memory rule reads).
    ``scatter_bytes``: bytes of the reduce-scatters that mirror this step (backward).
    ``base_bytes``: bytes live while its computation runs, other than gathered
    parameters: sharded state, activations, gradients (the step-peak model).
    ``all_reduce_bytes``: HSDP: bytes of the all-reduces of those reduce-scatters' shards
    (over the replicas), which follow them in the same window.
    """

    name: str
    nbytes: int
    compute_s: float
    memory_bytes: int
    scatter_bytes: int = 0
    base_bytes: int = 0
    all_reduce_bytes: int = 0


@dataclass(frozen=True)
class Estimate:
    """What :func:`simulate` predicts for one plan (seconds, bytes)."""

    step_s: float  # compute + contention + copies + exposed communication
    compute_s: float  # measured on one rank alone
    copy_s: float
    exposed_s: float  # communication not hidden by compute
    peak_bytes: int
    buckets: int
    contention_s: float = 0.0  # compute's slowdown with every rank computing at once

    @property
    def overhead_s(self) -> float:
        """The step beyond its one-rank compute: exposed communication, copies and
        contention (what the benchmark measures as step minus compute-only)."""
        return self.step_s - self.compute_s

    def __str__(self) -> str:
        return (f"{self.buckets} buckets: step {self.step_s * 1e3:.3f} ms (compute "
                f"{self.compute_s * 1e3:.3f}, contention {self.contention_s * 1e3:.3f}, "
                f"copies {self.copy_s * 1e3:.3f}, exposed communication "
                f"{self.exposed_s * 1e3:.3f}), peak {self.peak_bytes / 1e9:.4g} GB")


def comm_seconds(comm: CommModel, kind: str, nbytes: float) -> float:
    """One collective's time; no bytes means no collective, hence no latency either."""
    return comm.predict(kind, nbytes) if nbytes > 0 else 0.0


def reduction_seconds(comm: CommModel, kind: str, scatter_bytes: float,
                      all_reduce_bytes: float) -> float:
    """A bucket's backward reductions: one ``kind`` collective (reduce-scatter) over its
    ``scatter_bytes``, then (HSDP) one all-reduce of the reduced shards."""
    return comm_seconds(comm, kind, scatter_bytes) + comm_seconds(comm, "all_reduce",
                                                                  all_reduce_bytes)


def window(compute_s: float, comm_s: float, hidden_fraction: float) -> float:
    """Time of ``compute_s`` with ``comm_s`` running during it (see module doc)."""
    return compute_s + comm_s - hidden_fraction * min(compute_s, comm_s)


def copy_bytes(kind: str, nbytes: int, scatter_bytes: int, world_size: int) -> int:
    """Bytes a merged bucket copies: an all-gather bucket concatenates the shards
    (``nbytes / world``) and copies every parameter out of the gathered buffer
    (``nbytes``); a reduce-scatter bucket concatenates the full gradients (its outputs
    are views). ``scatter_bytes`` are reduce-scatters merged alongside."""
    main = nbytes // max(world_size, 1) + nbytes if kind == "all_gather" else nbytes
    return main + scatter_bytes


def copy_seconds(comm: CommModel, kind: str, count: int, nbytes: int,
                 scatter_bytes: int) -> float:
    """Copy-in/copy-out time of a bucket of ``count`` steps (none for a single one)."""
    if count <= 1:
        return 0.0
    return comm.copy_s_per_byte * copy_bytes(kind, nbytes, scatter_bytes, comm.world_size)


def bucket_peak(base: int, count: int, nbytes: int, next_nbytes: int,
                prev_scatter_bytes: int) -> int:
    """Live bytes while one bucket computes (see module doc)."""
    flat = nbytes if count > 1 else 0
    return base + nbytes + next_nbytes + flat + prev_scatter_bytes


def simulate(steps: Sequence[CollectiveCost], buckets: Sequence[Sequence[int]], comm: CommModel,
             kind: str = "all_gather", scatter_kind: str = "reduce_scatter") -> Estimate:
    """The simulated step of ``buckets`` (lists of step indices, contiguous, in order)."""
    if not buckets:
        return Estimate(0.0, 0.0, 0.0, 0.0, 0, 0)
    f = comm.hidden_fraction
    slow = comm.compute_slowdown
    comp = [slow * sum(steps[j].compute_s for j in b) for b in buckets]
    size = [sum(steps[j].nbytes for j in b) for b in buckets]
    rs_size = [sum(steps[j].scatter_bytes for j in b) for b in buckets]
    main = [comm_seconds(comm, kind, n) for n in size]
    ar_size = [sum(steps[j].all_reduce_bytes for j in b) for b in buckets]
    rs = [reduction_seconds(comm, scatter_kind, n, a)
          for n, a in zip(rs_size, ar_size, strict=True)]
    copies = sum(copy_seconds(comm, kind, len(b), size[k], rs_size[k])
                 for k, b in enumerate(buckets))
    total = 0.0
    for k in range(len(buckets)):
        before = rs[k - 2] if k >= 2 else 0.0
        total += window(comp[k - 1] if k >= 1 else 0.0, main[k] + before, f)
    total += window(comp[-1], rs[-2] if len(buckets) >= 2 else 0.0, f) + rs[-1]
    peak = 0
    for k, b in enumerate(buckets):
        base = max(steps[j].base_bytes for j in b)
        nxt = size[k + 1] if k + 1 < len(buckets) else 0
        prev_rs = rs_size[k - 1] if k >= 1 else 0
        peak = max(peak, bucket_peak(base, len(b), size[k], nxt, prev_rs))
    slowed = sum(comp)
    compute = sum(steps[j].compute_s for b in buckets for j in b)
    return Estimate(total + copies, compute, copies, total - slowed, peak, len(buckets),
                    slowed - compute)


def simulate_graph(graph: fx.Graph, op_seconds: Callable[[fx.Node], float],
                   collective_seconds: Callable[[fx.Node], tuple[str, float]]
                   ) -> tuple[float, float]:
    """(seconds, exposed communication seconds) of a scheduled graph: one compute stream,
    one communication stream per process group. A collective start is issued on its
    group's stream (``collective_seconds(node)``: the stream's key and the collective's
    time) when compute reaches it, after the collectives before it on that stream; a
    wait stalls compute until its collective is done; every other node takes
    ``op_seconds(node)`` on the compute stream (prefetched collectives hide, collectives
    waited on at once are exposed)."""
    now, exposed = 0.0, 0.0
    stream_free: dict[str, float] = {}
    done: dict[fx.Node, float] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in KINDS:
            stream, seconds = collective_seconds(node)
            start = max(now, stream_free.get(stream, 0.0))
            stream_free[stream] = done[node] = start + seconds
        elif node.target == WAIT and node.args[0] in done:
            finish = done[node.args[0]]
            if finish > now:
                exposed += finish - now
                now = finish
        else:
            now += op_seconds(node)
    return now, exposed
