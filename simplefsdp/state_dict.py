"""State dicts and distributed checkpoints (DCP) for data_parallel models.

``model.state_dict()`` already holds sharded DTensors under the original names; these
helpers add the optimizer (keyed by parameter name), atomic saves, and a full
(consolidated) state dict for export.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor, Shard

from ._torch_compat import StridedShard

_COMPLETE_MARK = ".complete"


class ModelAndOptimizer(Stateful):
    """Model + optimizer as one DCP ``Stateful``: sharded, keyed by parameter name."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        optimizers = [self.optimizer] if self.optimizer is not None else []
        model_sd, optim_sd = get_state_dict(self.model, optimizers)
        state = {"model": model_sd, "optimizer": optim_sd} if optimizers else {"model": model_sd}
        # what load_state_dict must turn back: {path: placements as trained}
        self._relaid = _relayout_for_checkpoint(state)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        optimizers = [self.optimizer] if self.optimizer is not None else []
        for path, placements in getattr(self, "_relaid", {}).items():
            container, key = _container(state_dict, path)
            value = container[key]
            container[key] = value.redistribute(value.device_mesh, placements)
        set_state_dict(self.model, optimizers, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict.get("optimizer", {}))


def checkpoint_placements(value: DTensor) -> tuple | None:
    """Placements DCP can save ``value`` in, or None when its own can be: DCP writes each
    rank's piece as one box of the global tensor, and a ``StridedShard`` that no later
    mesh dim completes (the count of pieces later dims cut its tensor dim into is not its
    split factor) leaves several boxes per rank, e.g. expert tensor parallelism's
    ``gate_up_proj`` (``parallel/expert_tensor.py``: a gate slice and an up slice). Such
    a placement becomes a plain ``Shard`` of the same dim (same bytes per rank)."""
    placements, changed = list(value.placements), False
    for i, placement in enumerate(placements):
        if not isinstance(placement, StridedShard):
            continue
        later = 1
        for j in range(i + 1, len(placements)):
            other = placements[j]
            if isinstance(other, (Shard, StridedShard)) and other.dim == placement.dim:
                later *= value.device_mesh.size(j)
        if later != placement.split_factor:
            placements[i], changed = Shard(placement.dim), True
    return tuple(placements) if changed else None


def _relayout_for_checkpoint(state: Any, path: tuple = ()) -> dict[tuple, tuple]:
    """Every DTensor in the nested ``state`` that DCP cannot save as it is laid out
    (:func:`checkpoint_placements`) replaced, in place, by a copy it can (a
    redistribution, one tensor at a time); returns ``{path: original placements}``."""
    relaid = {}
    items = state.items() if isinstance(state, dict) else \
        enumerate(state) if isinstance(state, list) else ()
    for key, value in list(items):
        if isinstance(value, DTensor):
            saveable = _in_checkpoint_layout(value)
            if saveable is not value:
                relaid[(*path, key)] = value.placements
                state[key] = saveable
        else:
            relaid.update(_relayout_for_checkpoint(value, (*path, key)))
    return relaid


def _container(state: Any, path: tuple) -> tuple[Any, Any]:
    """The container holding ``path``'s value in the nested ``state``, and its key."""
    for key in path[:-1]:
        state = state[key]
    return state, path[-1]


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Save ``state`` (values may be ``Stateful``) with DCP, atomically.

    Every rank writes into ``<path>.tmp``; after a barrier rank 0 marks it complete and
    renames it to ``path``. A crash before the rename leaves no folder named ``path``,
    so a half-written checkpoint never looks complete. The two halves are
    :func:`begin_save` and :func:`commit_save` (an asynchronous save writes in between).
    """
    tmp = begin_save(path)
    dcp.save(state, checkpoint_id=str(tmp))
    return commit_save(path)


def begin_save(path: str | os.PathLike) -> Path:
    """The ``<path>.tmp`` folder a save writes into, emptied on rank 0 (a collective)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    return tmp


def commit_save(path: str | os.PathLike) -> Path:
    """Once every rank's DCP write into ``<path>.tmp`` has finished: rank 0 marks it
    complete and renames it to ``path`` (a collective)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    _barrier()
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        (tmp / _COMPLETE_MARK).touch()
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    _barrier()
    return path


def load_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``state`` in place."""
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (missing or half-written)")
    dcp.load(state, checkpoint_id=str(path))


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / _COMPLETE_MARK).is_file()


_WRAPPERS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module",
                       "base_layer"})


def unwrapped_name(name: str) -> str:
    """``name`` (a parameter or module FQN) without the components wrappers add:
    torch.compile's ``_orig_mod``, activation checkpointing's
    ``_checkpoint_wrapped_module``, FSDP1's ``_fsdp_wrapped_module`` and the
    ``base_layer`` of a layer peft's LoRA adapts (``models/lora.py``). The model's own
    name, the same however it is wrapped."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


@torch.no_grad()
def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Gather every parameter and buffer to full CPU tensors (a collective on all ranks).

    With ``rank0_only`` the other ranks get an empty dict (what an export needs);
    otherwise every rank gets the whole dict. Tensors are gathered one at a time and
    copied to the CPU at once, so a device never holds more than one full tensor. A
    parameter with two names (tied weights) is gathered once and both names share the
    copy; that is decided from the module structure, so every rank runs the same
    collectives. Keys are the model's own names (compile/checkpoint wrappers removed).
    """
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    gathered: dict[int, torch.Tensor | None] = {}  # id(parameter or buffer) -> full copy
    full: dict[str, torch.Tensor] = {}
    # keep_vars: the parameters themselves, so a tied weight is one object under two names.
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in gathered:
            whole = _full_tensor(value) if isinstance(value, DTensor) else value
            # A copy: with one rank the full tensor can be the parameter's own storage.
            gathered[id(value)] = whole.detach().to("cpu", copy=True) if keep else None
        if keep:
            full[unwrapped_name(key)] = gathered[id(value)]
    return full


def _full_tensor(value: DTensor) -> torch.Tensor:
    """``value.full_tensor()``, by way of :func:`checkpoint_placements` where it applies:
    torch 2.13's gather of a strided shard on one dim next to a strided shard on another
    (expert tensor parallelism's ``gate_up`` sharded over ``dp_shard`` and ``ep`` too)
    fails to unpad, while the plain ``Shard`` layout gathers."""
    return _in_checkpoint_layout(value).full_tensor()


def _in_checkpoint_layout(value: DTensor) -> DTensor:
    """``value`` redistributed to :func:`checkpoint_placements` where they apply, else
    ``value`` itself."""
    placements = checkpoint_placements(value)
    return value if placements is None else value.redistribute(value.device_mesh, placements)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
