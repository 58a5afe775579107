"""Float8 training: linear layers compute in float8, and optionally gather float8 weights.

``convert_to_float8(model, recipe, all_gather, exclude)`` (call it before
``data_parallel``) turns each ``nn.Linear`` the globs do not exclude into a
:class:`Float8Linear`: the same module and parameters (the state dict is unchanged;
float8 is a compute and communication format), whose forward and both backward matmuls
run in float8 through ``torch._scaled_mm`` with dynamic scaling.

Our own ``torch._scaled_mm`` path rather than torchao's float8 training: torchao's weight
is a tensor subclass that FSDP2 gathers through its ``fsdp_pre_all_gather`` hooks, which
our DTensor parametrization does not call (``redistribute`` would drop the subclass and
gather high precision); one autograd function on plain tensors traces into our compiled
graphs as it is, runs on CPU, and needs no optional package.

Formats: weights and activations in ``float8_e4m3fn`` (more mantissa), gradients in
``float8_e5m2`` (more range), as torchao and Transformer Engine do by default. Scales are
``max_representable / amax`` of the tensor (``tensorwise``) or of each row along the
contraction dim (``rowwise``: each of the three matmuls casts its operands along its own
contraction dim, so the backward casts the high-precision weight again).

The float8 all-gather (``all_gather=True``, tensorwise only): ``data_parallel`` asks
:func:`float8_gather_for` for each parameter; for a converted weight its gather casts
the local shard to float8 with the scale of the *whole* weight (its amax all-reduced,
``max``, over the data-parallel group: one small all-reduce per weight, in the same step
as its gather, so the scale never goes stale and needs no call from the trainer), gathers
the float8 bytes as ``uint8`` (gloo refuses float8 tensors; NCCL takes the same view)
and hands the gathered float8 weight and its scale to the float8 matmul, with no upcast.
The gradient takes another path: a full-shape stand-in (:class:`_GradientPath`, no
memory) whose backward reduce-scatters the weight's gradient in the reduce dtype into
the shard's gradient, so gradients, optimizer and checkpoints stay high precision.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from . import eager_reshard
from ._torch_compat import c10d_functional
from ._torch_compat.float8 import has_scaled_mm, scaled_mm
from .mesh import ParallelDims, dim0_rows, pad_dim0
from .state_dict import unwrapped_name

RECIPES = ("tensorwise", "rowwise")
# The output head, MoE routers (our MoE's ``gate``, HF routers) stay high precision: the
# logits and routing decisions are sensitive to rounding. Norms are not nn.Linear.
DEFAULT_EXCLUDE = ("output", "lm_head", "*.gate", "*router*")
E4M3 = torch.float8_e4m3fn  # weights and activations
E5M2 = torch.float8_e5m2  # gradients
_AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale


# ---------------------------------------------------------------------------------------
# Scaling and the float8 matmul.
# ---------------------------------------------------------------------------------------
def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 factor that maps ``amax`` to the largest value of ``dtype``."""
    return torch.finfo(dtype).max / amax.float().clamp(min=_AMAX_FLOOR)


def to_float8(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t * scale`` saturated to ``dtype``'s range and rounded to it (elementwise, so
    a shard cast with the whole tensor's scale equals that slice of the whole cast)."""
    top = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-top, top).to(dtype)


