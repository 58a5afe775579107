"""Pipeline parallelism: cut the Transformer into stages and run a schedule over them.

Each PP rank keeps a contiguous run of blocks; the first stage also keeps
``tok_embeddings`` and the last keeps ``norm`` and ``output`` (the model's forward
accepts hidden states / returns hidden states when those are ``None``). Deleting
modules keeps the remaining names, so a stage's state dict keys are the full model's
and checkpoints are interchangeable between PP layouts. The schedule is 1F1B when
there are at least as many microbatches as stages, GPipe otherwise. A model with an
auxiliary loss (MoE) runs each stage inside :class:`AuxLossStage`, so that every stage's
share joins backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config.shapes import check_pipeline
from ..mesh import ParallelDims
from ..models.llama import Transformer
from ..models.moe import COUNTERS
from .tensor import IGNORE_INDEX


def stage_layers(n_layers: int, pp: int, stage: int) -> list[int]:
    """Block indices of ``stage``: an even split, the first stages take the remainder.
    Needs ``n_layers >= pp`` (``config.shapes.check_pipeline``)."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (stage < extra)))


def split_stage(model: Transformer, pp: int, stage: int) -> Transformer:
    """Delete in place what ``stage`` of ``pp`` does not run; returns ``model``. Raises a
    ConfigError if the model cannot be split (``config.shapes.check_pipeline``)."""
    check_pipeline(model.args, pp)
    if pp == 1:
        return model
    keep = {str(i) for i in stage_layers(model.args.n_layers, pp, stage)}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != pp - 1:
        model.norm = None
        model.output = None
    return model


def build_schedule(stage_module: nn.Module, pp_mesh: DeviceMesh, device: torch.device,
                   n_microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor],
                                                          torch.Tensor],
                   aux_of: Callable[[], torch.Tensor | None] | None = None):
    """A ``PipelineStage`` for this rank and its schedule. ``loss_fn`` is summed over
    microbatches (``scale_grads=False``): it must already carry the normalization.
    ``aux_of()``: the stage's auxiliary loss of its last forward (an MoE's balance loss);
    it then joins backward through the stage's output (:class:`AuxLossStage`)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pp, stage_index = pp_mesh.size(), ParallelDims.local_rank(pp_mesh)
    if aux_of is not None:
        stage_module = AuxLossStage(stage_module, aux_of)
    stage = PipelineStage(stage_module, stage_index, pp, device, group=pp_mesh.get_group())
    kind = Schedule1F1B if n_microbatches >= pp else ScheduleGPipe
    return kind(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False), stage


def run_schedule(schedule, first: bool, last: bool, inputs: torch.Tensor,
                 targets: torch.Tensor, train: bool = True) -> list[torch.Tensor]:
    """One batch through ``schedule`` (``step``, or forward-only ``eval`` when not
    ``train``): the first stage feeds the tokens, the last one the targets; returns the
    microbatches' losses (empty off the last stage). An MoE stage's aux-loss weights
    (tokens counted per row) go along. The tokens go contiguous: torch 2.11's stages
    check a microbatch's strides against the contiguous ones they were built with, and a
    batch cut from longer rows (``inputs = rows[:, :-1]``) keeps the rows' strides."""
    losses: list[torch.Tensor] = []
    extra = {} if aux_loss_stage(schedule) is None else {
        "aux_weight": (targets != IGNORE_INDEX).sum(1).to(torch.float32)}
    run = schedule.step if train else schedule.eval
    run(*((inputs.contiguous(),) if first else ()), target=targets if last else None,
        losses=losses, **extra)
    return losses


def aux_loss_stage(schedule) -> AuxLossStage | None:
    """The :class:`AuxLossStage` a schedule of :func:`build_schedule` runs, if any."""
    module = schedule._stage.submod
    return module if isinstance(module, AuxLossStage) else None


class AuxLossStage(nn.Module):
    """A pipeline stage whose auxiliary loss reaches backward (MoE balance loss).

    Each stage's blocks add their own balance losses, but only the last stage computes
    the loss that backward starts from. So each forward's ``aux_of() * aux_weight.sum()``
    (``aux_weight``: the microbatch's valid target tokens per sequence, a keyword the
    schedule splits into microbatches as it splits the inputs) is attached to the stage's
    output by :class:`_CarryAux`: an identity whose backward also gives that term the
    gradient 1, so when the microbatch's backward reaches this stage the term's gradient
    flows into the router and the rest, as ``loss + aux`` does without a pipeline (the
    step then divides every gradient by the global token count, as it does the loss's).

    The first call is torch's metadata inference (``PipelineStage`` built without example
    arguments runs one forward, on a microbatch-shaped input, before the first
    microbatch): it runs with the MoE load counters saved and put back, so that the
    expert loads count only real tokens."""

    def __init__(self, stage: nn.Module, aux_of: Callable[[], torch.Tensor | None]):
        super().__init__()
        self.stage, self.aux_of = stage, aux_of
        self.step_aux: torch.Tensor | None = None  # sum of aux * weight since last taken
        self._inferred = False

    def forward(self, x: torch.Tensor, aux_weight: torch.Tensor) -> torch.Tensor:
        if not self._inferred:
            self._inferred = True
            counters = [b.clone() for b in self._counters()]
            out = self.stage(x)
            for buffer, saved in zip(self._counters(), counters, strict=True):
                buffer.copy_(saved)
            return out
        out = self.stage(x)
        aux = self.aux_of()
        if aux is None:
            return out
        aux = aux * aux_weight.sum()
        self.step_aux = aux.detach() if self.step_aux is None else self.step_aux + aux.detach()
        return _CarryAux.apply(out, aux)

    def _counters(self) -> list[torch.Tensor]:
        return [b for n, b in self.stage.named_buffers() if n.endswith(COUNTERS)]

    def take_aux(self) -> torch.Tensor | None:
        """The summed ``aux * weight`` of the forwards since the last call, then reset."""
        aux, self.step_aux = self.step_aux, None
        return aux


class _CarryAux(torch.autograd.Function):
    """``out`` unchanged; in backward ``aux`` gets the gradient 1 (it joins the loss)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), device=grad.device)
