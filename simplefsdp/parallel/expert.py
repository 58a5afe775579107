"""Expert parallelism: each rank of an ``ep`` group holds ``num_experts / ep`` of every MoE
layer's routed experts, and tokens travel to the rank of their expert and back.

The experts' mesh is the job's mesh with ``dp_shard x cp x tp`` flattened and split in two,
``(dp_shard * cp * tp / ep, ep)``, ``ep`` inside (neighbouring ranks exchange tokens; TP
ranks, which route different tokens under :func:`moe_tp_plan`, join the experts' data
parallel): ``simplefsdp.mesh.ParallelDims.expert_mesh`` builds it. Its dims are named
as the job mesh's, ``dp_shard`` now meaning the ranks that hold the *same* experts, so
``data_parallel`` runs on it unchanged in every mode (``fully_shard`` shards each EP
group's local experts over those ranks, ``hybrid_shard`` adds the replicas, ``replicate``
needs ``dp_shard = ep``).

Sharding rule: an expert weight ``[E, ...]`` is a DTensor ``Shard(0)`` on ``ep`` (whole
experts per rank), and ``data_parallel`` shards those local experts on dim 0 again over
the experts' ``dp_shard`` (torchtitan's ``Shard(0)`` case; the rows of a local expert are
split when there are fewer local experts than ranks to shard them over). The guide's
dim-1 rule is not used: dim 0 keeps each expert whole on a rank whenever it can.

Gradients: the exchange is differentiable (the reverse all-to-all in backward), expert
gradients are summed over the experts' ``dp_shard`` ranks by ``data_parallel`` and the
rest over the job's data-parallel ranks, so under the trainer's token-normalized loss with
``reduce_op="sum"`` every gradient is the exact sum over all tokens: no divide factor.

The dispatch per MoE layer (:class:`ExpertParallelExperts`, swapped in as the experts'
class): tokens arrive grouped by global expert; their per-expert counts are exchanged
first (one ``all_to_all_single``), then the tokens with uneven splits
(``all_to_all_single_autograd``), regrouped by local expert, run through the local
experts (``models.moe.expert_ffn``: grouped matmuls or a loop) and sent back.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from .._torch_compat import (
    all_to_all_single,
    all_to_all_single_autograd,
    check_size,
    check_that,
    flatten_mesh,
)
from .._torch_compat.internals import module_style
from ..mesh import CP_DIMS, local_shard
from ..models.moe import MoE, expert_ffn, moe_layers, padded_experts
from ..module_swap import derived_class


def check_expert_split(ep: int, num_experts: int, prefix: str = "") -> None:
    """Raise a ValueError unless ``ep`` divides the ``num_experts`` experts (each rank of
    an ``ep`` group holds as many); ``prefix`` as the caller spells the sizes
    (``"parallel."``). The ranks ``ep`` divides are ``ParallelDims.check_ep``'s rule."""
    if num_experts % ep:
        raise ValueError(f"{prefix}ep = {ep} does not divide the {num_experts} experts; pick "
                         f"a divisor of the number of experts")


def apply_ep(model: nn.Module, experts_mesh: DeviceMesh) -> None:
    """Expert parallelism over ``experts_mesh["ep"]`` for every MoE layer of ``model``, in
    place: each experts module keeps its slice of experts (a ``Shard(0)`` DTensor on the
    ``ep`` mesh; from rank 0 of each group unless on ``meta``) and exchanges tokens.
    Apply it before ``data_parallel`` (:func:`shard_experts`, then the rest)."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no MoE layer: expert parallelism "
                         f"needs an MoE model")
    ep_mesh = experts_mesh["ep"]
    for layer in layers:
        split_experts(layer.experts, ep_mesh)
        layer.experts.__class__ = derived_class(type(layer.experts), "ExpertParallel",
                                                ExpertParallelExperts)


def split_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """One experts module's weights (``gate_up_proj``, ``down_proj``: experts on dim 0)
    become ``Shard(0)`` DTensors on ``ep_mesh`` (from rank 0 of each group unless on
    ``meta``), and the exchange's group is recorded (:func:`ep_forward` uses it)."""
    check_expert_split(ep_mesh.size(), experts._parameters["gate_up_proj"].shape[0])
    for name in ("gate_up_proj", "down_proj"):
        param = experts._parameters[name]
        src = None if param.device.type == "meta" else 0
        local = distribute_tensor(param.detach(), ep_mesh, (Shard(0),), src_data_rank=src)
        experts._parameters[name] = nn.Parameter(local, requires_grad=param.requires_grad)
    experts._sf_ep_group = ep_mesh.get_group()


