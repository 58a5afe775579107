"""`data_parallel`: FSDP / DDP / HSDP from three PyTorch primitives.

1. Every parameter is stored as a DTensor shard (``Shard(0)`` on the data-parallel mesh).
2. Reading the parameter inside forward runs a *parametrization*: ``redistribute`` to
   ``Replicate`` (an all-gather) and ``to_local`` with ``Partial`` gradient placements,
   so autograd turns the gradient into a reduce-scatter (``fully_shard``), an
   all-reduce (``replicate``) or both (``hybrid_shard``).
3. That read runs under selective activation checkpointing that recomputes only the
   all-gather and its wait: the gathered copy is freed after forward and gathered again
   in backward.

Nothing else is special, so eager mode stays debuggable and ``torch.compile`` sees one
graph that holds computation and communication.

The parametrization is a property on a per-class subclass (not ``nn.utils.parametrize``)
so that ``state_dict`` keeps the original names. Outside forward the property returns
the sharded DTensor itself: ``print(model)`` or ``model.w.weight`` never start a
collective on one rank only.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Mapping, Set
from contextlib import contextmanager
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.fx.traceback import annotate
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from . import eager_reshard
from ._torch_compat import (
    StridedShard,
    c10d_functional,
    replay_after_graph,
    root_mesh,
    slice_flattened,
)
from ._torch_compat.checkpoint import selective_checkpoint_contexts
from .checks import check_ignored, check_model
from .float8_gather import float8_gather_for, float8_weight, install_float8_scales
from .gloo_kernel import install_gloo_collectives, uses_gloo
from .gradient_sync import (
    GradientSyncControl,
    GradientToSink,
    ReduceOverReplicas,
    gradient_flows,
    set_requires_all_reduce,
    set_requires_gradient_sync,
)
from .mesh import DP_GROUPS_META, ParallelDims, dim0_chunk
from .mixed_precision import MixedPrecisionPolicy, check_overrides, install_casts, policy_for
from .module_swap import derived_class
from .offload import CPUOffloadPolicy, HostOffload, on_device
from .reshard_group import ReshardGroup, ReshardToGroupReads

Mode = Literal["fully_shard", "hybrid_shard", "replicate"]
MODES: tuple[str, ...] = get_args(Mode)  # the one list, derived from the type
_CLASS_PREFIX = "SimpleFSDP"


# ---------------------------------------------------------------------------------------
# When is the parametrization active?
# ---------------------------------------------------------------------------------------
_forward_depth = 0  # > 0 while a data_parallel root runs forward in eager mode
# > 0 while a compiled forward runs, for frames Dynamo leaves to eager inside it (a
# ``torch.compiler.disable`` function, a frame past the recompile limit), so that they
# gather as the graphs around them do: the traced hooks' updates
# (:func:`_count_compiled_forward`) are replayed after the graph holding them.
_compiled_forward_depth = 0
_parametrization_enabled = True


@contextmanager
def disable_active_parametrization() -> Iterator[None]:
    """Within this block parameters read as their sharded DTensors, even in forward.

    Use it for ``init_weights`` after meta-device init, or to inspect shards.
    """
    global _parametrization_enabled
    previous, _parametrization_enabled = _parametrization_enabled, False
    try:
        yield
    finally:
        _parametrization_enabled = previous


def _gather_on_read() -> bool:
    # Compiled code is only ever the model's forward, so it always gathers; testing that
    # first also keeps the eager counter out of the compiled graph's guards.
    return _parametrization_enabled and (torch.compiler.is_compiling() or _forward_depth > 0
                                         or _compiled_forward_depth > 0)


@replay_after_graph
def _count_compiled_forward(step: int) -> None:
    """Move ``_compiled_forward_depth`` by ``step``. Dynamo does not trace this call: it
    replays it after the graph that holds it (before the eager frame at a graph break).
    Traced, the update put the counter's value in the guards of every frame with hooks,
    and a block called at another depth (its recomputation, from backward) compiled
    again, which past the recompile limit ran eagerly and saved other tensors."""
    global _compiled_forward_depth
    _compiled_forward_depth += step


def _enter_forward(module: nn.Module, args: object) -> None:
    global _forward_depth
    if torch.compiler.is_compiling():
        _count_compiled_forward(1)
    else:
        if _forward_depth == 0:
            eager_reshard.start_forward()
        _forward_depth += 1


def _exit_forward(module: nn.Module, args: object, output: object) -> None:
    global _forward_depth
    if torch.compiler.is_compiling():
        _count_compiled_forward(-1)
    # An exit with no eager enter happens when compiling a forward fails: its pre-hook was
    # traced (no count), then the always_call post-hook runs eagerly on the error path.
    elif _forward_depth > 0:
        _forward_depth -= 1
        if _forward_depth == 0:
            eager_reshard.end_forward()


# ---------------------------------------------------------------------------------------
# The parametrization: gather on read, reduce on backward.
# ---------------------------------------------------------------------------------------
_GATHER_OPS = {
    c10d_functional.all_gather_into_tensor.default,
    c10d_functional.wait_tensor.default,
}


def _recompute_gathers(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Selective-checkpoint policy: recompute the all-gather and its wait, save the rest."""
    return CheckpointPolicy.MUST_RECOMPUTE if func in _GATHER_OPS else CheckpointPolicy.MUST_SAVE


