"""The float8 all-gather (``float8.convert_to_float8(..., all_gather=True)``, tensorwise
only): ``data_parallel`` asks :func:`float8_gather_for` for each parameter; for a
converted weight its gather casts the local shard to float8 with the scale of the
*whole* weight (its amax all-reduced,
``max``, over the data-parallel group: one small all-reduce per weight, in the same step
as its gather, so the scale never goes stale and needs no call from the trainer), gathers
the float8 bytes as ``uint8`` (gloo refuses float8 tensors; NCCL takes the same view)
and hands the gathered float8 weight and its scale to the float8 matmul, with no upcast.
Under tensor parallelism the same: the amax is agreed over the TP group as well (every
rank holding a piece of the weight), each rank casts its shard, the gather over the
data-parallel dims gives this rank's TP piece in float8, and that piece goes to the TP
float8 matmul (:func:`simplefsdp.float8._tp_matmul`) with the whole weight's scale.
The gradient takes another path: a full-shape stand-in (:class:`_GradientPath`, no
memory) whose backward reduce-scatters the weight's gradient in the reduce dtype into
the shard's gradient, so gradients, optimizer and checkpoints stay high precision.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from . import eager_reshard
from ._torch_compat import c10d_functional
from .float8 import (
    E4M3,
    Float8Linear,
    Float8Weight,
    _all_reduce_max,
    _local_amax,
    scale_from_amax,
    to_float8,
)
from .mesh import ParallelDims, dim0_rows, pad_dim0


class _GatherSpec(NamedTuple):
    """What a weight's float8 gather needs from its data-parallel mesh (1-D, ``Shard(0)``)."""

    group_name: str
    world: int
    rank: int
    rows: int  # the full weight's rows
    reduce_op: str  # "avg" or "sum"
    reduce_dtype: torch.dtype | None
    grad_dtype: torch.dtype  # the dtype dW is computed in (the gathered compute dtype)
    tp_group: str | None = None  # tensor parallelism: the TP group (its amax agreed there too)


