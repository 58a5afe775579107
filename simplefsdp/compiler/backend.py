"""The ``torch.compile`` backend: AOTAutograd graphs -> our passes -> Inductor or eager.

``aot_eager``: our own forward/backward compilers run the passes and execute the graph
as is; the min-cut partitioner keeps the selective-checkpoint recompute (re-gather in
backward), which the default partitioner would drop.
``inductor``: the passes run as Inductor's post-grad custom pass on both graphs.

Every pass decision depends only on the sequence of collectives and module names, which
is the same on every rank, so every rank issues the same collectives in the same order.
``bucketing="auto"`` also reads measured numbers (communication model, compute times),
agreed across ranks before use (through the rendezvous store: inside a compiler pass
only the store is safe, see ``simplefsdp.agreement``); its pass talks to the other
ranks, so Inductor's graph caches are bypassed for it (a rank that hit the cache would
skip the exchange and hang the others).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from torch import fx

from .._torch_compat import aot_autograd, compile_fx, custom_graph_pass_base
from ..agreement import StoreAgreement
from ..gloo_kernel import install_gloo_collectives, uses_gloo
from . import auto_wrap, cost, manual_wrap
from .bucketing import bucket_collectives, bucket_of_one
from .collectives import (
    find_collectives,
    is_backward,
    other_collectives,
    stable_topological_sort,
)
from .reordering import reorder

log = logging.getLogger("simplefsdp.compiler")
BACKENDS = ("inductor", "aot_eager")
BUCKETING = ("none", "manual", "auto")


@dataclass
class GraphReport:
    """What our passes did to one graph."""

    graph: str  # "forward" or "backward"
    collectives_before: dict[str, int]
    collectives_after: dict[str, int] = field(default_factory=dict)
    other_collectives: int = 0  # not data-parallel (TP/SP, user): left in place
    buckets: list[dict] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    schedule: list[tuple[str, str, int]] = field(default_factory=list)  # (event, bucket, B)
    # "kind bucket": computation nodes that run while the bucket's collective is in flight
    nodes_in_flight: dict[str, int] = field(default_factory=dict)
    pass_seconds: float = 0.0
    # bucketing="auto" only: one decision per candidate collective after the first (its
    # inputs: estimated comm, compute window, memory, and the outcome), the comm model
    # used, and the estimated exposed communication of the chosen buckets.
    decisions: list[auto_wrap.Decision] = field(default_factory=list)
    comm_model: dict | None = None
    estimated_exposed_s: float | None = None

    def __str__(self) -> str:
        lines = [f"[simplefsdp] {self.graph}: collectives {self.collectives_before} -> "
                 f"{self.collectives_after}, {len(self.buckets)} buckets, "
                 f"{len(self.moves)} moves, {self.pass_seconds * 1e3:.1f} ms"]
        lines += [f"  bucket {b['kind']} {b['name']}: {b['count']} tensors, {b['bytes']} B"
                  for b in self.buckets if b["count"] > 1]
        lines += [f"  {m}" for m in self.moves] + [f"  note: {n}" for n in self.notes]
        if self.comm_model is not None:
            lines.append(f"  auto: comm model {self.comm_model}, estimated exposed "
                         f"communication {self.estimated_exposed_s * 1e3:.3f} ms")
        lines += [f"  decision: {d}" for d in self.decisions]
        return "\n".join(lines)


class SimpleFSDPBackend:
    """A backend for ``torch.compile(model, fullgraph=True, backend=...)`` that runs our
    bucketing and reordering passes on the forward and backward graphs; ``reports``
    holds one :class:`GraphReport` per compiled graph. Public as ``compile_backend``.

    ``backend``: "inductor" or "aot_eager". ``bucketing``: "none", "manual" (one bucket
    per entry of ``module_plan``; None: derived from the graph) or "auto": Algorithm 1
    of the paper under ``memory_limit_gb`` (GB of prefetched memory per bucket; None: no
    limit), from ``comm_model`` or, when None, a model calibrated on the default process
    group when the backend is built (cached on disk, see ``cost.get_comm_model``;
    collective: build the backend on every rank). Its measurements are agreed across
    ``group``: every rank that compiles the same model (None: all ranks; under pipeline
    parallelism, the ranks of one stage). ``reordering``: prefetch all-gathers and
    defer reduce-scatter and all-reduce waits.

    Only data-parallel collectives are bucketed and moved (those on the process groups
    ``data_parallel`` shards over); TP/SP, pipeline and user collectives stay as traced.
    With bucketing "manual" or "auto", ``mode="replicate"`` gradient all-reduces are
    merged in backward order into buckets that close once they hold
    ``all_reduce_bucket_mb`` MB (DDP's rule, default 25), and each HSDP reduce-scatter
    bucket is followed by one all-reduce of its shards over the replicas.
    """

    def __init__(self, backend: str = "inductor", bucketing: str = "none",
                 reordering: bool = True, module_plan: Sequence | None = None,
                 memory_limit_gb: float | None = None,
                 comm_model: cost.CommModel | None = None,
                 group: dist.ProcessGroup | None = None,
                 all_reduce_bucket_mb: float = manual_wrap.DEFAULT_ALL_REDUCE_BUCKET_MB):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if bucketing not in BUCKETING:
            raise ValueError(f"bucketing must be one of {BUCKETING}, got {bucketing!r}")
        self.memory_limit_bytes = auto_wrap.check_memory_limit(memory_limit_gb)
        if comm_model is not None and not isinstance(comm_model, cost.CommModel):
            raise ValueError(f"comm_model must be a cost.CommModel (or None to "
                             f"calibrate on the process group), got {type(comm_model)}")
        if module_plan is not None and bucketing != "manual":
            raise ValueError("module_plan is used only with bucketing='manual'")
        if module_plan is not None:
            manual_wrap.bucket_names(module_plan)  # validate now, not mid-compile
        self.backend, self.bucketing, self.reordering = backend, bucketing, reordering
        self.module_plan = list(module_plan) if module_plan is not None else None
        self.memory_limit_gb = memory_limit_gb
        self.all_reduce_bucket_mb = manual_wrap.check_bucket_mb(all_reduce_bucket_mb)
        # bucketing="auto" agrees on measurements across the ranks compiling these graphs
        self._agreement = StoreAgreement.create(group) if bucketing == "auto" else None
        self.reports: list[GraphReport] = []
        # bucketing="auto": the comm model (given, or calibrated once here, through
        # the cost model's disk cache) and measured op times, shared by all graphs.
        self.comm_model = comm_model
        if bucketing == "auto" and comm_model is None:
            self.comm_model = _calibrated_comm_model()
        self._compute_cache: dict = {}

    # -- torch.compile entry point ------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs):
        _install_cpu_collectives()
        if self.backend == "aot_eager":
            from functorch.compile import make_boxed_func, min_cut_rematerialization_partition

            def compile_graph(graph_module, _inputs):
                self.run_passes(graph_module.graph)
                graph_module.recompile()
                return make_boxed_func(graph_module.forward)

            return aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph,
                                partition_fn=min_cut_rematerialization_partition)(
                gm, example_inputs)
        patches = {"post_grad_custom_post_pass": _inductor_pass(self)}
        if self.bucketing == "auto":  # the pass is collective: every rank must run it
            patches["fx_graph_cache"] = False
        return compile_fx(gm, example_inputs, config_patches=patches)

    # -- the passes ---------------------------------------------------------------------
    def run_passes(self, graph: fx.Graph) -> GraphReport:
        """Bucket and reorder the collectives of one forward or backward graph in place."""
        started = time.perf_counter()
        backward = is_backward(graph)
        collectives = find_collectives(graph)
        report = GraphReport("backward" if backward else "forward", _count(collectives),
                             other_collectives=other_collectives(graph))
        if self.bucketing == "manual":
            plan = self.module_plan
            if plan is None:  # derived from this graph's own collectives
                plan = manual_wrap.default_plan(collectives, backward)
            assignment, unused = manual_wrap.assign(collectives, plan)
            if unused and not backward:
                report.notes.append(f"plan entries matching no collective: {unused}")
            assignment.update(manual_wrap.assign_all_reduces(collectives, assignment,
                                                             self.all_reduce_bucket_mb))
            buckets = bucket_collectives(graph, collectives, assignment)
            stable_topological_sort(graph)
        elif self.bucketing == "auto":
            comm = self.resolved_comm_model()
            plan = auto_wrap.plan(graph, collectives, comm, self.memory_limit_bytes,
                                  compute_cache=self._compute_cache,
                                  agreement=self._agreement)
            report.decisions = plan.decisions
            report.comm_model = comm.to_dict()
            report.estimated_exposed_s = plan.estimated_exposed_s
            report.notes.append(f"auto: {len(plan.steps)} steps -> {len(plan.buckets)} "
                                f"buckets; compute measured in {plan.profile_s:.2f} s")
            assignment = dict(plan.assignment)
            assignment.update(manual_wrap.assign_all_reduces(collectives, assignment,
                                                             self.all_reduce_bucket_mb))
            buckets = bucket_collectives(graph, collectives, assignment)
            stable_topological_sort(graph)
        else:
            buckets = [bucket_of_one(c, i) for i, c in enumerate(collectives)]
        if self.reordering:
            report.moves = reorder(graph, buckets, backward)
        graph.lint()
        report.buckets = [b.summary() for b in buckets]
        report.schedule = _schedule(graph, buckets)
        report.nodes_in_flight = _nodes_in_flight(graph, buckets)
        report.collectives_after = _count(find_collectives(graph))
        report.pass_seconds = time.perf_counter() - started
        self.reports.append(report)
        log.info("%s", report)
        return report

    def resolved_comm_model(self) -> cost.CommModel:
        """The comm model of this backend; without a process group at construction, the
        disk-cached calibration or the fabric defaults (nothing is timed mid-compile)."""
        if self.comm_model is None:
            self.comm_model = cost.get_comm_model(calibrate_on_miss=False)
        return self.comm_model


# The public name: a backend is built by calling it, and its keyword arguments are the
# constructor's (one list of parameters, documented once, on the class).
compile_backend = SimpleFSDPBackend


def _calibrated_comm_model() -> cost.CommModel | None:
    """``cost.get_comm_model()`` on the default group (disk cache, else calibrated
    and agreed by all ranks), or None without a process group.

    Called when the backend is built, in eager code on every rank: collectives issued
    from inside the compiler (where the passes run) hang on gloo, which is also why the
    pass agrees on its measurements through the store (``simplefsdp.agreement``).
    """
    if not dist.is_available() or not dist.is_initialized():
        return None
    _install_cpu_collectives()  # time the all-gather kernel the compiled graphs will use
    return cost.get_comm_model()


def _schedule(graph: fx.Graph, buckets) -> list[tuple[str, str, int]]:
    """The final order of collective starts and waits, e.g. ("all_gather", "layers.0", B)
    then ("wait all_gather", "layers.0", B)."""
    events = {}
    for b in buckets:
        events[b.start] = (b.kind, b.name, b.nbytes)
        events[b.wait] = (f"wait {b.kind}", b.name, b.nbytes)
    return [events[n] for n in graph.nodes if n in events]


def _nodes_in_flight(graph: fx.Graph, buckets) -> dict[str, int]:
    """Per bucket, how many computation nodes run between its start and its wait."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    comm = {n for b in buckets for n in (b.start, b.wait)}
    nodes = list(graph.nodes)
    return {f"{b.kind} {b.name}": sum(
        1 for n in nodes[position[b.start] + 1:position[b.wait]]
        if n not in comm and n.op == "call_function") for b in buckets}


def _count(collectives) -> dict[str, int]:
    return dict(sorted(Counter(c.kind for c in collectives).items()))


def _install_cpu_collectives() -> None:
    if dist.is_initialized() and uses_gloo():
        install_gloo_collectives()


@functools.cache
def _source_hash() -> str:
    """Our passes' source, so Inductor's cache never reuses a graph from older passes."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _inductor_pass(owner: SimpleFSDPBackend):
    """Our passes as Inductor's ``post_grad_custom_post_pass`` for ``owner``."""
    return _inductor_pass_class()(owner)


@functools.cache
def _inductor_pass_class() -> type:
    """Defined on first use: its base class lives in Inductor, which ``import
    simplefsdp`` should not load (about 2 s)."""

    class InductorPass(custom_graph_pass_base()):
        """Adapter: Inductor calls ``pass(graph)`` on each post-grad graph."""

        def __init__(self, owner: SimpleFSDPBackend):
            self.owner = owner

        def __call__(self, graph: fx.Graph) -> None:
            self.owner.run_passes(graph)

        def uuid(self) -> str | None:
            o = self.owner
            if o.bucketing == "auto":
                return None  # not cacheable: the pass measures and talks to the other ranks
            settings = (f"{o.bucketing}|{o.reordering}|{o.module_plan}|"
                        f"{o.memory_limit_gb}|{o.all_reduce_bucket_mb}")
            return _source_hash() + hashlib.sha256(settings.encode()).hexdigest()

    return InductorPass