def _gather_policy_contexts():
    # the gather's region decides for its ops inside a block's selective checkpoint too
    return selective_checkpoint_contexts(_recompute_gathers)


class _ReplicateComputation(GradientSyncControl, ReshardToGroupReads):
    """Turns a sharded DTensor parameter into the full tensor used by the computation.

    For a tensor-parallel parameter (``tp`` given as (TP mesh, TP placements, local TP
    shard shape)) only the data-parallel dims are gathered: the result is the TP shard,
    returned as a DTensor on the TP mesh, ready for the TP module's computation.
    ``hybrid_shard`` gathers over the shard dim only and reduces gradients as
    reduce-scatter (shard dim) then all-reduce of the shard (replicate dim).
    """

    def __init__(self, dp_mesh: DeviceMesh, dp_placements: tuple[Placement, ...],
                 reduce_op: str, mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool,
                 tp: tuple[DeviceMesh, tuple[Placement, ...], torch.Size] | None = None,
                 reshard_group: ReshardGroup | None = None, offload: HostOffload | None = None):
        self.hybrid = dp_mesh.ndim == 2  # (dp_replicate, dp_shard)
        # replicate (DDP): every rank of the 1-D mesh holds the whole parameter
        self.replicated = all(p.is_replicate() for p in dp_placements)
        self.replica_group = dp_mesh.get_group(0).group_name \
            if self.hybrid or self.replicated else None
        self.reduce_op = reduce_op
        self.dp_mesh = dp_mesh
        self.dp_placements = dp_placements
        self.compute_placements = (Replicate(),) * dp_mesh.ndim
        self.grad_placements = (Partial(reduce_op),) * dp_mesh.ndim
        if self.hybrid:  # replicas: reduced by ReduceOverReplicas, after the shard dim
            self.grad_placements = (Replicate(), Partial(reduce_op))
        elif self.replicated:  # all-reduced by ReduceOverReplicas, inside the gather's
            self.grad_placements = (Replicate(),)  # annotation (DP_GROUPS_META)
        self.param_dtype = mp_policy.param_dtype
        self.reduce_dtype = mp_policy.reduce_dtype
        self.reshard_after_forward = reshard_after_forward
        self.tp = tp
        self.float8_gather = None  # set by data_parallel for a float8-gathered weight
        self.reshard_group, self.offload = reshard_group, offload  # int reshard, CPU offload
        self.annotation = {DP_GROUPS_META: ReshardGroup.names(dp_mesh, reshard_group)}
        self.init_sync()

    def _gather(self, sharded: DTensor, replica_step=None) -> torch.Tensor:
        """The gathered (local, for TP: the TP shard) tensor; differentiable. Its
        collectives (and under compile their gradients' reductions) carry the
        data-parallel groups in their node metadata (``DP_GROUPS_META``).
        ``replica_step`` (see :meth:`GradientSyncControl.replica_step`) says what happens
        to the gradient over the replica group."""
        with annotate(self.annotation):
            return self._gather_local(sharded, replica_step)

    def _gather_local(self, sharded: DTensor, replica_step=None) -> torch.Tensor:
        if self.tp is not None:  # view our piece as a DTensor on the DP mesh alone
            shape = self.tp[2]
            sharded = DTensor.from_local(sharded.to_local(), self.dp_mesh, self.dp_placements,
                                         run_check=False, shape=shape,
                                         stride=_contiguous_stride(shape))
        if replica_step is not None:
            sink, pending = replica_step
            if sink is not None:  # all-reduce off: the shard's gradient goes to the sink
                sharded = GradientToSink.apply(sharded.detach(), sink)
            else:
                sharded = ReduceOverReplicas.apply(sharded, self.replica_group, self.reduce_op,
                                                    self.reduce_dtype, pending)
        if self.float8_gather is not None:  # (gradient path, float8 data, scale): float8.py
            return self.float8_gather(sharded)
        gathered = sharded.redistribute(
            placements=self.compute_placements,
            forward_dtype=self.param_dtype,
            backward_dtype=self.reduce_dtype,
        )
        return gathered.to_local(grad_placements=self.grad_placements)

    def _as_tp(self, local: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return local
        tp_mesh, tp_placements, _ = self.tp
        return DTensor.from_local(local, tp_mesh, tp_placements, run_check=False)

    def regather(self, sharded: DTensor) -> torch.Tensor:
        """The gathered value again, without autograd (eager backward)."""
        return self._gather(on_device(self.offload, sharded))

    def __call__(self, param: DTensor) -> torch.Tensor:
        sharded = on_device(self.offload, param)  # itself, or copied in from the host
        to_sink = not self.full_on and gradient_flows(sharded)
        source = sharded.detach() if to_sink else sharded
        if self.reshard_group is not None:
            return self.read_resharding_to_group(sharded, source, to_sink)
        replica_step = self.replica_step(sharded, to_sink)
        if self.reshard_after_forward and torch.compiler.is_compiling():
            # the partitioner recomputes the tagged gather. Only plain tensors cross the
            # checkpoint boundary: a DTensor output (TP) would make AOTAutograd save its
            # DeviceMesh under an enclosing activation checkpoint.
            local = checkpoint(self._gather, source, replica_step, use_reentrant=False,
                               context_fn=_gather_policy_contexts)
        else:
            local = self._gather(source, replica_step)
        if self.float8_gather is not None:  # (gradient path, float8 data, scale)
            return float8_weight(self, local, sharded, to_sink)
        local = self.route_gradient(local, sharded, to_sink)
        if self.reshard_after_forward and not torch.compiler.is_compiling():
            # eager: saved-tensor hooks re-gather it. Noted on the tensor the computation
            # uses: the note ends when that tensor dies (a view above keeps only storage)
            eager_reshard.note_gathered(local, param, self.regather)
        return self._as_tp(local)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _make_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        param = self._parameters[name]
        if param is None or not _gather_on_read():
            return param
        return self._sf_compute[name](param)

    return property(get)


def _parametrized_class(cls: type[nn.Module], names: tuple[str, ...]) -> type[nn.Module]:
    """A subclass of ``cls`` whose parameter names are gathering properties (one per
    class and names: ``module_swap.derived_class``)."""
    return derived_class(cls, _CLASS_PREFIX, key=names,
                         attrs={name: _make_property(name) for name in names})


# ---------------------------------------------------------------------------------------
# Sharding.
# ---------------------------------------------------------------------------------------
def _placements_for(mode: Mode) -> tuple[Placement, ...]:
    return {
        "fully_shard": (Shard(0),),
        "replicate": (Replicate(),),
        "hybrid_shard": (Replicate(), Shard(0)),
    }[mode]


def _check_mesh(mesh: DeviceMesh, mode: Mode) -> None:
    want = 2 if mode == "hybrid_shard" else 1
    if mesh.ndim != want:
        hint = ("build it with simplefsdp.make_mesh(dp_replicate=R, dp_shard=S) and pass the "
                "2-D ('dp_replicate', 'dp_shard') mesh" if want == 2 else
                "pass the 1-D data-parallel sub-mesh, e.g. mesh['dp_shard']")
        raise ValueError(f"mode={mode!r} needs a {want}-D mesh, got a {mesh.ndim}-D mesh "
                         f"{mesh.mesh_dim_names or ''}: {hint}")
    if dist.is_initialized() and mesh.size() > dist.get_world_size():
        raise ValueError(f"mesh has {mesh.size()} ranks but the world size is "
                         f"{dist.get_world_size()}")


def _shard_param(param: nn.Parameter, fqn: str, mesh: DeviceMesh,
                 placements: tuple[Placement, ...], given: DeviceMesh | None = None):
    """Return (sharded parameter, TP info for the gather or None)."""
    if param.dim() == 0 and any(isinstance(p, Shard) for p in placements):
        raise ValueError(f"parameter {fqn!r} is a 0-dim scalar and cannot be sharded on dim 0; "
                         f"give it shape (1,) or use mode='replicate'")
    if isinstance(param, DTensor):
        new, tp = _add_dp_dims(param, fqn, mesh, placements, given or mesh)
    else:
        # Rank 0's values win so every rank starts from the same model; a meta tensor has
        # no values, so each rank just takes its own (meta) shard.
        src = None if param.device.type == "meta" else 0
        new, tp = distribute_tensor(param.detach(), mesh, placements, src_data_rank=src), None
    return nn.Parameter(new, requires_grad=param.requires_grad), tp


def _add_dp_dims(param: DTensor, fqn: str, mesh: DeviceMesh, placements: tuple[Placement, ...],
                 given: DeviceMesh):
    """A tensor-parallel parameter becomes one DTensor on the (DP..., TP) mesh, sliced
    from ``given`` (the mesh passed to ``data_parallel``) when it names every dim."""
    tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
    wanted = set(mesh.mesh_dim_names or ()) | set(tp_mesh.mesh_dim_names or ())
    root = given if wanted <= set(given.mesh_dim_names or ()) else root_mesh(mesh)
    # Same ranks under the same names, not the same root object: torch caches sub-meshes
    # by layout, so a slice of a second mesh may report an earlier mesh as its root.
    names = tuple(tp_mesh.mesh_dim_names or ())
    if (not mesh.mesh_dim_names or not names
            or not set(names) <= set(root.mesh_dim_names or ())
            or root[names].mesh.tolist() != tp_mesh.mesh.tolist()):
        raise ValueError(f"parameter {fqn!r} is a DTensor on a mesh unrelated to the "
                         f"data-parallel mesh; slice both from one mesh, e.g. "
                         f"simplefsdp.make_mesh(dp_shard=.., tp=..)")
    full_mesh = slice_flattened(root, tuple(mesh.mesh_dim_names) + tuple(tp_mesh.mesh_dim_names))
    tp_local = param.to_local().detach()
    local, dp_placements = tp_local, []
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard):  # shard the TP shard again, on dim 0
            local = dim0_chunk(local, mesh.size(dim), ParallelDims.local_rank(mesh, dim))
            # DP slices *within* the pieces the param's own mesh cuts dim 0 into: DTensor
            # calls that a strided shard, its factor the number of those pieces.
            pieces = 1
            for i, p in enumerate(tp_placements):
                if isinstance(p, Shard) and p.dim == 0:
                    pieces *= tp_mesh.size(i)
            placement = StridedShard(0, split_factor=pieces) if pieces > 1 else Shard(0)
        dp_placements.append(placement)
    new = DTensor.from_local(local.contiguous(), full_mesh, tuple(dp_placements) + tp_placements,
                             run_check=False, shape=param.shape, stride=param.stride())
    return new, (tp_mesh, tp_placements, tp_local.shape)


