"""Switch Transformer's load-balancing loss for a routed MoE layer (``models.moe.MoE``
with ``load_balance = "aux_loss"``), over the ranks that hold parts of the same
sequences under context and tensor parallelism."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._torch_compat import all_gather_autograd


def switch_aux_loss(scores: torch.Tensor, counts: torch.Tensor, score_func: str,
                    group: dist.ProcessGroup | None = None, copies: int = 1) -> torch.Tensor:
    """Switch Transformer's balance loss, as transformers computes it for one layer:
    ``E * sum_e (slots to e / tokens) * mean score of e``; ``top_k`` when perfectly
    balanced. Sigmoid scores are normalized per token first. With ``group`` (context and
    tensor parallel: its ranks hold equal parts of the same sequences) the slots and scores
    are summed over its ranks first, so the loss is the whole sequences' on every rank; the
    scores' gradient comes back summed over the ranks (the all-gather's backward).

    ``copies``: ranks of ``group`` that each add this loss with the weight of the same
    tokens (TP ranks: the trainer weighs every TP rank's copy by its whole slice's share,
    as TP ranks share one loss), so the summed gradient is divided by it: the sum over the
    group then counts each part of the sequences once (a CP rank weighs by its own part)."""
    if score_func == "sigmoid":
        scores = scores / scores.sum(-1, keepdim=True)
    tokens, experts = scores.shape
    stats = torch.stack([counts.float(), scores.sum(0)])  # (2, E)
    if copies > 1:
        stats = _ScaleGrad.apply(stats, 1 / copies)
    if group is not None:
        size = dist.get_world_size(group)
        stats = all_gather_autograd(stats, group).view(size, 2, experts).sum(0)
        tokens *= size
    return experts * (stats[0] / tokens * (stats[1] / tokens)).sum()


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; in backward the gradient times ``factor``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None
