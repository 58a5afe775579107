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

The float8 all-gather (``all_gather=True``, tensorwise only): :mod:`simplefsdp.float8_gather`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ._torch_compat import c10d_functional
from ._torch_compat.float8 import has_scaled_mm, scaled_mm
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


def _local_amax(shard: torch.Tensor) -> torch.Tensor:
    local = shard.detach()
    return local.abs().max().float() if local.numel() else local.new_zeros((), dtype=torch.float32)


def _all_reduce_max(amax: torch.Tensor, group_name: str) -> torch.Tensor:
    return c10d_functional.wait_tensor(c10d_functional.all_reduce(amax, "max", group_name))


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
    """A weight gathered in float8: ``data`` (the full float8 weight; under tensor
    parallelism this rank's TP piece of it), ``scale`` (it holds ``weight * scale``: one
    scale for the whole weight), ``grad_path`` (a stand-in of ``data``'s shape that takes
    ``dW``), ``tp`` (tensor parallelism: the TP mesh and the weight's TP placement)."""

    data: torch.Tensor
    scale: torch.Tensor
    grad_path: torch.Tensor
    tp: tuple | None = None


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in float8 (see the module docstring). Made by
    :func:`convert_to_float8` by changing an ``nn.Linear``'s class: same parameters,
    same state dict."""

    float8_recipe: str = "tensorwise"
    float8_all_gather: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        flat = x.reshape(-1, x.shape[-1])
        tp_piece = isinstance(weight, Float8Weight) and weight.tp is not None
        if isinstance(weight, DTensor) or tp_piece:  # tensor parallelism: each rank its piece
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


def _tp_matmul(x: DTensor, weight: DTensor | Float8Weight, recipe: str) -> DTensor:
    """A tensor-parallel float8 linear on this rank's pieces (``ColwiseParallel``: the
    weight split on its output rows, ``x`` whole; ``RowwiseParallel``: both split on
    the contraction dim), tensorwise. The amax of each operand that is split is agreed
    over the TP group, so every piece is cast exactly as one process casts the whole
    tensor: colwise, the weight and the output's gradient (split on the output
    columns); rowwise, the weight and ``x`` (the gradient arrives whole). ``weight``: the
    high-precision TP piece (a DTensor), or the TP piece gathered in float8 with the
    whole weight's scale (:class:`Float8Weight`), used as it is. Returns the output as a
    DTensor (colwise ``Shard(-1)``, rowwise ``Partial``: the parallel style's output
    hook redistributes it)."""
    if recipe != "tensorwise":
        raise ValueError(f"float8 recipe {recipe!r} with tensor parallelism: only "
                         f"'tensorwise' is built (one scale agreed over the TP group)")
    if isinstance(weight, Float8Weight):
        (mesh, (placement,)), local_w = weight.tp, weight.grad_path
        w8, w_scale = weight.data, weight.scale
    else:
        mesh, (placement,) = weight.device_mesh, weight.placements
        local_w, w8, w_scale = weight.to_local(), None, None
    group = mesh.get_group().group_name
    colwise = placement == Shard(0) and tuple(x.placements) == (Replicate(),)
    rowwise = placement == Shard(1) and tuple(x.placements) in ((Shard(-1),),
                                                                (Shard(x.ndim - 1),))
    if not (colwise or rowwise):
        raise ValueError(f"a float8 Linear under tensor parallelism takes ColwiseParallel "
                         f"(weight Shard(0), input Replicate) or RowwiseParallel (weight "
                         f"Shard(1), input Shard(-1)); got weight ({placement},) and "
                         f"input {x.placements}")
    if colwise:  # x whole: its gradient is this rank's partial sum
        local_x = x.to_local(grad_placements=(Partial(),))
        groups, out_placement = AmaxGroups(None, group, group), Shard(x.ndim - 1)
    else:
        local_x = x.to_local()
        groups, out_placement = AmaxGroups(group, group, None), Partial()
    flat = local_x.reshape(-1, local_x.shape[-1])
    out = _Float8Matmul.apply(flat, local_w, w8, w_scale, False, groups)
    out = out.reshape(*local_x.shape[:-1], out.shape[-1])
    return DTensor.from_local(out, mesh, (out_placement,), run_check=False)


# ---------------------------------------------------------------------------------------
# The float8 all-gather (data_parallel's gather hook).
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