def data_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    mode: Mode = "fully_shard",
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int = True,
    reduce_op: Literal["avg", "sum"] = "avg",
    mp_overrides: Mapping[str, MixedPrecisionPolicy] | None = None,
    ignored_params: Set[nn.Parameter] | None = None,
    offload_policy: CPUOffloadPolicy | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters over ``mesh`` and gather them on use; in place.

    A submodule sharded by an earlier ``data_parallel`` call keeps its own mesh and
    placements (MoE experts on their expert-parallel mesh, ``parallel/expert.py``).

    Args:
        model: the module; its parameters may be on ``meta`` (then call ``to_empty`` and
            initialize under :func:`disable_active_parametrization`).
        mesh: 1-D data-parallel mesh for ``fully_shard``/``replicate``; 2-D
            ``(dp_replicate, dp_shard)`` mesh for ``hybrid_shard``.
        mode: ``fully_shard`` (ZeRO-3), ``replicate`` (DDP) or ``hybrid_shard`` (HSDP).
        mp_policy: dtypes for the gathered parameters and for gradient reduction.
        reshard_after_forward: free gathered parameters after forward and gather them
            again in backward (True), keep them (False), or (an int ``N``) keep them
            sharded over groups of ``N`` neighbouring ranks (``reshard_group.py``).
        reduce_op: ``avg`` averages gradients over the data-parallel ranks; ``sum`` sums
            them (for losses already normalized by the global token count).
        mp_overrides: ``{module FQN glob: policy}`` (``fnmatch``, on the model's own names,
            wrappers such as activation checkpointing left out): the parameters of a
            matching module and of its submodules are gathered and computed in that
            policy's ``param_dtype`` and their gradients reduced in its
            ``reduce_dtype`` (the deepest matching module wins). A matching module casts
            its floating-point inputs to its ``param_dtype`` and its floating-point outputs
            to the enclosing policy's ``param_dtype`` (None: the parameters' own dtype),
            so an fp32 module (a router, a norm) sits inside a bf16 model. Bucketing
            never merges collectives of different dtypes. A glob that matches no module
            raises.
        ignored_params: parameters left alone (FSDP2's ``ignored_params``): they stay
            plain parameters, are never gathered, and their gradients are never reduced
            (each rank keeps its own); each must be a parameter of ``model``.
        offload_policy: ``CPUOffloadPolicy()``: shards, gradients and optimizer state on
            the host, copied to the (non-CPU) mesh's device on each read (``offload.py``).

    Frozen parameters (``requires_grad=False``, e.g. a LoRA base) are sharded and
    gathered for compute like the others, but get no gradient and so no reduce-scatter
    or all-reduce, in eager and compiled graphs.
    Returns:
        ``model`` itself, with its parameters sharded.

    Process-wide effect on gloo: when ``mesh`` runs CPU collectives on gloo, this
    registers simplefsdp's CPU kernel for ``_c10d_functional.all_gather_into_tensor``
    for the whole process (:mod:`simplefsdp.gloo_kernel`). Torch's own kernel takes
    gloo's *coalesced* all-gather, which was seen to abort the process with several
    all-gathers in flight, and prefetching keeps several in flight on purpose; the
    replacement takes the plain all-gather (same results). CUDA/NCCL and other backends
    keep torch's kernel; ``simplefsdp.gloo_kernel.uninstall_gloo_collectives`` undoes it.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if reduce_op not in ("avg", "sum"):
        raise ValueError(f"reduce_op must be 'avg' or 'sum', got {reduce_op!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"data_parallel expects an nn.Module, got {type(model).__name__}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError("mp_policy must be a simplefsdp.MixedPrecisionPolicy")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh (see simplefsdp.make_mesh), "
                        f"got {type(mesh).__name__}")
    given, mesh = mesh, ParallelDims.data_parallel_mesh(mesh, mode)
    _check_mesh(mesh, mode)
    check_model(model, mesh)  # not wrapped already; the same parameters on every rank
    if uses_gloo(mesh):  # gloo's coalesced all-gather path is unsafe with several in flight
        install_gloo_collectives()
    if getattr(model, "_sf_root", False):
        raise ValueError("data_parallel was already applied to this model; apply it once "
                         "(a submodule may be sharded first, on its own mesh)")
    ignored = check_ignored(model, ignored_params)
    reshard_group = ReshardGroup.for_model(model, mesh, mode, reshard_after_forward, ignored)
    offload = None if offload_policy is None else HostOffload.build(offload_policy, mesh)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    overrides = check_overrides(model, mp_overrides)
    placements = _placements_for(mode)

    sharded: dict[int, tuple[nn.Parameter, _ReplicateComputation]] = {}  # tied weights
    for module_name, module in list(model.named_modules()):
        names = tuple(n for n, p in module._parameters.items()
                      if p is not None and id(p) not in ignored)
        if not names or _sharded_already(module):  # a submodule sharded on its own mesh
            continue
        compute: dict[str, _ReplicateComputation] = {}
        for name in names:
            param = module._parameters[name]
            if id(param) not in sharded:
                fqn = f"{module_name}.{name}" if module_name else name
                new, tp = _shard_param(param, fqn, mesh, placements, given)
                new = new if offload is None else offload.place_on_host(new)
                policy = policy_for(module_name, overrides, mp_policy)
                gather = _ReplicateComputation(mesh, placements, reduce_op, policy,
                                               bool(reshard_after_forward), tp, reshard_group,
                                               offload)
                gather.float8_gather = float8_gather_for(module, name, gather)
                sharded[id(param)] = (new, gather)
            new, gather = sharded[id(param)]
            module._parameters[name] = new
            compute[name] = gather
        module._sf_compute = compute
        module.__class__ = _parametrized_class(type(module), names)
        _mark_forward(module)
    _mark_forward(model)
    model._sf_root = True
    model.set_requires_gradient_sync = types.MethodType(set_requires_gradient_sync, model)
    model.set_requires_all_reduce = types.MethodType(set_requires_all_reduce, model)
    install_casts(model, overrides, mp_policy)
    install_float8_scales(model)  # float8-gathered weights: one amax all-reduce per forward
    return model


def _sharded_already(module: nn.Module) -> bool:
    """Whether an earlier ``data_parallel`` call (on a submodule, e.g. MoE experts on
    their expert-parallel mesh) sharded this module's parameters: they keep that mesh."""
    return type(module).__name__.startswith(_CLASS_PREFIX) and hasattr(module, "_sf_compute")


def _mark_forward(module: nn.Module) -> None:
    """Parameters gather only while a forward runs: on the root, and on each module that
    owns parameters (activation-checkpoint recompute re-runs a block on its own)."""
    if getattr(module, "_sf_forward_hooks", False):
        return
    module._sf_forward_hooks = True
    module.register_forward_pre_hook(_enter_forward)
    module.register_forward_hook(_exit_forward, always_call=True)
