"""DCP's staging of an asynchronous save across torch versions.

torch 2.11's ``DefaultStager`` closes its state-dict copier after every stage, which
empties the copier's dispatch table: the second ``async_save`` through the same stager
fails inside the copy (``KeyError: <class 'type'>``) and the checkpoint is lost. torch
2.13 keeps the table. Whether this torch's stager survives a stage is probed once, on a
tiny state, so no version list has to be kept here.
"""
from __future__ import annotations

import functools

from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


@functools.cache
def stager_stages_twice() -> bool:
    """True when one ``DefaultStager`` can stage more than one state dict (2.13);
    False where each save needs a stager of its own (2.11)."""
    stager = DefaultStager(StagingOptions(
        use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
        use_non_blocking_copy=False))
    try:
        for _ in range(2):
            stager.stage({"state": {"step": 1}})
        return True
    except KeyError:
        return False
    finally:
        stager.close()
