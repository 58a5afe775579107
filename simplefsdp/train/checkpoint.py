"""Training checkpoints: save, find the newest complete one, resume, export.

A checkpoint is ``<folder>/step-<N>`` (``N`` = completed steps; ``folder`` is resolved
by :func:`checkpoint_dir`, under the output directory), written with
``simplefsdp.save_checkpoint``, which writes ``step-<N>.tmp`` and renames it only once
every rank has finished: a crash mid-save leaves a ``.tmp`` folder that is never
mistaken for a checkpoint, and the previous one stays the newest complete.

It holds everything a resumed run needs to continue bit for bit:

* ``app``: model and optimizer, sharded (``ModelAndOptimizer``, keyed by parameter name);
* ``trainer``: step, LR scheduler, data loader position (the same on every rank);
* ``rng/rank<r>``: each rank's torch CPU (and CUDA) generator state. Keys are per rank,
  because DCP would otherwise keep one copy of a value that is the same key everywhere.

Resuming is explicit (:func:`resume_point`): with ``checkpoint.resume = true``
(``--resume``) a run continues from the newest complete checkpoint in its folder, or
starts from step 0 with a note if there is none. Without it, a folder that already
holds a complete checkpoint is refused at start-up, before anything is built, so two
runs are never mixed in one folder and no checkpoint is overwritten by accident.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful

import simplefsdp
from simplefsdp.state_dict import ModelAndOptimizer, is_complete

from .config import ConfigError

_STEP_DIR = re.compile(r"^step-(\d+)$")


class TrainerState(Stateful):
    """Step, LR scheduler and data loader position as one DCP ``Stateful``."""

    def __init__(self, scheduler, loader):
        self.step = 0
        self.scheduler, self.loader = scheduler, loader

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "scheduler": self.scheduler.state_dict(),
                "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])


class RNGState(Stateful):
    """This rank's generator states (CPU, and CUDA when present)."""

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def checkpoint_dir(folder: str | Path, output_dir: str | Path) -> Path:
    """Where checkpoints go: an absolute ``folder`` as is; a relative one under
    ``output_dir`` (the default ``checkpoints`` is ``outputs/checkpoints``), unless it
    already starts with it (``outputs/x/checkpoints`` with ``output_dir = "outputs/x"``
    stays as it is)."""
    folder, output_dir = Path(folder), Path(output_dir)
    if folder.is_absolute() or folder.parts[:len(output_dir.parts)] == output_dir.parts:
        return folder
    return output_dir / folder


def list_checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``folder`` as (step, path), oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and is_complete(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(folder: str | Path) -> tuple[int, Path] | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None


def resume_point(folder: str | Path, resume: bool) -> Path | None:
    """The checkpoint to start from: the newest complete one in ``folder`` if ``resume``,
    else None. A collective: rank 0 looks and broadcasts its choice, so every rank
    decides alike (and raises alike) even if a checkpoint completes while they look.

    Raises a ConfigError if ``folder`` holds a complete checkpoint and ``resume`` is off.
    """
    looks = not dist.is_initialized() or dist.get_rank() == 0
    found = latest_checkpoint(folder) if looks else None
    choice = [str(found[1]) if found else None]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        if resume and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"[simplefsdp] --resume: no complete checkpoint in {folder}; starting "
                  f"from step 0", flush=True)
        return None
    if not resume:
        raise ConfigError(
            f"{folder} already holds a complete checkpoint ({Path(choice[0]).name}) from an "
            f"earlier run; pass --resume (checkpoint.resume = true) to continue from it, "
            f"or choose another --checkpoint.folder (or --metrics.output_dir) to start afresh")
    return Path(choice[0])


class CheckpointManager:
    """Saves every ``every`` steps, keeps the newest ``keep_latest``, resumes."""

    def __init__(self, folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 trainer_state: TrainerState, every: int, keep_latest: int):
        self.folder = Path(folder)
        self.every, self.keep_latest = every, keep_latest
        self.trainer_state = trainer_state
        self.app = ModelAndOptimizer(model, optimizer)
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def _state(self, with_rng: bool = True) -> dict[str, Any]:
        state: dict[str, Any] = {"app": self.app, "trainer": self.trainer_state}
        if with_rng:
            state[f"rng/rank{self.rank}"] = RNGState()
        return state

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int) -> Path:
        """Save after ``step`` completed steps (a collective: every rank calls it)."""
        self.trainer_state.step = step
        path = simplefsdp.save_checkpoint(self.folder / f"step-{step}", self._state())
        if self.rank == 0:
            self._prune()
        return path

    def _prune(self) -> None:
        if self.keep_latest <= 0:
            return
        for _, path in list_checkpoints(self.folder)[:-self.keep_latest]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: str | Path) -> int:
        """Load the checkpoint at ``path`` (from :func:`resume_point`, the same on every
        rank) into the model, optimizer, trainer state and RNG; returns its step."""
        path = Path(path)
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        # RNG states are per rank: load ours if this checkpoint has it (same world size).
        with_rng = any(k.startswith(f"rng/rank{self.rank}.") for k in keys)
        simplefsdp.load_checkpoint(path, self._state(with_rng))
        return self.trainer_state.step


def export_safetensors(model: nn.Module, path: str | Path,
                       pp_group: dist.ProcessGroup | None = None) -> Path | None:
    """Global rank 0 writes the consolidated model (a collective: every rank calls it).

    A tied weight (``output.weight`` is ``tok_embeddings.weight``) is written once; the
    file's metadata records ``tied:output.weight = tok_embeddings.weight``.

    With pipeline stages (``pp_group`` of more than one rank) each stage's leading rank
    consolidates its stage and sends it to rank 0, which merges the stages' keys.
    """
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    pp = dist.get_world_size(pp_group) if pp_group is not None else 1
    if pp == 1:
        full = simplefsdp.full_state_dict(model)
    else:
        # Every rank of a stage gathers the stage; rank 0's pipeline peers send theirs.
        full = simplefsdp.full_state_dict(model, rank0_only=False)
        # The ranks that share global rank 0's data/tensor-parallel coordinates form
        # its PP group: exactly one rank per stage.
        if 0 in dist.get_process_group_ranks(pp_group):
            stages: list[Any] | None = [None] * pp if rank == 0 else None
            dist.gather_object(full, stages, dst=0, group=pp_group)
            if rank == 0:
                full = {k: v for stage in stages for k, v in stage.items()}
    if rank != 0:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, tied, seen = {}, {}, {}
    for key, value in full.items():  # a tied weight is stored once, its alias noted
        ptr = value.untyped_storage().data_ptr()
        if ptr in seen and full[seen[ptr]].shape == value.shape:
            tied[key] = seen[ptr]
            continue
        seen[ptr] = key
        tensors[key] = value.contiguous()
    metadata = {"format": "pt", **{f"tied:{k}": v for k, v in tied.items()}}
    save_file(tensors, str(path), metadata=metadata)
    return path
