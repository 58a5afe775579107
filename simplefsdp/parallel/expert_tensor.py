"""Expert tensor parallelism (``parallel.etp = parallel.tp``): each routed expert's width
is split over the TP ranks, as a dense FFN's under TP, and *stored* split.

Storage: an expert weight is a DTensor on the experts' ``(ep, tp)`` mesh
(``ParallelDims.expert_mesh`` with ``etp``: the experts' ``tp`` dim is the job's TP group,
and the ``ep`` groups come out of ``dp_shard x cp`` alone, so TP peers hold the same
experts). ``down_proj [E, dim, I]`` is ``Shard(2)`` on ``tp`` (row-wise: this rank's
columns of the hidden width); ``gate_up_proj [E, 2I, dim]`` holds the gate rows then the
up rows, and a rank needs the *same* hidden columns of both, so its placement is
``StridedShard(1, split_factor=2)`` on ``tp``: dim 1 cut in two (gate, up), each cut over
TP, rank ``r`` holding ``[gate_r; up_r]``. ``data_parallel`` then shards the local
experts over the experts' data-parallel dims on dim 0 as with ``etp = 1``, so a rank stores
and all-gathers ``1 / tp`` of the bytes an ``etp = 1`` rank gathers: the gathered TP slice
is what this rank computes with.

Compute (:func:`width_split_ffn`): each TP rank routes its own part of the sequence
(``expert.moe_tp_plan``), so the TP group's slots for these experts are gathered (an
uneven all-to-all that sends this rank's rows to every TP peer: with expert parallelism
the rows that reach a rank differ), run through this rank's width slice, and the partial
down-projections are sent back to the ranks that own the rows and summed there (the
reverse exchange: a reduce-scatter with uneven splits). Its backward is the same pair
reversed. The weight gradients need no TP reduction: a rank's slice sees every slot of
its TP group.

Checkpoints: DCP writes one contiguous box per rank and DTensor, which ``gate_up``'s
strided placement is not; ``simplefsdp.state_dict`` saves such tensors in the equivalent
``Shard(1)`` layout (:func:`simplefsdp.state_dict.checkpoint_placements`), so an ``etp = 2``
checkpoint loads into an ``etp = 1`` run and back.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from .._torch_compat import StridedShard, all_gather_autograd, check_size, check_that
from ..mesh import local_shard
from ..models.moe import expert_ffn, moe_layers
from ..module_swap import derived_class
from . import expert as expert_module
from .expert import ExpertParallelExperts, _exchange, _source_to_expert_order, check_expert_split

# The TP placement of each expert weight: the hidden width's dim (see the module docstring).
WIDTH_PLACEMENTS = {"gate_up_proj": StridedShard(1, split_factor=2), "down_proj": Shard(2)}


def apply_etp(model: nn.Module, experts_mesh: DeviceMesh) -> None:
    """Expert tensor parallelism for every MoE layer of ``model``, in place, on
    ``experts_mesh`` (``ParallelDims.expert_mesh(..., etp=tp)``): each experts module's
    weights become DTensors split over its ``tp`` dim on the hidden width (and over
    ``ep`` on the experts when that dim is above 1: expert parallelism too, in place of
    ``expert.apply_ep``). Apply it before ``data_parallel`` on the experts' mesh."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoE layer: expert tensor "
                         f"parallelism needs an MoE model")
    ep, tp = experts_mesh["ep"].size(), experts_mesh["tp"].size()
    mesh = experts_mesh[("ep", "tp")] if ep > 1 else experts_mesh["tp"]
    for layer in layers:
        experts = layer.experts
        width = experts._parameters["down_proj"].shape[-1]
        if width % tp:
            raise ValueError(f"parallel.etp = {tp} does not divide the routed experts' "
                             f"width model.moe_hidden_dim = {width}; pick a divisor")
        check_expert_split(ep, experts._parameters["gate_up_proj"].shape[0], "parallel.")
        for name, width_placement in WIDTH_PLACEMENTS.items():
            param = experts._parameters[name]
            placements = (Shard(0), width_placement) if ep > 1 else (width_placement,)
            src = None if param.device.type == "meta" else 0
            split = distribute_tensor(param.detach(), mesh, placements, src_data_rank=src)
            experts._parameters[name] = nn.Parameter(split, requires_grad=param.requires_grad)
        experts._sf_width_split = functools.partial(
            width_split_ffn, group=experts_mesh["tp"].get_group())
        if ep > 1:
            experts._sf_ep_group = experts_mesh["ep"].get_group()
            mixin, label = ExpertParallelExperts, "ExpertParallel"
        else:
            mixin, label = ExpertTensorParallelExperts, "ExpertTensorParallel"
        experts.__class__ = derived_class(type(experts), label, mixin)


class ExpertTensorParallelExperts(nn.Module):
    """The experts' forward under expert tensor parallelism without expert parallelism
    (mixed into their class; with it, ``expert.ep_forward`` calls
    :func:`width_split_ffn` after its exchange)."""

    _sf_width_split: functools.partial

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                capacity: int | None = None) -> torch.Tensor:
        if capacity is not None:
            expert_module.refuse_padded_width_split(self)
        gate_up, down = local_shard(self.gate_up_proj), local_shard(self.down_proj)
        if expert_module._kept is not None:  # selective AC keeps the exchanges' outputs
            return _width_split_kept(self._sf_width_split, x, counts, gate_up, down)
        return self._sf_width_split(x, counts, gate_up, down)


@torch.compiler.disable
def _width_split_kept(width_split, x: torch.Tensor, counts: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``width_split`` while a checkpoint keeps the exchanges (``expert.keep_exchanges``):
    eagerly, as ``expert._dispatch_kept`` (it reads and appends to Python state that a
    graph cannot replay)."""
    return width_split(x, counts, gate_up, down)


def width_split_ffn(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` (rows, dim) grouped by this rank's ``E`` experts, ``counts`` (E,) rows per
    expert -> the rows through their experts, summed over the TP ``group``'s width
    slices (``gate_up [E, 2 I/tp, dim]``: this rank's gate then up rows, ``down [E, dim,
    I/tp]``). Traceable: the split sizes are unbacked under ``torch.compile``."""
    tp = dist.get_world_size(group)
    rows = x.shape[0]
    # per_rank[s, e]: rows TP rank s holds for expert e (a static-shape all-gather)
    per_rank = all_gather_autograd(counts.detach(), group).view(tp, counts.numel())
    from_each = per_rank.sum(1).tolist()
    per_expert = per_rank.sum(0).tolist()
    for size in (*from_each, *per_expert):
        check_size(size)
    check_that(from_each[dist.get_rank(group)] == rows)
    # every TP peer gets this rank's rows: an all-gather with uneven sizes
    slots = _exchange(x.repeat(tp, 1), from_each, [rows] * tp, group)
    check_that(sum(from_each) == slots.shape[0])
    check_that(sum(per_expert) == slots.shape[0])
    by_expert = _source_to_expert_order(per_rank, slots.shape[0])
    partial = expert_ffn(slots[by_expert], per_expert, gate_up, down)
    # each rank's rows back to it, one partial sum per TP rank: a reduce-scatter
    back = _exchange(partial[by_expert.argsort()], [rows] * tp, from_each, group)
    return back.view(tp, rows, back.shape[-1]).sum(0)


__all__ = ["WIDTH_PLACEMENTS", "ExpertTensorParallelExperts", "apply_etp", "width_split_ffn"]
