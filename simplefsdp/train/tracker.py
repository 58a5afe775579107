"""Experiment tracking: ``metrics.wandb = true`` sends the metrics rows to Weights & Biases.

Rank 0 only (the other ranks hold no tracker). The run is named ``job.name``, in the
project ``$WANDB_PROJECT`` (else "simplefsdp"), with the whole job config as its config;
its files lie under ``metrics.output_dir``. Each row logged is the row written to
``metrics.csv`` (the same keys, ``step`` as wandb's step; a validation row's
``val_loss``/``val_ppl`` with it). wandb's own settings apply: ``WANDB_MODE=offline``
records without a network (``wandb sync`` uploads later), ``WANDB_API_KEY`` logs in.

wandb is an optional package (``pip install wandb``): with ``metrics.wandb = true`` and
no wandb, the run stops at start-up (``preflight.missing_packages``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..config.job import JobConfig


class WandbTracker:
    """A wandb run for this job (rank 0); :meth:`log` a metrics row, :meth:`close` at the
    end."""

    def __init__(self, cfg: JobConfig):
        import wandb

        folder = Path(cfg.metrics.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "simplefsdp"),
                              name=cfg.job.name, dir=str(folder), config=cfg.to_dict())

    def log(self, row: dict[str, float]) -> None:
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def build_tracker(cfg: JobConfig, rank: int) -> Any:
    """The run's tracker (``metrics.wandb``) on rank 0, else None."""
    if not cfg.metrics.wandb or rank != 0:
        return None
    return WandbTracker(cfg)
