"""The trainer's optimizer and LR schedule, read from ``[training]``: one owner for the
trainer, the planner's GPU check and the scripts (the optimizer's state, sized by
:data:`OPTIMIZER`, lives outside the compiled graphs: the memory limit and the disk
check count it)."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from .config.job import JobConfig

OPTIMIZER = torch.optim.AdamW


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to
    ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg: JobConfig):
    """The trainer's AdamW over ``model``'s trainable parameters and its LR schedule
    (``lr_lambda``), which ``train.step.train_step`` advances after each update."""
    t = cfg.training
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach kernels need every DTensor of one call on one mesh; with TP the params
    # live on two meshes (DP-only and DP x TP), so fall back to the per-tensor loop.
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    optimizer = OPTIMIZER(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                          weight_decay=t.weight_decay, foreach=len(meshes) <= 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_lambda, warmup=t.warmup_steps, total=t.steps))
    return optimizer, scheduler
