"""Start-up checks: what would otherwise fail after hours of training fails before step 1.

Each check returns a problem (a sentence naming the key and the fix) or None; ranks
pool theirs with :func:`agree`, so every rank raises the same ConfigError together.
The trainer runs :func:`before_build` before it builds anything and
:func:`checkpoint_space` once the parameters exist (both collectives).
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..agreement import gather_objects
from ..compiler.cost.state import optimizer_state_bytes, sharded_param_bytes
from ..config.job import JobConfig
from ..errors import ConfigError
from ..optim import OPTIMIZER
from .checkpoint import remove_partial

_EXTRA = "pip install 'simplefsdp[train]'"


def agree(problems: list[str]) -> None:
    """Raise one ConfigError on every rank if any rank found a problem (a collective)."""
    everyone = gather_objects(problems)
    found = list(dict.fromkeys(p for mine in everyone for p in mine))
    if found:
        raise ConfigError("; ".join(found))


def missing_packages(cfg: JobConfig) -> list[str]:
    """Packages the config needs that do not import. (Plots and TensorBoard are optional
    and skipped with a note by the metrics logger; tqdm likewise.)"""
    needs = []
    if cfg.checkpoint.enable:
        needs.append(("numpy", "checkpoint.enable = true (DCP checkpoints)", "pip install numpy"))
    if cfg.checkpoint.export_safetensors:
        needs.append(("safetensors", "checkpoint.export_safetensors = true", _EXTRA))
    if cfg.metrics.wandb:
        needs.append(("wandb", "metrics.wandb = true (Weights & Biases)", "pip install wandb"))
    problems = []
    for module, why, fix in needs:
        try:
            importlib.import_module(module)
        except ImportError as e:
            problems.append(f"{why} needs the package {module!r}, which does not import "
                            f"({e}); {fix}, or turn the option off")
    return problems


def unwritable(folder: Path, key: str, probe_name: str) -> str | None:
    """A problem if ``folder`` cannot be created or written (creates it otherwise)."""
    probe = folder / probe_name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return (f"{key} = {str(folder)!r} is not writable ({e.strerror or e}); choose a "
                f"folder this job may write to")
    return None


def overwrites_metrics(cfg: JobConfig) -> str | None:
    """A problem if a run without --resume would overwrite an earlier run's metrics.csv."""
    csv = Path(cfg.metrics.output_dir) / "metrics.csv"
    if cfg.checkpoint.resume or not csv.is_file() or csv.stat().st_size == 0:
        return None
    return (f"{csv} holds the metrics of an earlier run; pass --resume (with "
            f"--checkpoint.enable true) to continue that run, or choose another "
            f"--metrics.output_dir (or delete the file) to start afresh")


def too_little_space(folder: Path, needed_bytes: float) -> str | None:
    """A problem if ``folder``'s file system has less free space than ``needed_bytes``."""
    free = shutil.disk_usage(folder).free
    if free >= needed_bytes:
        return None
    return (f"checkpoint.folder = {str(folder)!r} has {free / 2**30:.2f} GiB free, but one "
            f"checkpoint needs about {needed_bytes / 2**30:.2f} GiB (parameters and AdamW "
            f"state); free space, or point --checkpoint.folder at a larger disk")


def before_build(cfg: JobConfig, ckpt_folder: Path, rank: int) -> None:
    """Packages, writable folders, no overwritten metrics; leftover ``.tmp`` saves go."""
    problems = missing_packages(cfg)
    if rank == 0:
        problems += [p for p in (
            unwritable(Path(cfg.metrics.output_dir), "metrics.output_dir", ".write-probe"),
            overwrites_metrics(cfg)) if p]
    if cfg.checkpoint.enable:  # every rank writes its own shards there
        problem = unwritable(ckpt_folder, "checkpoint.folder", f".write-probe-rank{rank}")
        problems += [problem] if problem else []
    agree(problems)
    if cfg.checkpoint.enable and rank == 0:
        for path in remove_partial(ckpt_folder):
            print(f"[simplefsdp] removed {path}, left by a save that did not finish",
                  flush=True)


def checkpoint_space(params: list[torch.nn.Parameter], folder: Path, rank: int,
                     trainable: list[torch.nn.Parameter] | None = None) -> str | None:
    """Free space vs one checkpoint: parameters plus AdamW's two states of the
    ``trainable`` ones (default: all; LoRA: the adapters), all ranks."""
    trainable = params if trainable is None else trainable
    local = sharded_param_bytes(params) + optimizer_state_bytes(OPTIMIZER, trainable)
    total = torch.tensor(float(local), dtype=torch.float64)
    dist.all_reduce(total)
    return too_little_space(folder, float(total)) if rank == 0 else None