def cast_tensorwise(t: torch.Tensor, dtype: torch.dtype, group: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast with one scale for the whole tensor; ``group``: ``t`` is this rank's piece of
    a tensor split over that process group (tensor parallelism), whose amax is agreed
    (all-reduced, ``max``) so every piece is cast as the whole tensor would be."""
    amax = _local_amax(t)
    if group is not None:
        amax = _all_reduce_max(amax, group)
    scale = scale_from_amax(amax, dtype)
    return to_float8(t, scale, dtype), scale


def cast_rowwise(t: torch.Tensor, dtype: torch.dtype, dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast with one scale per slice along ``dim`` (the contraction dim); the scale keeps
    ``dim`` as size 1."""
    scale = scale_from_amax(t.detach().abs().amax(dim=dim, keepdim=True), dtype)
    return to_float8(t, scale, dtype), scale


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _mm(a8: torch.Tensor, b8: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
        out_dtype: torch.dtype) -> torch.Tensor:
    """``(a8 / a_scale) @ (b8 / b_scale)``: ``a8`` row-major, ``b8`` column-major."""
    return scaled_mm(a8, b8, a_scale.reciprocal(), b_scale.reciprocal(), out_dtype)


class AmaxGroups(NamedTuple):
    """Tensor parallelism: the process group over which the tensorwise amax of ``x``,
    the weight and the output's gradient is agreed, for each one that is split over the
    TP ranks (None: whole on every rank, its local amax is the tensor's)."""

    x: str | None = None
    weight: str | None = None
    grad: str | None = None


_LOCAL = AmaxGroups()


class _Float8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with all three matmuls in float8. ``x``: (M, K); ``weight``: the
    (N, K) high-precision weight, or with ``w8`` given (the gathered float8 weight and
    its ``w_scale``) the gradient stand-in that receives ``dW``. ``groups``: under
    tensor parallelism, where each tensorwise amax is agreed (:class:`AmaxGroups`)."""

    @staticmethod
    def forward(ctx, x, weight, w8, w_scale, rowwise: bool, groups: AmaxGroups = _LOCAL):
        ctx.rowwise, ctx.x_dtype, ctx.w_dtype = rowwise, x.dtype, weight.dtype
        ctx.grad_group = groups.grad
        if rowwise:
            x8, xs = cast_rowwise(x, E4M3, dim=1)
            wr8, ws = cast_rowwise(weight, E4M3, dim=1)
            ctx.save_for_backward(x, weight)
            return _mm(x8, wr8.t(), xs, ws.t(), x.dtype)
        x8, xs = cast_tensorwise(x, E4M3, groups.x)
        if w8 is None:
            w8, w_scale = cast_tensorwise(weight, E4M3, groups.weight)
        ctx.save_for_backward(x8, xs, w8, w_scale)
        return _mm(x8, w8.t(), xs, w_scale, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.rowwise:
            return (*_rowwise_grads(ctx, grad), None, None, None, None)
        x8, xs, w8, ws = ctx.saved_tensors
        g8, gs = cast_tensorwise(grad, E5M2, ctx.grad_group)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # (M, N) @ (N, K)
            grad_x = _mm(g8, _column_major(w8), gs, ws, ctx.x_dtype)
        if ctx.needs_input_grad[1]:  # (N, M) @ (M, K)
            grad_w = _mm(g8.t().contiguous(), _column_major(x8), gs, xs, ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None


def _rowwise_grads(ctx, grad: torch.Tensor):
    """Rowwise backward: each operand cast along the contraction dim of its matmul."""
    x, weight = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:  # (M, N) @ (N, K): contract over N
        g8, gs = cast_rowwise(grad, E5M2, dim=1)
        w8, ws = cast_rowwise(weight, E4M3, dim=0)
        grad_x = _mm(g8, _column_major(w8), gs, ws, ctx.x_dtype)
    if ctx.needs_input_grad[1]:  # (N, M) @ (M, K): contract over M
        gt8, gts = cast_rowwise(grad.t(), E5M2, dim=1)
        x8, xs = cast_rowwise(x, E4M3, dim=0)
        grad_w = _mm(gt8.contiguous(), _column_major(x8), gts, xs, ctx.w_dtype)
    return grad_x, grad_w


class Float8Weight(NamedTuple):
    """A weight gathered in float8: ``data`` (the full float8 weight), ``scale`` (it holds
    ``weight * scale``), ``grad_path`` (full-shape stand-in that takes ``dW``)."""

    data: torch.Tensor
    scale: torch.Tensor
    grad_path: torch.Tensor


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in float8 (see the module docstring). Made by
    :func:`convert_to_float8` by changing an ``nn.Linear``'s class: same parameters,
    same state dict."""

    float8_recipe: str = "tensorwise"
    float8_all_gather: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        flat = x.reshape(-1, x.shape[-1])
        if isinstance(weight, DTensor):  # tensor parallelism: each rank its piece
            out = _tp_matmul(x, weight, self.float8_recipe)
            bias = self.bias
            return out if bias is None else out + bias.to(out.dtype)
        if isinstance(weight, Float8Weight):
            out = _Float8Matmul.apply(flat, weight.grad_path, weight.data, weight.scale, False)
        else:
            out = _Float8Matmul.apply(flat, weight, None, None,
                                      self.float8_recipe == "rowwise")
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        bias = self.bias  # read once: under data_parallel each read gathers
        return out if bias is None else out + bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, float8={self.float8_recipe}"
                f"{', float8_all_gather' if self.float8_all_gather else ''}")


