"""The ``torch.compile`` backend: AOTAutograd graphs -> our passes -> Inductor or eager.

``aot_eager``: our own forward/backward compilers run the passes and execute the graph
as is; the min-cut partitioner keeps the selective-checkpoint recompute (re-gather in
backward), which the default partitioner would drop.
``inductor``: the passes run as Inductor's post-grad custom pass on both graphs.

Every pass decision depends only on the sequence of collectives and module names, which
is the same on every rank, so every rank issues the same collectives in the same order.
``bucketing="auto"`` (and ``"greedy"``) also reads measured numbers (communication
model, compute times): the first rank decides and shares the decision through the
rendezvous store (inside a compiler pass only the store is safe, see
``simplefsdp.agreement``). A pass that talks to the other ranks cannot be served from
Inductor's graph caches (a rank that hit the cache would skip the exchange and hang the
others), so decisions are cached on disk (``plan_cache``): when every rank has them, the
pass talks to nobody and Inductor's caches stay on (a warm rerun).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch.distributed as dist
from torch import fx

from .._torch_compat import (
    aot_autograd,
    compile_caches_off,
    compile_fx,
    custom_graph_pass_base,
    custom_partitioner_base,
    resolve_process_group,
)
from ..agreement import StoreAgreement
from ..gloo_kernel import install_gloo_collectives, uses_gloo
from ..source_digest import source_digest
from . import auto_wrap, cost, manual_wrap, plan_cache, recompute
from .collectives import all_to_alls, find_collectives, is_backward, other_collectives
from .greedy import Decision
from .passes import apply_passes
from .simulate import Estimate

log = logging.getLogger("simplefsdp.compiler")
Backend = Literal["inductor", "aot_eager"]
Bucketing = Literal["none", "manual", "auto", "greedy"]
BACKENDS: tuple[str, ...] = get_args(Backend)  # the lists, derived from the types
BUCKETING: tuple[str, ...] = get_args(Bucketing)
PLANNED = ("auto", "greedy")  # bucketing values decided by auto_wrap


@dataclass
class GraphReport:
    """What our passes did to one graph."""

    graph: str  # "forward" or "backward"
    collectives_before: dict[str, int]
    collectives_after: dict[str, int] = field(default_factory=dict)
    other_collectives: int = 0  # not data-parallel (TP/SP, user): left in place
    all_to_alls: int = 0  # exchanges (expert dispatch, Ulysses): left in place
    buckets: list[dict] = field(default_factory=list)
    moves: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    schedule: list[tuple[str, str, int]] = field(default_factory=list)  # (event, bucket, B)
    # "kind bucket": computation nodes that run while the bucket's collective is in flight
    nodes_in_flight: dict[str, int] = field(default_factory=dict)
    pass_seconds: float = 0.0
    # bucketing="auto"/"greedy" only: the greedy's decision per candidate collective
    # after the first (its inputs: estimated comm, compute window, memory, the outcome),
    # the comm model used, the simulated step of both planners' buckets, the estimated
    # exposed communication and predicted peak of the buckets applied, and the limit.
    decisions: list[Decision] = field(default_factory=list)
    comm_model: dict | None = None
    estimates: dict[str, Estimate] = field(default_factory=dict)
    estimated_exposed_s: float | None = None
    predicted_peak_bytes: int | None = None  # the graph's + state_bytes_outside_graphs
    memory_limit_bytes: float | None = None
    outside_bytes: int = 0  # state_bytes_outside_graphs: held through the step

    def __str__(self) -> str:
        lines = [f"[simplefsdp] {self.graph}: collectives {self.collectives_before} -> "
                 f"{self.collectives_after}, {len(self.buckets)} buckets, "
                 f"{len(self.moves)} moves, {self.pass_seconds * 1e3:.1f} ms"]
        lines += [f"  bucket {b['kind']} {b['name']}: {b['count']} tensors, {b['bytes']} B"
                  for b in self.buckets if b["count"] > 1]
        lines += [f"  {m}" for m in self.moves] + [f"  note: {n}" for n in self.notes]
        if self.comm_model is not None:
            limit = "none" if self.memory_limit_bytes is None else \
                f"{self.memory_limit_bytes / 1e9:.4g} GB"
            graph = self.predicted_peak_bytes - self.outside_bytes
            lines.append(f"  auto: comm model {self.comm_model}, estimated exposed "
                         f"communication {self.estimated_exposed_s * 1e3:.3f} ms, predicted "
                         f"peak {self.predicted_peak_bytes / 1e9:.4g} GB (graph "
                         f"{graph / 1e9:.4g} + outside the graphs "
                         f"{self.outside_bytes / 1e9:.4g}; limit {limit})")
            lines += [f"  estimate {name}: {e}" for name, e in self.estimates.items()]
        lines += [f"  decision: {d}" for d in self.decisions]
        return "\n".join(lines)


# Share of the compiled graphs' memory budget (``memory_limit_gb`` less the state held
# outside them) that ``bucketing="auto"`` keeps free under Inductor. Our passes predict
# the peak on the FX graph in the order they leave it; Inductor then fuses and reorders
# it (``reorder_for_peak_memory``, by its own estimate, which does not know gloo's
# in-flight temporaries), so the executed order differs (measured: README, auto
# wrapping). aot_eager runs the FX order as it is: no margin.
INDUCTOR_SCHEDULE_MARGIN = 0.05


class SimpleFSDPBackend:
    """A backend for ``torch.compile(model, fullgraph=True, backend=...)`` that runs our
    bucketing and reordering passes on the forward and backward graphs; ``reports``
    holds one :class:`GraphReport` per compiled graph. Public as ``compile_backend``.

    ``backend``: "inductor" or "aot_eager". ``bucketing``: "none", "manual" (one bucket
    per entry of ``module_plan``; None: derived from the graph), "auto": the buckets of
    least simulated step time whose predicted step peak stays under ``memory_limit_gb``
    (decimal GB; None: no limit), or "greedy": the paper's Algorithm 1 instead (both are
    reported). The step's peak is the graph's (sharded parameters, activations,
    gathered and prefetched buckets, gradients in flight) plus
    ``state_bytes_outside_graphs``: bytes this rank holds through the step outside the
    compiled graphs, above all the optimizer state (``cost.optimizer_state_bytes``
    estimates it; the trainer passes it); the graphs get the limit less those bytes. The
    comm model is ``comm_model`` or, when None, one calibrated on the default process group when the
    backend is built (cached on disk, see ``cost.get_comm_model``; collective: build the
    backend on every rank; a fake group is never timed: the fabric table). Decisions are
    taken by the first rank of ``group`` (every rank that compiles the same model; None:
    all ranks; under pipeline parallelism, the ranks of one stage) and cached on disk
    (``plan_cache``) so that a rerun decides nothing and compiles warm. ``reordering``:
    prefetch all-gathers and defer reduce-scatter and all-reduce waits. ``mesh`` (auto,
    greedy; HSDP/TP): calibrate each mesh dimension's group (``cost.comm.get_comm_models``,
    collective) and plan each collective kind with the figures of the group it runs on
    (HSDP: all-gather and reduce-scatter on the shard group, all-reduce on the replicas).

    Only data-parallel collectives are bucketed and moved (those on the process groups
    ``data_parallel`` shards over); TP/SP, pipeline and user collectives stay as traced.
    With bucketing "manual", "auto" or "greedy", ``mode="replicate"`` gradient
    all-reduces are merged in backward order into buckets that close once they hold
    ``all_reduce_bucket_mb`` MB (DDP's rule, default 25), and each HSDP reduce-scatter
    bucket is followed by one all-reduce of its shards over the replicas.
    """

    def __init__(self, backend: str = "inductor", bucketing: str = "none",
                 reordering: bool = True, module_plan: Sequence | None = None,
                 memory_limit_gb: float | None = None,
                 comm_model: cost.CommModel | None = None,
                 group: dist.ProcessGroup | None = None,
                 all_reduce_bucket_mb: float = manual_wrap.DEFAULT_ALL_REDUCE_BUCKET_MB,
                 plan_cache: bool = True, state_bytes_outside_graphs: int = 0,
                 mesh=None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if bucketing not in BUCKETING:
            raise ValueError(f"bucketing must be one of {BUCKETING}, got {bucketing!r}")
        self.memory_limit_bytes = auto_wrap.check_memory_limit(memory_limit_gb)
        self.outside_bytes = auto_wrap.check_outside_bytes(state_bytes_outside_graphs,
                                                           self.memory_limit_bytes)
        # what the graphs may use: the step's limit less what lives outside them, and
        # under Inductor less the margin for its rescheduling (INDUCTOR_SCHEDULE_MARGIN)
        self.graph_budget_bytes = None if self.memory_limit_bytes is None else \
            (self.memory_limit_bytes - self.outside_bytes) * (
                1 - (INDUCTOR_SCHEDULE_MARGIN if backend == "inductor" else 0.0))
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
        # auto/greedy: the ranks compiling these graphs agree through the store
        planned = bucketing in PLANNED
        self._agreement = StoreAgreement.create(group) if planned else None
        self.reports: list[GraphReport] = []
        # auto/greedy: the comm model (given, or calibrated once here, through the cost
        # model's disk cache) and measured op times, shared by all graphs.
        self.comm_model = comm_model
        # mesh: one calibration per mesh dimension's group (HSDP: shard, replicate); each
        # collective kind is planned with the figures of the group it runs on.
        self.comm_models: dict[str, cost.CommModel] = {}
        if planned and comm_model is None and mesh is not None and dist.is_initialized():
            _install_cpu_collectives()
            self.comm_models = cost.comm.get_comm_models(mesh)
        if planned and comm_model is None:
            self.comm_model = next(iter(self.comm_models.values()), None) or \
                _calibrated_comm_model()
        self._compute_cache: dict = {}
        self.plan_cache = plan_cache


    # -- torch.compile entry point ------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs):
        _install_cpu_collectives()
        # this Dynamo graph's plan-cache key and decisions (when every rank has them)
        cached = self._look_up_plans(gm, example_inputs)
        if self.backend == "aot_eager":
            from functorch.compile import make_boxed_func

            def compile_graph(graph_module, _inputs):
                self.run_passes(graph_module.graph, cached)
                graph_module.recompile()
                return make_boxed_func(graph_module.forward)

            return aot_autograd(fw_compiler=compile_graph, bw_compiler=compile_graph,
                                partition_fn=recompute.partition)(
                gm, example_inputs)
        patches = {"post_grad_custom_post_pass": _inductor_pass(self, cached)}
        # min-cut with the saved values in the runtime's layout (full AC on CPU: the
        # recomputed attention's RNG state must not land among the opaque mesh objects)
        base = custom_partitioner_base()
        if base is not None:
            patches["custom_partitioner_fn"] = recompute.inductor_partitioner(base)
        if self.bucketing in PLANNED and cached[1] is None:
            patches["fx_graph_cache"] = False  # the pass talks: every rank must run it
        if uneven_dtensor_inputs(example_inputs):
            # AOTAutograd's cache keys a DTensor input by its global shape and placements,
            # not this rank's local shape: with uneven shards the ranks compile different
            # graphs under one key, and a rank on the same host may load another's (its
            # size check then fails at run time). Inductor's FX graph cache keys the
            # graph AOTAutograd made, whose inputs are the local tensors: it stays on.
            with compile_caches_off():
                return compile_fx(gm, example_inputs, config_patches=patches)
        return compile_fx(gm, example_inputs, config_patches=patches)

    def _look_up_plans(self, gm: fx.GraphModule, example_inputs
                       ) -> tuple[str | None, dict | None]:
        """This Dynamo graph's plan-cache key and cached decisions; the decisions only
        when every rank has them (one store round), else None: the pass decides live."""
        if self.bucketing not in PLANNED or not self.plan_cache:
            return None, None
        figures = {name: {k: v for k, v in m.to_dict().items() if k != "source"}
                   for name, m in [("", self.resolved_comm_model()),
                                   *sorted(self.comm_models.items())]}
        key = plan_cache.dynamo_key(gm, example_inputs, self.bucketing, self.reordering,
                                    self.graph_budget_bytes,
                                    figures,
                                    _world_size(), source_digest("compiler"), self.backend)
        found = plan_cache.load(key, _rank())
        if self._agreement is not None:
            missing = self._agreement.max([0.0 if found else 1.0])[0]
            found = found if missing == 0.0 else None
        return key, found

    # -- the passes ---------------------------------------------------------------------
    def run_passes(self, graph: fx.Graph,
                   cached: tuple[str | None, dict | None] = (None, None)) -> GraphReport:
        """Bucket and reorder the collectives of one forward or backward graph in place;
        ``cached``: the plan-cache key and decisions of its Dynamo graph (auto/greedy)."""
        started = time.perf_counter()
        backward = is_backward(graph)
        collectives = find_collectives(graph)
        report = GraphReport("backward" if backward else "forward", _count(collectives),
                             other_collectives=other_collectives(graph),
                             all_to_alls=len(all_to_alls(graph)))
        if self.bucketing == "manual":
            plan = self.module_plan
            if plan is None:  # derived from this graph's own collectives
                plan = manual_wrap.default_plan(collectives, backward)
            assignment, unused = manual_wrap.assign(collectives, plan)
            if unused and not backward:
                report.notes.append(f"plan entries matching no collective: {unused}")
        elif self.bucketing in PLANNED:
            plan = self._plan(graph, collectives, *cached)
            report.decisions = plan.decisions
            report.comm_model = self.comm_for(collectives).to_dict()
            report.estimates = plan.estimates
            report.estimated_exposed_s = plan.estimated_exposed_s
            chosen = plan.estimates.get(plan.method)
            report.outside_bytes = self.outside_bytes
            if self.graph_budget_bytes is not None and self.backend == "inductor":
                report.notes.append(
                    f"graphs planned under {self.graph_budget_bytes / 1e9:.4g} GB: the limit "
                    f"less the state outside them, less {INDUCTOR_SCHEDULE_MARGIN:.0%} for "
                    f"Inductor's rescheduling")
            graph_peak = plan.peak_bytes if plan.peak_bytes is not None else \
                (chosen.peak_bytes if chosen else 0)  # the bucketed, reordered graph's
            report.predicted_peak_bytes = graph_peak + self.outside_bytes
            report.memory_limit_bytes = self.memory_limit_bytes
            source = "plan cache" if plan.profile_s == 0.0 and plan.steps else \
                f"compute measured in {plan.profile_s:.2f} s"
            report.notes.append(f"{plan.method}: {len(plan.steps)} steps -> "
                                f"{len(plan.buckets)} buckets; {source}")
            if chosen and self.memory_limit_bytes and report.predicted_peak_bytes > \
                    self.memory_limit_bytes:
                report.notes.append(f"predicted peak {report.predicted_peak_bytes / 1e9:.4g} "
                                    f"GB is over memory_limit_gb even with one collective "
                                    f"per bucket")
            assignment = plan.assignment
        else:
            assignment = None  # no bucketing
        buckets, report.moves = apply_passes(graph, collectives, assignment, self.reordering,
                                             self.all_reduce_bucket_mb)
        graph.lint()
        report.buckets = [b.summary() for b in buckets]
        report.schedule = _schedule(graph, buckets)
        report.nodes_in_flight = _nodes_in_flight(graph, buckets)
        report.collectives_after = _count(find_collectives(graph))
        report.pass_seconds = time.perf_counter() - started
        self.reports.append(report)
        log.info("%s", report)
        return report

    def _plan(self, graph: fx.Graph, collectives, plans_key: str | None,
              plans: dict | None) -> auto_wrap.Plan:
        """Decide (or read from the plan cache) the buckets of one graph; store new
        decisions. With cached plans but none for this graph (Inductor's graph differs
        from the cached run's), the roofline decides: deterministic, no exchange."""
        comm = self.comm_for(collectives)
        gkey = plan_cache.graph_key(graph)
        cached = plans.get(gkey) if plans is not None else None
        warm = plans is not None
        plan = auto_wrap.plan(graph, collectives, comm, self.graph_budget_bytes,
                              measure=not warm, compute_cache=self._compute_cache,
                              agreement=None if warm else self._agreement,
                              method=self.bucketing, cached=cached,
                              reordering=self.reordering,
                              all_reduce_bucket_mb=self.all_reduce_bucket_mb)
        if cached is None and plan.decided is not None and plans_key is not None:
            plan_cache.store(plans_key, _rank(), gkey, plan.decided)
        return plan

    def comm_for(self, collectives) -> cost.CommModel:
        """The comm model for a graph's ``collectives``: each kind's figures from the
        calibration of the process group it runs on (``mesh``), where one was made for
        that group's layout; the backend's model otherwise."""
        comm = self.resolved_comm_model()
        for kind in cost.comm.COLLECTIVE_KINDS:
            c = next((c for c in collectives if c.kind == kind), None)
            if c is None or not self.comm_models:
                continue
            layout = cost.comm.group_layout(resolve_process_group(c.start.args[-1]))
            other = next((m for m in self.comm_models.values() if m.group == layout), None)
            if other is not None and other is not comm:
                comm = comm.with_kind_from(kind, other)
                comm = dataclasses.replace(comm, source=f"{comm.source}{list(layout)}")
        return comm

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


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


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


def uneven_dtensor_inputs(example_inputs) -> bool:
    """Whether a DTensor among ``example_inputs`` is split unevenly over the ranks: a
    sharded dim whose size the product of its mesh dims' sizes does not divide (the
    same answer on every rank: it reads global shapes only)."""
    from torch.distributed.tensor import DTensor, Shard

    from .._torch_compat import StridedShard

    for value in example_inputs:
        if not isinstance(value, DTensor):
            continue
        ways: dict[int, int] = {}
        for mesh_dim, placement in enumerate(value.placements):
            if isinstance(placement, (Shard, StridedShard)):
                ways[placement.dim] = ways.get(placement.dim, 1) * \
                    value.device_mesh.size(mesh_dim)
        if any(value.shape[dim] % n for dim, n in ways.items()):
            return True
    return False


def _inductor_pass(owner: SimpleFSDPBackend, cached: tuple[str | None, dict | None]):
    """Our passes as Inductor's ``post_grad_custom_post_pass`` for ``owner``; ``cached``:
    the plan-cache key and decisions of the Dynamo graph being compiled."""
    return _inductor_pass_class()(owner, cached)


@functools.cache
def _inductor_pass_class() -> type:
    """Defined on first use: its base class lives in Inductor, which ``import
    simplefsdp`` should not load (about 2 s)."""

    class InductorPass(custom_graph_pass_base()):
        """Adapter: Inductor calls ``pass(graph)`` on each post-grad graph."""

        def __init__(self, owner: SimpleFSDPBackend, cached: tuple[str | None, dict | None]):
            self.owner, self.cached = owner, cached

        def __call__(self, graph: fx.Graph) -> None:
            self.owner.run_passes(graph, self.cached)

        def uuid(self) -> str | None:
            o, found = self.owner, self.cached[1]
            if o.bucketing in PLANNED and found is None:
                return None  # not cacheable: the pass measures and talks to the other ranks
            plans = hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest() \
                if found else ""
            settings = (f"{o.bucketing}|{o.reordering}|{o.module_plan}|{o.graph_budget_bytes}"
                        f"|{o.all_reduce_bucket_mb}|{plans}")
            return source_digest("compiler") + hashlib.sha256(settings.encode()).hexdigest()

    return InductorPass

