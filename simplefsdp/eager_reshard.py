"""Eager-mode resharding: free gathered parameters after forward, gather again in backward.

Under ``torch.compile`` the selective-checkpoint tags on the all-gather make the
partitioner recompute it in backward. In eager mode a checkpoint region cannot free its
*output*: the gathered parameter is saved by the operator that consumes it (``addmm``
saves its weight). So in eager mode we watch what autograd saves instead:

* every gathered parameter is noted (by storage) while forward runs;
* a ``saved_tensors_hooks`` pack hook replaces a saved view of one by a small recipe
  (the sharded parameter + how to gather it + the view's geometry), so the full copy
  dies with forward's locals;
* the unpack hook gathers it again when backward needs it.

Every rank builds the same autograd graph and backward unpacks in the same order, so
the re-gathers line up across ranks like any other collective.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ._torch_compat import FakeTensor, current_graph_task_id, storage_key

# storage of a live gathered copy (``storage_key``) -> (sharded parameter, re-gather)
_gathered: dict[int, tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]] = {}
_hooks: torch.autograd.graph.saved_tensors_hooks | None = None


@dataclass(frozen=True)
class _Regather:
    sharded: torch.Tensor
    regather: Callable[[torch.Tensor], torch.Tensor]
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


def note_gathered(full: torch.Tensor, sharded: torch.Tensor | None,
                  regather: Callable[[torch.Tensor], torch.Tensor],
                  keep: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Record that ``full`` is the gathered copy of ``sharded`` (forward, eager only):
    backward calls ``regather(sharded)``. With ``keep``, what is held for backward is
    ``keep(full)`` instead (``reshard_after_forward=<int>``: this rank's larger piece,
    sliced now, while the full copy exists), computed only when hooks are on."""
    if _hooks is None or full.untyped_storage().nbytes() == 0:
        return
    if keep is not None:
        with torch.no_grad():
            sharded = keep(full.detach())
    key = storage_key(full)
    _gathered[key] = (sharded, regather)
    # Forget the entry when the copy dies, before its memory can be reused by another
    # tensor (holding `full` itself would keep every gathered copy alive until the end).
    weakref.finalize(full, _gathered.pop, key, None)


def _pack(t: torch.Tensor):
    if isinstance(t, DTensor):  # tensor-parallel activations: their locals are checked
        return t
    # Plain tensors, and the planner's fake ones (``plan/eager.py`` replays this step);
    # not e.g. an AsyncCollectiveTensor (sequence-parallel activations, no storage to read).
    if type(t) not in (torch.Tensor, torch.nn.Parameter, FakeTensor):
        return t
    if t.layout != torch.strided or t.untyped_storage().nbytes() == 0:
        return t
    hit = _gathered.get(storage_key(t))
    if hit is None:
        return t
    return _Regather(hit[0], hit[1], t.size(), t.stride(), t.storage_offset(), t.dtype)


def _unpack(saved):
    if not isinstance(saved, _Regather):
        return saved
    with torch.no_grad():
        full = saved.regather(saved.sharded)
    assert full.dtype == saved.dtype, (full.dtype, saved.dtype)
    return full.as_strided(saved.size, saved.stride, saved.offset)


def start_forward() -> None:
    """Called when the outermost data_parallel forward starts (not in backward)."""
    global _hooks
    if _hooks is None and current_graph_task_id() == -1:
        _hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        _hooks.__enter__()


def end_forward() -> None:
    """Called when the outermost forward ends: stop packing, forget the gathered copies."""
    global _hooks
    if _hooks is not None:
        hooks, _hooks = _hooks, None
        hooks.__exit__(None, None, None)
        _gathered.clear()