def _tp_matmul(x: DTensor, weight: DTensor, recipe: str) -> DTensor:
    """A tensor-parallel float8 linear on this rank's pieces (``ColwiseParallel``: the
    weight split on its output rows, ``x`` whole; ``RowwiseParallel``: both split on
    the contraction dim), tensorwise. The amax of each operand that is split is agreed
    over the TP group, so every piece is cast exactly as one process casts the whole
    tensor: colwise, the weight and the output's gradient (split on the output
    columns); rowwise, the weight and ``x`` (the gradient arrives whole). Returns the
    output as a DTensor (colwise ``Shard(-1)``, rowwise ``Partial``: the parallel
    style's output hook redistributes it)."""
    if recipe != "tensorwise":
        raise ValueError(f"float8 recipe {recipe!r} with tensor parallelism: only "
                         f"'tensorwise' is built (one scale agreed over the TP group)")
    mesh, (placement,) = weight.device_mesh, weight.placements
    group = mesh.get_group().group_name
    colwise = placement == Shard(0) and tuple(x.placements) == (Replicate(),)
    rowwise = placement == Shard(1) and tuple(x.placements) in ((Shard(-1),),
                                                                (Shard(x.ndim - 1),))
    if not (colwise or rowwise):
        raise ValueError(f"a float8 Linear under tensor parallelism takes ColwiseParallel "
                         f"(weight Shard(0), input Replicate) or RowwiseParallel (weight "
                         f"Shard(1), input Shard(-1)); got weight {weight.placements} and "
                         f"input {x.placements}")
    if colwise:  # x whole: its gradient is this rank's partial sum
        local_x = x.to_local(grad_placements=(Partial(),))
        groups, out_placement = AmaxGroups(None, group, group), Shard(x.ndim - 1)
    else:
        local_x = x.to_local()
        groups, out_placement = AmaxGroups(group, group, None), Partial()
    flat = local_x.reshape(-1, local_x.shape[-1])
    out = _Float8Matmul.apply(flat, weight.to_local(), None, None, False, groups)
    out = out.reshape(*local_x.shape[:-1], out.shape[-1])
    return DTensor.from_local(out, mesh, (out_placement,), run_check=False)


# ---------------------------------------------------------------------------------------
# The float8 all-gather (data_parallel's gather hook).
# ---------------------------------------------------------------------------------------
class _GatherSpec(NamedTuple):
    """What a weight's float8 gather needs from its data-parallel mesh (1-D, ``Shard(0)``)."""

    group_name: str
    world: int
    rank: int
    rows: int  # the full weight's rows
    reduce_op: str  # "avg" or "sum"
    reduce_dtype: torch.dtype | None
    grad_dtype: torch.dtype  # the dtype dW is computed in (the gathered compute dtype)


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


def _local_amax(shard: torch.Tensor) -> torch.Tensor:
    local = shard.detach()
    return local.abs().max().float() if local.numel() else local.new_zeros((), dtype=torch.float32)


def _all_reduce_max(amax: torch.Tensor, group_name: str) -> torch.Tensor:
    return c10d_functional.wait_tensor(c10d_functional.all_reduce(amax, "max", group_name))


def gather_float8(shard: torch.Tensor, full_shape: torch.Size, spec: _GatherSpec,
                  scale: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gradient stand-in, gathered float8 weight, its scale) from this rank's shard
    (a plain tensor, differentiable). ``scale``: the one :func:`install_float8_scales`
    agreed at the start of this forward; None (a module called outside the model's
    forward, a recomputation after it): this weight's amax is all-reduced here."""
    if scale is None:
        scale = scale_from_amax(_all_reduce_max(_local_amax(shard), spec.group_name), E4M3)
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
    if gather.tp is not None or gather.hybrid or gather.replicated:
        raise ValueError("a Linear converted with float8 all_gather=True: the float8 "
                         "all-gather runs with mode='fully_shard' and no tensor "
                         "parallelism; convert with all_gather=False for other layouts")
    if gather.reshard_group is not None or gather.offload is not None:
        raise ValueError("a Linear converted with float8 all_gather=True: the float8 "
                         "all-gather is not built with an int reshard_after_forward or an "
                         "offload_policy; convert with all_gather=False, or pass "
                         "reshard_after_forward=True and no offload_policy")
    mesh = gather.dp_mesh
    gather.float8_scale = None

    def gather_fn(sharded) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        spec = _GatherSpec(mesh.get_group(0).group_name, mesh.size(), ParallelDims.local_rank(mesh),
                           sharded.shape[0], gather.reduce_op, gather.reduce_dtype,
                           gather.param_dtype or sharded.dtype)
        return gather_float8(sharded.to_local(), sharded.shape, spec, gather.float8_scale)

    return gather_fn