def set_expert_dispatch(model: nn.Module, dispatch: str, capacity_factor: float) -> None:
    """Every MoE layer of ``model`` dispatches ``"exact"`` (dropless, uneven splits) or
    ``"padded"`` (each expert takes ``models.moe.expert_capacity`` slots per rank and call,
    the rest dropped and counted in its ``tokens_dropped``; static shapes)."""
    for layer in moe_layers(model):
        layer.capacity_factor = capacity_factor if dispatch == "padded" else None


def shard_experts(model: nn.Module, experts_mesh: DeviceMesh, **data_parallel_kwargs) -> None:
    """``data_parallel`` on each MoE layer's experts over ``experts_mesh`` (so the model's
    later ``data_parallel`` leaves them on it); the keyword arguments are its own."""
    from ..data_parallel import data_parallel

    for layer in moe_layers(model):
        data_parallel(layer.experts, experts_mesh, **data_parallel_kwargs)


def holds_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a fused experts module, ours or Hugging Face's (a 3-D
    ``gate_up_proj``, ``[experts, 2 x width, dim]``)."""
    gate_up = module._parameters.get("gate_up_proj")
    return isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3


def is_moe(module: nn.Module) -> bool:
    """Whether ``module`` is a routed FFN (``models.moe.MoE``)."""
    return isinstance(module, MoE)


def moe_tp_plan(moe: nn.Module, prefix: str = "feed_forward") -> dict:
    """Tensor + sequence parallel for one routed FFN at ``prefix`` of its block (keys for
    ``parallelize_module`` on the block's TP mesh).

    Each TP rank routes its own part of the sequence: the FFN takes the normed residual's
    sequence shard as it is (no gather), the router runs on those tokens with its whole
    weight (replicated over TP, :class:`TensorParallelRouter`: its gradient, one part of
    the sequence per rank, is summed over TP in backward), and the routed experts (whole,
    not TP-split) see only those tokens: the all-to-alls carry ``1 / tp`` of the slots,
    and TP ranks act as data-parallel ranks for the experts (``ParallelDims.expert_mesh``
    folds ``tp`` into the experts' dims). The routed output is this rank's part already.
    The shared expert is a dense sequence-parallel FFN: its input gathered over the
    sequence, ``w1``/``w3`` column-wise, ``w2`` row-wise, its output reduce-scattered back
    onto this rank's part. The balance loss needs the whole sequence's statistics:
    :func:`set_token_group`."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    plan = {prefix: PrepareModuleInput(input_layouts=(Shard(1),),
                                       desired_input_layouts=(Shard(1),),
                                       use_local_output=True),
            f"{prefix}.gate": module_style(_replicate_router)}
    if moe.shared_expert is not None:
        plan.update({f"{prefix}.shared_expert": PrepareModuleInput(
                         input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     f"{prefix}.shared_expert.w1": ColwiseParallel(),
                     f"{prefix}.shared_expert.w3": ColwiseParallel(),
                     f"{prefix}.shared_expert.w2": RowwiseParallel(output_layouts=Shard(1))})
    return plan


def _replicate_router(module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
    """The router's weight becomes a ``Replicate`` DTensor on the TP mesh (the router
    computes on local tokens: :class:`TensorParallelRouter`); a ``ParallelStyle``'s work."""
    weight = module._parameters["weight"]
    src = None if weight.device.type == "meta" else 0
    module._parameters["weight"] = nn.Parameter(
        distribute_tensor(weight.detach(), device_mesh, (Replicate(),), src_data_rank=src),
        requires_grad=weight.requires_grad)
    module.__class__ = derived_class(type(module), "TensorParallel", TensorParallelRouter)
    return module


class TensorParallelRouter(nn.Module):
    """The router under TP (mixed into the router's class): its weight, a ``Replicate``
    DTensor on the TP mesh, is read as the local tensor whose gradient is ``Partial``:
    each TP rank's gradient comes from its own tokens, and they are summed over TP where
    the gradient meets the weight's ``Replicate`` placement (``data_parallel``'s read
    redistributes it in backward; without it the gradient stays a ``Partial`` DTensor)."""

    def gate_weight(self) -> torch.Tensor:
        weight = self.weight
        if not isinstance(weight, DTensor):
            return weight
        return weight.to_local(grad_placements=(Partial(),) * weight.device_mesh.ndim)


def set_token_group(model: nn.Module, mesh: DeviceMesh) -> None:
    """Under TP, every MoE layer's balance-loss statistics are summed over the ranks that
    route parts of the same sequences: ``cp_ring x cp_ulysses x tp`` of the job ``mesh``
    (their dims above 1, flattened; replaces ``apply_cp``'s cp-only group), so the loss is
    the whole sequences' on each; ``loss_copies = tp`` (each TP rank adds the loss with
    its slice's whole weight: ``models.balance_loss.switch_aux_loss``). Collective (every rank
    flattens the same dims). Nothing to do without TP."""
    if mesh["tp"].size() == 1:
        return
    dims = tuple(d for d in (*CP_DIMS, "tp") if mesh[d].size() > 1)
    group = (mesh["tp"] if len(dims) == 1 else flatten_mesh(mesh[dims], "_".join(dims))
             ).get_group()
    for layer in moe_layers(model):
        layer.token_group, layer.loss_copies = group, mesh["tp"].size()


class ExpertParallelExperts(nn.Module):
    """The experts' forward under expert parallelism (mixed into the experts' class)."""

    _sf_ep_group: dist.ProcessGroup

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                capacity: int | None = None) -> torch.Tensor:
        """``x`` (slots, dim) grouped by global expert, ``counts`` (E,) -> the slots
        through their experts, same order; ``capacity``: the padded dispatch's rows per
        expert and rank (``models.moe.padded_experts``), None: exact."""
        return ep_forward(self, x, counts, capacity)


def ep_forward(experts: nn.Module, x: torch.Tensor, counts: torch.Tensor,
               capacity: int | None = None) -> torch.Tensor:
    """The forward of an experts module split by :func:`split_experts`: ``x`` (slots,
    dim) grouped by global expert, ``counts`` (E,) -> the slots through their experts.
    The weights are read here (their data-parallel gathers) and exchanged in
    :func:`_dispatch` (exact) or ``models.moe.padded_experts`` (``capacity`` rows per expert)."""
    gate_up, down = local_shard(experts.gate_up_proj), local_shard(experts.down_proj)
    if capacity is not None:
        refuse_padded_width_split(experts)
        group = experts._sf_ep_group
        return padded_experts(x, counts, gate_up, down, capacity, dist.get_world_size(group),
                              functools.partial(_exchange_even, group=group))
    # expert tensor parallelism (parallel/expert_tensor.py): the local experts' width split
    width_split = getattr(experts, "_sf_width_split", None)
    if _kept is not None:  # eager selective AC: the kept exchanges
        return _dispatch_kept(x, counts, gate_up, down, experts._sf_ep_group, width_split)
    return _dispatch(x, counts, gate_up, down, experts._sf_ep_group, width_split)


def refuse_padded_width_split(experts: nn.Module) -> None:
    """The padded dispatch on experts whose width is split over TP (``parallel.etp``,
    ``parallel/expert_tensor.py``) is not built: refuse it, naming the keys."""
    if getattr(experts, "_sf_width_split", None) is not None:
        raise ValueError("parallel.etp > 1 runs the exact dispatch only: set "
                         "parallel.expert_dispatch = 'exact' (or parallel.etp = 1)")


def _dispatch(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, group: dist.ProcessGroup, width_split=None) -> torch.Tensor:
    """The exact exchange and the local experts (``gate_up``/``down``: this rank's experts;
    ``width_split``: None, or ``expert_tensor.width_split_ffn`` bound to the TP group,
    which runs them when their width is split over TP).

    Traceable: under ``torch.compile`` (with ``_torch_compat.data_dependent_shapes``, which
    our compile path sets) the split sizes read on the host become unbacked sizes, and both
    exchanges are functional collectives, nodes of the block's graph. ``check_that``
    tells the tracer what the data guarantees: every size is a size, and the splits add up
    to the rows they split."""
    ep = dist.get_world_size(group)
    local_experts = counts.numel() // ep
    # received[s, e]: slots rank s sends to our local expert e (a static-shape exchange).
    received = all_to_all_single(counts, group).view(ep, local_experts)
    send = counts.view(ep, local_experts).sum(1).tolist()
    recv = received.sum(1).tolist()
    per_expert = received.sum(0).tolist()
    for size in (*send, *recv, *per_expert):
        check_size(size)
    check_that(sum(send) == x.shape[0])
    tokens = _exchange(x, recv, send, group)
    check_that(sum(per_expert) == tokens.shape[0])
    check_that(sum(recv) == tokens.shape[0])
    by_expert = _source_to_expert_order(received, tokens.shape[0])
    if width_split is None:
        out = expert_ffn(tokens[by_expert], per_expert, gate_up, down)
    else:
        out = width_split(tokens[by_expert], received.sum(0), gate_up, down)
    return _exchange(out[by_expert.argsort()], send, recv, group)


@torch.compiler.disable
def _dispatch_kept(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, group: dist.ProcessGroup, width_split=None
                   ) -> torch.Tensor:
    """:func:`_dispatch` while an eager checkpoint keeps the token exchanges
    (:func:`keep_exchanges`, eager selective AC): it reads and appends to Python state
    that a graph cannot replay, so it is never traced (a compiled routed block's policy
    keeps the exchanges in the graph: ``activation_checkpoint.compile_checkpointed_blocks``)."""
    return _dispatch(x, counts, gate_up, down, group, width_split)


def _exchange_even(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """An even, differentiable all-to-all of rows (the padded dispatch's)."""
    rows = x.shape[0] // dist.get_world_size(group)
    splits = [rows] * dist.get_world_size(group)
    return all_to_all_single_autograd(x, splits, splits, group, wait=True)


class _KeptExchanges:
    """The outputs of one checkpointed call's token exchanges: recorded in its forward,
    served in order to its recomputation in place of exchanging again (a checkpoint's
    ``context_fn``: :func:`keep_exchanges`). Plain contexts, no dispatch mode, so they
    hold around compiled graphs too: a selective-checkpoint mode in a recomputation meets
    the ops of Inductor's runtime wrappers, which need not repeat the forward's."""

    def __init__(self):
        self.rows: list[tuple[torch.Tensor, int]] = []  # (output, its version) per exchange
        self.served: int | None = None  # in a recomputation, the exchanges served so far

    @contextlib.contextmanager
    def active(self, recomputing: bool):
        global _kept
        previous, _kept, self.served = _kept, self, 0 if recomputing else None
        try:
            yield
        finally:
            _kept = previous
            if recomputing:  # recomputed once per backward: the rows are not needed again
                self.rows.clear()

    def exchange(self, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                 group: dist.ProcessGroup) -> torch.Tensor:
        if self.served is None:
            out = _all_to_all(x, output_splits, input_splits, group)
            self.rows.append((out.detach(), out._version))
            return out
        if self.served >= len(self.rows):
            raise RuntimeError("a recomputation ran more token exchanges than its forward "
                               "(or a second backward through a checkpointed MoE block)")
        rows, version = self.rows[self.served]
        self.served += 1
        if rows._version != version:
            raise RuntimeError("a kept token exchange's output was modified in place "
                               "after the forward; it cannot stand for the recomputation")
        # The recomputation's graph only refills the forward's saved tensors (non-reentrant
        # checkpointing): nothing flows back through it, only requires_grad must match.
        return rows.detach().requires_grad_(x.requires_grad)


_kept: _KeptExchanges | None = None  # the checkpointed call running now, if it keeps them


def keep_exchanges() -> tuple:
    """A checkpoint ``context_fn`` (forward context, recomputation context) that keeps the
    outputs of the expert dispatch's token exchanges, so that recomputing an MoE block
    moves no token again (``activation_checkpoint.mode = selective``; torchtitan's
    policy saves the all-to-alls too). The counts' exchange runs again (a few bytes)."""
    kept = _KeptExchanges()
    return kept.active(recomputing=False), kept.active(recomputing=True)


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    """One differentiable all-to-all of rows, waited for here (its rows are read in the
    dispatch at once)."""
    return all_to_all_single_autograd(x, output_splits, input_splits, group, wait=True)


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    """The dispatch's token exchange: through the running checkpoint's kept outputs when
    it keeps them (:func:`keep_exchanges`), else an all-to-all."""
    if _kept is None:
        return _all_to_all(x, output_splits, input_splits, group)
    return _kept.exchange(x, output_splits, input_splits, group)


def _source_to_expert_order(received: torch.Tensor, rows: int | None = None
                            ) -> torch.Tensor:
    """Row indices that regroup ``rows`` slots (``received``'s sum: pass it when known)
    laid out by (source rank, local expert) into (local expert, source rank): the grouped
    matmul wants each expert's rows together. A stable sort of each row's local expert,
    so a source's rows keep their order."""
    rows = int(received.sum()) if rows is None else rows
    local_experts = received.shape[1]
    expert = torch.arange(received.numel(), device=received.device) % local_experts
    expert_of_row = torch.repeat_interleave(expert, received.flatten(), output_size=rows)
    return expert_of_row.argsort(stable=True)


__all__ = ["ExpertParallelExperts", "TensorParallelRouter", "apply_ep", "check_expert_split",
           "ep_forward", "holds_experts", "is_moe", "keep_exchanges", "moe_tp_plan",
           "set_expert_dispatch", "set_token_group", "shard_experts", "split_experts"]


# A mixture of experts' figures per step (our MoE and Hugging Face MoE folders):
# ``expert_figures``.
MOE_COLUMNS = ("aux_loss", "expert_load_max_mean", "tokens_dropped")


def expert_figures(loads: torch.Tensor, step_aux: torch.Tensor | None,
                   device: torch.device, dropped: torch.Tensor | None = None
                   ) -> dict[str, float]:
    """A mixture of experts' step figures (:data:`MOE_COLUMNS`): ``aux_loss``, the
    balance loss added to the step's loss (coefficient applied; ``step_aux`` is this
    rank's token-weighted share, summed here over every rank: an all-reduce; None: 0),
    ``expert_load_max_mean``, the busiest expert's slots over the mean per expert in the
    worst layer (``loads``: (layers, E) slots per expert, already summed over the ranks;
    1 is balanced), and ``tokens_dropped``, the routed slots the padded dispatch dropped
    (``dropped``: this rank's, summed here over every rank; None: 0, dropless routing)."""
    aux = torch.zeros((), device=device) if step_aux is None else step_aux.clone()
    own_dropped = torch.zeros((), device=device) if dropped is None else dropped
    sums = torch.stack([aux.reshape(()), own_dropped.to(aux.dtype).reshape(())])
    dist.all_reduce(sums)
    aux, total_dropped = sums[0], sums[1]
    ratio = (loads.max(1).values / loads.mean(1).clamp(min=1e-9)).max() if loads.numel() \
        else torch.ones(())
    return {"aux_loss": float(aux), "expert_load_max_mean": float(ratio),
            "tokens_dropped": float(total_dropped)}
