"""What one training run holds (:class:`Setup`, built by ``trainer.setup``) and returns
(:class:`TrainResult`): their own module, so the step and console modules that take a
``Setup`` do not import the trainer back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from ..config.job import JobConfig
    from ..corpus.text import Tokenizer
    from ..mesh import Coords, ParallelDims
    from ..models.registry import ModelFamily
    from .checkpoint import CheckpointManager
    from .metrics import MetricsLogger


@dataclass
class TrainResult:
    """What a run did; ``losses[i]`` is the global loss of step ``start_step + i + 1``."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    start_step: int = 0
    steps: int = 0
    wall_time_s: float = 0.0
    num_params: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    output_dir: str = ""
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss
    profile_files: list[str] = field(default_factory=list)  # this rank's ([profiling])


@dataclass
class Setup:
    """Everything the loop needs, built once by ``trainer.setup``."""

    cfg: JobConfig  # with parallel sizes resolved
    device: torch.device
    mesh: Any
    at: Coords  # this rank's coordinates (ParallelDims.coords)
    loader: Any
    tokenizer: Tokenizer
    runnable: nn.Module  # what the loop calls (compiled / pipeline stage)
    model: nn.Module  # the underlying Transformer (or stage)
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any  # the learning rate's (optim.build_optimizer)
    pipeline_schedule: Any  # the pipeline's (parallel.pipeline.build_schedule); None without PP
    ckpt: CheckpointManager | None
    metrics: MetricsLogger
    start_step: int
    n_params: int
    dims: ParallelDims  # the run's layout, built once (cfg.parallel holds the TOML's sizes)
    family: ModelFamily  # the model family's entry (models.registry)
    validation: Any = None  # validation.HeldOutBatches ([validation]), or None

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["pp"].get_group() if self.cfg.parallel.pp > 1 else None
