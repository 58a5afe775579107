"""How a checkpoint's DCP files are written: ``checkpoint.async_mode``.

* ``sync``: ``dcp.save`` on the training thread; training waits for the whole write.
* ``async``: ``dcp.async_save``: the training thread only *stages* the state (a copy
  into host memory, so the next steps may change the parameters and optimizer state),
  then a background thread writes the files while training goes on.
* ``async_pinned``: the same with page-locked (pinned) staging buffers, which a GPU
  copies into by DMA and which torch keeps from one save to the next (torch 2.11's
  stager stages once: there each save gets a new one). On a CPU-only
  machine there is nothing to pin (no device copy): torch ignores the flag with a
  warning and the staging is a plain host copy, as in ``async``.

The background write runs DCP's own collectives (planning, the write results) on a
process group of its own (gloo, created at start-up on every rank), never on the one
training uses: two threads issuing collectives on one group would interleave them.
Completing a save (the rename to ``step-<N>`` and the manifest) is a collective on the
training thread, done by ``CheckpointManager`` once every rank's write has finished.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

AsyncMode = Literal["sync", "async", "async_pinned"]


class CheckpointWriter:
    """Writes a state dict into a folder, now or in the background (``mode``)."""

    def __init__(self, mode: AsyncMode = "sync"):
        self.mode = mode
        self.group = None
        self.stager = None
        if mode != "sync":
            if dist.is_initialized():  # a collective: every rank builds its writer
                self.group = dist.new_group(backend="gloo")
            self.stager = _stager(pinned=mode == "async_pinned")

    def start(self, state: dict[str, Any], folder: Path) -> Future | None:
        """Write ``state`` into ``folder``: done on return (``sync``, None), or staged
        on return and written in the background (the future completes when this rank's
        part of the checkpoint is on disk)."""
        if self.stager is None:
            dcp.save(state, checkpoint_id=str(folder))
            return None
        if not stager_stages_twice():  # torch 2.11: a stager stages one save only
            self.stager.close()
            self.stager = _stager(pinned=self.mode == "async_pinned")
        result = dcp.async_save(state, checkpoint_id=str(folder), process_group=self.group,
                                async_stager=self.stager)
        return getattr(result, "upload_completion", result)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


def _stager(pinned: bool) -> DefaultStager:
    """A stager copying on the training thread, into pinned host buffers or not."""
    return DefaultStager(StagingOptions(
        use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False,
        use_non_blocking_copy=False))


@functools.cache
def stager_stages_twice() -> bool:
    """True when one ``DefaultStager`` can stage more than one state dict (torch 2.13);
    False where each save needs a stager of its own. torch 2.11's stager closes its
    state-dict copier after every stage, which empties the copier's dispatch table: the
    second ``async_save`` through it failed inside the copy (``KeyError: <class
    'type'>``) and the checkpoint was lost. Probed once on a tiny state (no version list
    to keep)."""
    stager = _stager(pinned=False)
    try:
        for _ in range(2):
            stager.stage({"state": {"step": 1}})
        return True
    except KeyError:
        return False
    finally:
        stager.close()