def float8_weight(gather, parts: tuple, sharded, to_sink: bool) -> Float8Weight:
    """What a float8-gathered weight's read returns (``data_parallel``): the gradient goes
    through the stand-in, routed as a gathered tensor's (gradient sync off: to the sink);
    in eager mode the float8 copy is freed after forward and gathered again for backward
    like any gathered copy."""
    grad_path, data, scale = parts
    grad_path = gather.route_gradient(grad_path, sharded, to_sink)
    if gather.reshard_after_forward and not torch.compiler.is_compiling():
        eager_reshard.note_gathered(data, sharded, lambda s: gather.regather(s)[1])
    return Float8Weight(data, scale, grad_path)


def _float8_gathers(model: nn.Module) -> list[tuple[object, torch.Tensor]]:
    """(gather, sharded weight) of every float8-gathered weight under ``model``, once each."""
    found, seen = [], set()
    for module in model.modules():
        for name, gather in getattr(module, "_sf_compute", {}).items():
            if getattr(gather, "float8_gather", None) is not None and id(gather) not in seen:
                seen.add(id(gather))
                found.append((gather, module._parameters[name]))
    return found


def install_float8_scales(model: nn.Module) -> None:
    """One amax all-reduce per forward for every float8-gathered weight (as torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``, but inside the forward, so it is in
    the compiled graph and never stale): a pre-hook on the data-parallel root all-reduces
    (``max``) the stacked local amaxes of the weights sharing a group and leaves each
    weight's scale on its gather; a post-hook forgets them. It sits at the top of the
    graph, so the all-gathers' float8 shards depend only on it and our bucketing can
    still hoist them."""
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
            scales = scale_from_amax(_all_reduce_max(amax, group_name), E4M3)
            for i, (gather, _) in enumerate(members):
                gather.float8_scale = scales[i]

    def forget_scales(module, args, output) -> None:
        for gather, _ in gathers:
            gather.float8_scale = None

    model.register_forward_pre_hook(agree_scales)
    model.register_forward_hook(forget_scales, always_call=True)


# ---------------------------------------------------------------------------------------
# Conversion.
# ---------------------------------------------------------------------------------------
def check_scaled_mm(device: torch.device | str = "cpu") -> str | None:
    """Why float8 matmuls cannot run on ``device`` (None when they can): this torch has
    no ``torch._scaled_mm``, or it refuses a tiny float8 matmul there (e.g. a GPU older
    than compute capability 8.9)."""
    if not has_scaled_mm():
        return f"torch {torch.__version__} has no _scaled_mm"
    try:
        a = torch.ones(16, 16, device=device).to(E4M3)
        one = torch.ones((), device=device)
        scaled_mm(a, a.t(), one, one, torch.bfloat16)
        scaled_mm(a.to(E5M2), a.t(), one, one, torch.bfloat16)
    except (RuntimeError, NotImplementedError) as err:
        return f"the float8 matmul (_scaled_mm) fails on {device}: {str(err).splitlines()[0]}"
    return None


def _tied_weights(model: nn.Module) -> set[int]:
    """ids of parameters that more than one module holds (tied embeddings and heads)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}


def convert_to_float8(model: nn.Module, recipe: str = "tensorwise", all_gather: bool = False,
                      exclude: Sequence[str] | None = None) -> nn.Module:
    """Make ``model``'s ``nn.Linear`` modules compute in float8; in place, before
    ``data_parallel``. ``exclude``: module FQN globs (``fnmatch``) left in high precision,
    default :data:`DEFAULT_EXCLUDE` (output head, routers). A weight tied to another
    module is left out too. ``all_gather``: gather the converted weights in float8
    (tensorwise only). Returns ``model``; ``model.float8_modules`` lists what changed."""
    if recipe not in RECIPES:
        raise ValueError(f"float8 recipe {recipe!r} is unknown; choose one of "
                         f"{', '.join(RECIPES)}")
    if all_gather and recipe != "tensorwise":
        raise ValueError(f"the float8 all-gather needs recipe='tensorwise' (one scale per "
                         f"weight); recipe={recipe!r} casts the weight along each matmul's "
                         f"contraction dim, so set all_gather=False")
    if getattr(model, "_sf_root", False):
        raise ValueError("convert_to_float8 must run before data_parallel")
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), "cpu")
    why = check_scaled_mm(device)
    if why is not None:
        raise RuntimeError(f"float8 training needs torch._scaled_mm: {why}")
    globs = list(DEFAULT_EXCLUDE if exclude is None else exclude)
    tied = _tied_weights(model)
    converted = []
    for name, module in model.named_modules():
        plain = unwrapped_name(name)
        if type(module) is not nn.Linear or id(module.weight) in tied \
                or any(fnmatch.fnmatchcase(plain, g) for g in globs):
            continue
        module.__class__ = Float8Linear
        module.float8_recipe, module.float8_all_gather = recipe, bool(all_gather)
        converted.append(plain)
    model.float8_modules = converted
    return model
