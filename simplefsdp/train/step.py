"""One optimizer step: the token-normalized loss, forward and backward over the step's
microbatches (or pipeline schedule), gradient clipping across every mesh dim, the
non-finite guard, and the optimizer update (the optimizer and its LR schedule:
``simplefsdp/optim.py``'s ``build_optimizer``).

The loss is normalized by the number of valid target tokens of the *global* step:
every data-parallel rank and every gradient-accumulation microstep contributes
``sum(token losses) / global_tokens``, and ``data_parallel(reduce_op="sum")`` adds up
the gradients, so the result is the mean over all tokens of the step whatever the split
across ranks, microsteps or pipeline microbatches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..mesh import local_shard
from ..parallel.pipeline import aux_loss_stage, run_schedule
from ..parallel.tensor import IGNORE_INDEX, loss_context, token_loss_sum
from .guard import NonFiniteError, step_flags
from .watchdog import phase

if TYPE_CHECKING:
    from .run import Setup

Batch = tuple[torch.Tensor, torch.Tensor]


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """Clip gradients to a global L2 norm of ``max_norm``; returns the norm before.

    Squared norms of the local pieces are summed over the mesh dims a gradient is
    sharded on (not over replicas: those hold the same values), one all-reduce per
    (mesh, placements) group and dim; this also covers TP and non-TP parameters that
    live on different meshes. Pipeline stages hold different parameters, so their
    squared norms are summed over ``pp_group``. ``device``: where the norms are reduced
    (the job's device; with CPU offload the gradients are on the host, NCCL is not).
    """
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(local_shard(g))
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for key, local in groups.items():
        sq = (torch.nn.utils.get_total_norm(local, 2.0).float() ** 2).to(device)
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                if not placement.is_replicate() and mesh.size(dim) > 1:
                    dist.all_reduce(sq, group=mesh.get_group(dim))
        total_sq += sq
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for local in (x for group in groups.values() for x in group):
        local.mul_(scale.to(local.device, local.dtype))
    return total


def global_tokens(s: Setup, batches: list[Batch]) -> torch.Tensor:
    """Valid target tokens of the whole step, over every data-parallel rank (TP ranks
    and PP stages see the same tokens: only the first stage's TP rank 0 counts)."""
    counts = s.at.counts_tokens
    local = sum(int((tgt != IGNORE_INDEX).sum()) for _, tgt in batches)
    total = torch.tensor(float(local if counts else 0), device=s.device)
    dist.all_reduce(total)
    return total.clamp_(min=1)


def forward_backward(s: Setup, batches: list[Batch], global_tokens: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward and backward over the step's microbatches; returns this rank's share of
    the step's loss (``sum(token losses) / global_tokens``; 0 off the last PP stage) and
    of its auxiliary loss (None without one).

    A model with an auxiliary loss (MoE balance: a mean over one forward's tokens) adds it
    weighted by that forward's share of the step's tokens, ``aux * tokens / global_tokens``:
    summed over ranks and microsteps it is the token-weighted mean, as the loss is. Under
    pipeline parallelism each stage adds its blocks' share (``pipeline.AuxLossStage``)."""
    step_loss = torch.zeros((), device=s.device)
    aux_of, step_aux = s.cfg.model.family_entry().aux_loss, None
    with loss_context(s.cfg.parallel.vocab_sharded_loss):  # the backward too
        for index, (inputs, targets) in enumerate(batches):
            inputs, targets = inputs.to(s.device), targets.to(s.device)
            if s.cfg.training.gradient_sync == "last_microstep":  # reduce the sum once
                s.model.set_requires_gradient_sync(index == len(batches) - 1)
            if s.pipeline_schedule is None:
                loss = token_loss_sum(s.runnable(inputs), targets) / global_tokens
                step_loss += loss.detach()
                aux = aux_of(s.model) if aux_of is not None else None
                if aux is not None:
                    aux = aux * (targets != IGNORE_INDEX).sum() / global_tokens
                    step_aux = aux.detach() if step_aux is None else step_aux + aux.detach()
                    loss = loss + aux
                loss.backward()
            else:
                carrier = aux_loss_stage(s.pipeline_schedule)  # each stage's aux joins backward
                losses = run_schedule(s.pipeline_schedule, s.at.first, s.at.last, inputs,
                                      targets)
                for mb_loss in losses:
                    step_loss += mb_loss.detach() / global_tokens
                aux = carrier.take_aux() if carrier is not None else None
                if aux is not None:
                    aux = aux / global_tokens
                    step_aux = aux if step_aux is None else step_aux + aux
    if s.pipeline_schedule is not None:  # the schedule's loss is a token sum: normalize here
        scale_grads_(s.params, 1 / global_tokens)
    return step_loss, step_aux


@torch.no_grad()
def scale_grads_(params: list[nn.Parameter], factor: torch.Tensor) -> None:
    for param in params:
        if param.grad is not None:
            grad = param.grad
            local_shard(grad).mul_(factor)


def train_step(s: Setup, step: int, batches: list[Batch], stop_requested: bool
               ) -> tuple[torch.Tensor, torch.Tensor, bool, dict[str, float]]:
    """One optimizer step; returns (this rank's contribution to the global loss, the
    gradient norm before clipping, whether some rank was asked to stop, the model
    family's figures of the step: ``ModelFamily.after_step``, e.g. MoE expert load).

    A loss or gradient norm that is not finite on any rank: the step is not applied and
    NonFiniteError is raised on every rank."""
    phase("token-count all-reduce")  # the collective (or phase) entered, for the watchdog
    tokens = global_tokens(s, batches)
    phase("forward/backward (data-parallel all-gathers, reduce-scatters)")
    step_loss, step_aux = forward_backward(s, batches, tokens)
    phase("grad-norm all-reduce")
    grad_norm = clip_grad_norm_(s.params, s.cfg.training.max_norm, s.pp_group, s.device)
    phase("step-flags all-reduce")
    nonfinite, stop = step_flags(step_loss, grad_norm, stop_requested)
    if nonfinite:
        s.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteError(
            f"step {step}: the loss or gradient norm is not finite (NaN/inf); the step was "
            f"not applied and no checkpoint is written from it. Lower training.lr, check "
            f"the data, or resume from the last checkpoint")
    phase("optimizer step")
    s.optimizer.step()
    s.lr_scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    after_step = s.cfg.model.family_entry().after_step
    stats = after_step(s, step_aux) if after_step is not None else {}
    counts_loss = s.at.counts_loss  # one loss per data-parallel rank
    contribution = step_loss if counts_loss else torch.zeros_like(step_loss)
    return contribution, grad_norm.detach(), stop, stats