def _shard_rows(spec: _GatherSpec) -> tuple[int, int]:
    """(rows this rank holds, rows of every padded piece): ``Shard(0)``'s ``torch.chunk``
    split (:func:`mesh.dim0_rows`; piece 0 is a full one)."""
    start, stop = dim0_rows(spec.rows, spec.world, spec.rank)
    return stop - start, -(-spec.rows // spec.world)


class _GradientPath(torch.autograd.Function):
    """Forward: a full-shape stand-in for the weight that costs no memory (an expanded
    zero). Backward: its gradient (``dW``, the full weight's) cast to the reduce dtype and
    reduce-scattered over the data-parallel group into the local shard's gradient."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, full_shape: torch.Size, spec: _GatherSpec):
        ctx.spec, ctx.shard_dtype = spec, shard.dtype
        return torch.zeros((), dtype=spec.grad_dtype, device=shard.device).expand(full_shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        mine, chunk = _shard_rows(spec)
        grad = pad_dim0(grad.to(spec.reduce_dtype or grad.dtype).contiguous(),
                         chunk * spec.world)
        # gloo has no "avg": sum, then divide (what an average over the group is)
        out = c10d_functional.reduce_scatter_tensor(grad, "sum", spec.world, spec.group_name)
        out = c10d_functional.wait_tensor(out)
        if spec.reduce_op == "avg":
            out = out / spec.world
        return out[:mine].to(ctx.shard_dtype), None, None


def _weight_amax(shard: torch.Tensor, spec: _GatherSpec) -> torch.Tensor:
    """The amax of the whole weight from this rank's shard: the max over the
    data-parallel group and, under tensor parallelism, over the TP group too (every
    rank holding a piece of the weight)."""
    amax = _all_reduce_max(_local_amax(shard), spec.group_name)
    return amax if spec.tp_group is None else _all_reduce_max(amax, spec.tp_group)


def gather_float8(shard: torch.Tensor, full_shape: torch.Size, spec: _GatherSpec,
                  scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gradient stand-in, gathered float8 weight, its scale) from this rank's shard
    (a plain tensor, differentiable). ``scale``: the one :func:`install_float8_scales`
    agreed at the start of this forward; None (a module called outside the model's
    forward, a recomputation after it): this weight's amax is all-reduced here."""
    if scale is None:
        scale = scale_from_amax(_weight_amax(shard, spec), E4M3)
    mine, chunk = _shard_rows(spec)
    bytes8 = pad_dim0(to_float8(shard.detach(), scale, E4M3).view(torch.uint8), chunk)
    gathered = c10d_functional.wait_tensor(
        c10d_functional.all_gather_into_tensor(bytes8.contiguous(), spec.world, spec.group_name))
    data = gathered[:spec.rows].view(E4M3)
    return _GradientPath.apply(shard, full_shape, spec), data, scale


def float8_gather_for(module: nn.Module, name: str, gather) -> object | None:
    """``data_parallel``'s hook: for the weight of a :class:`Float8Linear` converted with
    ``all_gather=True``, the function its gather calls with the sharded DTensor (giving
    ``gather_float8``'s triple); None for every other parameter. ``gather`` is the
    parameter's ``_ReplicateComputation`` (mesh, placements, dtypes); its
    ``float8_scale`` holds the scale agreed for the current forward."""
    if not (isinstance(module, Float8Linear) and module.float8_all_gather and name == "weight"):
        return None
    if gather.hybrid or gather.replicated:
        raise ValueError("a Linear converted with float8 all_gather=True: the float8 "
                         "all-gather runs with mode='fully_shard'; convert with "
                         "all_gather=False for other layouts")
    if gather.reshard_group is not None or gather.offload is not None:
        raise ValueError("a Linear converted with float8 all_gather=True: the float8 "
                         "all-gather is not built with an int reshard_after_forward or an "
                         "offload_policy; convert with all_gather=False, or pass "
                         "reshard_after_forward=True and no offload_policy")
    mesh, tp_group = gather.dp_mesh, _tp_group(gather)
    gather.float8_scale = gather.float8_scale_of = None

    def gather_fn(sharded) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # under TP ``sharded`` is the DP view of this rank's TP piece: the gather over the
        # data-parallel dims gives the TP piece, in float8
        spec = _GatherSpec(mesh.get_group(0).group_name, mesh.size(), ParallelDims.local_rank(mesh),
                           sharded.shape[0], gather.reduce_op, gather.reduce_dtype,
                           gather.param_dtype or sharded.dtype, tp_group)
        fresh = gather.float8_scale_of == _shard_version(sharded)
        return gather_float8(sharded.to_local(), sharded.shape, spec,
                             gather.float8_scale if fresh else None)

    return gather_fn


def _tp_group(gather) -> str | None:
    """The TP group name of a tensor-parallel weight's gather (None without TP)."""
    if gather.tp is None:
        return None
    tp_mesh = gather.tp[0]
    if tp_mesh.ndim != 1:
        raise ValueError(f"the float8 all-gather takes a 1-D TP mesh, got {tp_mesh.ndim}-D "
                         f"{tp_mesh.mesh_dim_names}; convert with all_gather=False")
    return tp_mesh.get_group().group_name


def float8_weight(gather, parts: tuple, sharded, to_sink: bool) -> Float8Weight:
    """What a float8-gathered weight's read returns (``data_parallel``): the gradient goes
    through the stand-in, routed as a gathered tensor's (gradient sync off: to the sink);
    in eager mode the float8 copy is freed after forward and gathered again for backward
    like any gathered copy."""
    grad_path, data, scale = parts
    grad_path = gather.route_gradient(grad_path, sharded, to_sink)
    if gather.reshard_after_forward and not torch.compiler.is_compiling():
        eager_reshard.note_gathered(data, sharded, lambda s: gather.regather(s)[1])
    tp = None if gather.tp is None else gather.tp[:2]  # (TP mesh, TP placements)
    return Float8Weight(data, scale, grad_path, tp)


def _float8_gathers(model: nn.Module) -> list[tuple[object, torch.Tensor]]:
    """(gather, sharded weight) of every float8-gathered weight under ``model``, once each."""
    found, seen = [], set()
    for module in model.modules():
        for name, gather in getattr(module, "_sf_compute", {}).items():
            if getattr(gather, "float8_gather", None) is not None and id(gather) not in seen:
                seen.add(id(gather))
                found.append((gather, module._parameters[name]))
    return found


def _agree_over_tp(amax: torch.Tensor, tp_groups: list[str | None]) -> torch.Tensor:
    """Tensor parallelism: the entries of the stacked ``amax`` (already agreed over the
    data-parallel group) whose weights are split over a TP group are agreed over it
    too, one all-reduce per TP group for all its weights."""
    for group in dict.fromkeys(g for g in tp_groups if g is not None):
        rows = [i for i, g in enumerate(tp_groups) if g == group]
        if len(rows) == len(tp_groups):
            return _all_reduce_max(amax, group)
        index = torch.tensor(rows, device=amax.device)
        amax = amax.index_copy(0, index, _all_reduce_max(amax[index], group))
    return amax


def _shard_version(sharded) -> int | None:
    """The version of the sharded parameter (the DTensor's own counter, bumped by every
    in-place update, the optimizer step's too; its ``to_local()`` view's is not); None
    while compiling, where the scale is always the graph's own."""
    return None if torch.compiler.is_compiling() else sharded._version


def install_float8_scales(model: nn.Module) -> None:
    """One amax all-reduce per forward for every float8-gathered weight (as torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``, but inside the forward, so it is in
    the compiled graph and never stale): a pre-hook on the data-parallel root all-reduces
    (``max``) the stacked local amaxes of the weights sharing a group and leaves each
    weight's scale on its gather, with the version of the shard it was taken from. It
    sits at the top of the graph, so the all-gathers' float8 shards depend only on it
    and our bucketing can still hoist them.

    Eager, the scale stays after the forward for as long as its shard is unchanged: a
    backward's re-gather and a selective-AC recomputation must cast with the scale the
    forward used, without new amax ops or all-reduces (selective AC replays a block's
    kept ops by count: one op more than the forward stored fails the backward). A read
    after the optimizer step finds another version and agrees its own scale. Compiled,
    the graph recomputes inside itself; a post-hook forgets the scales there."""
    gathers = _float8_gathers(model)
    if not gathers:
        return

    def agree_scales(module, args) -> None:
        by_group: dict[str, list] = {}
        for gather, sharded in gathers:
            by_group.setdefault(gather.dp_mesh.get_group(0).group_name, []).append(
                (gather, sharded))
        for group_name, members in by_group.items():
            amax = torch.stack([_local_amax(s.to_local()) for _, s in members])
            amax = _agree_over_tp(_all_reduce_max(amax, group_name),
                                  [_tp_group(gather) for gather, _ in members])
            scales = scale_from_amax(amax, E4M3)
            for i, (gather, sharded) in enumerate(members):
                gather.float8_scale = scales[i]
                gather.float8_scale_of = _shard_version(sharded)

    def forget_scales(module, args, output) -> None:
        if not torch.compiler.is_compiling():
            return  # eager: kept while the shard is unchanged (see above)
        for gather, _ in gathers:
            gather.float8_scale = gather.float8_scale_of = None

    model.register_forward_pre_hook(agree_scales)
    model.register_forward_hook(forget_scales, always_call=True)


# ---------------------------------------------------------------------------------------
# Conversion.
# ---------------------------------------------------------------------------------------
