"""Every private torch API simplefsdp uses, and every torch-version fallback, in one place.

Each entry says which torch versions it was checked against. The rest of the package
imports these names from here (``tests/test_architecture.py`` keeps it so); public torch
APIs stay where they are used.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes


def disable_current_modes():
    """A context that leaves any active FakeTensorMode / proxy mode: compiler passes run
    inside one, and measurements and collectives must touch real tensors."""
    return _disable_current_modes()


def default_store() -> dist.Store:
    """The default process group's rendezvous store."""
    return dist.distributed_c10d._get_default_store()
