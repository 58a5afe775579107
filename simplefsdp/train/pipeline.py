"""Pipeline parallelism: cut the Transformer into stages and run a schedule over them.

Each PP rank keeps a contiguous run of blocks; the first stage also keeps
``tok_embeddings`` and the last keeps ``norm`` and ``output`` (the model's forward
accepts hidden states / returns hidden states when those are ``None``). Deleting
modules keeps the remaining names, so a stage's state dict keys are the full model's
and checkpoints are interchangeable between PP layouts. The schedule is 1F1B when
there are at least as many microbatches as stages, GPipe otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..mesh import ParallelDims
from ..models.llama import Transformer
from .config import check_pipeline


def stage_layers(n_layers: int, pp: int, stage: int) -> list[int]:
    """Block indices of ``stage``: an even split, the first stages take the remainder.
    Needs ``n_layers >= pp`` (``config.check_pipeline``)."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (stage < extra)))


def split_stage(model: Transformer, pp: int, stage: int) -> Transformer:
    """Delete in place what ``stage`` of ``pp`` does not run; returns ``model``. Raises a
    ConfigError if the model cannot be split (``config.check_pipeline``)."""
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
                                                          torch.Tensor]):
    """A ``PipelineStage`` for this rank and its schedule. ``loss_fn`` is summed over
    microbatches (``scale_grads=False``): it must already carry the normalization."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pp, stage_index = pp_mesh.size(), ParallelDims.local_rank(pp_mesh)
    stage = PipelineStage(stage_module, stage_index, pp, device, group=pp_mesh.get_group())
    kind = Schedule1F1B if n_microbatches >= pp else ScheduleGPipe
    return kind(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False), stage
