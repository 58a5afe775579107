"""A CPU kernel for the functional all-gather that takes gloo's plain all-gather path.

A process-wide runtime change: :func:`simplefsdp.data_parallel` installs it when its mesh
runs CPU collectives on gloo, and it stays in effect for every later all-gather of the
process (eager, DTensor and compiled alike) until :func:`uninstall_gloo_collectives`.
It is an eager kernel, not a compiler pass, so it lives outside ``compiler/``.

``torch.ops._c10d_functional.all_gather_into_tensor`` (what ``DTensor.redistribute``,
``funcol.all_gather_tensor`` and compiled graphs call) has one C++ kernel, registered
as ``CompositeExplicitAutograd``: it wraps the input in a one-element list and calls
``ProcessGroup.allgather_into_tensor_coalesced``. On gloo that is the *coalesced*
all-gather (``allgather_coalesced``: flatten the inputs, gather into a temporary flat
buffer, copy out into per-rank views on a gloo worker thread), not the plain
``_allgather_base`` that ``dist.all_gather_into_tensor`` uses. Several of those in
flight at once were reported to abort the process on gloo (heap corruption), and our
reordering pass keeps several all-gathers in flight on purpose.

:func:`install_gloo_collectives` registers a ``CPU`` kernel for the op (a CPU kernel
takes precedence over the composite one for CPU tensors; CUDA, Meta/fake tensors and
autograd are untouched). For a process group whose CPU backend is gloo it allocates
the output, starts ``ProcessGroup._allgather_base`` and registers the returned Work on
the output, so ``_c10d_functional.wait_tensor`` waits for it exactly as it waits for
the original op. Any other backend gets the original behaviour.

``all_gather_into_tensor_out`` already uses ``_allgather_base``; ``all_reduce`` uses
the plain ``allreduce``; ``reduce_scatter_tensor`` goes through gloo's
``reduce_scatter_tensor_coalesced`` (one ``allreduce`` per tensor, copied out on
``wait``), which is also what ``dist.reduce_scatter_tensor`` uses on gloo, so there is
no other path to switch to. See ``tests/test_gloo_collectives.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._torch_compat import (
    allgather_base,
    backend_name,
    c10d_functional,
    default_group,
    destroy_library,
    register_work,
    resolve_process_group,
)
from ._torch_compat.internals import C10D_FUNCTIONAL

__all__ = ["install_gloo_collectives", "installed", "uninstall_gloo_collectives", "uses_gloo"]

_CPU = torch.device("cpu")
# The registration lives as long as this Library object; torch keeps such objects at
# module scope (see torch/distributed/_functional_collectives.py).
_lib: torch.library.Library | None = None


def _is_gloo(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg`` runs CPU tensors on gloo (also for ``cpu:gloo,cuda:nccl`` groups)."""
    return backend_name(pg, _CPU) == "gloo"


def uses_gloo(group_or_mesh: DeviceMesh | dist.ProcessGroup | str | None = None) -> bool:
    """True if CPU collectives on ``group_or_mesh`` run on gloo.

    Takes a DeviceMesh (true if any of its dims' groups is gloo), a ProcessGroup, a
    group name, or None for the default group.
    """
    if not dist.is_initialized():
        return False
    if group_or_mesh is None:
        groups = [default_group()]
    elif isinstance(group_or_mesh, DeviceMesh):
        groups = group_or_mesh.get_all_groups()
    else:
        groups = [resolve_process_group(group_or_mesh)]
    return any(_is_gloo(pg) for pg in groups)


def _all_gather_into_tensor_cpu(input: torch.Tensor, group_size: int,
                                group_name: dist.ProcessGroup | str) -> torch.Tensor:
    """``_c10d_functional::all_gather_into_tensor`` for CPU tensors (see module doc)."""
    pg = resolve_process_group(group_name)
    if not _is_gloo(pg):  # exactly what the C++ kernel does
        real = torch.view_as_real(input) if input.is_complex() else input
        out = c10d_functional.all_gather_into_tensor_coalesced.default(
            [real], group_size, group_name)[0]
        return torch.view_as_complex(out) if input.is_complex() else out
    if not input.is_contiguous():  # same contract as the C++ kernel
        raise RuntimeError("all_gather_into_tensor: the input must be contiguous")
    real = torch.view_as_real(input) if input.is_complex() else input
    if real.dim() == 0:  # a scalar gathers into shape [group_size]
        real = real.reshape(1)
    out = real.new_empty((group_size * real.shape[0], *real.shape[1:]))
    work = allgather_base(pg, out, real)
    register_work(out, work)  # wait_tensor(out) pops and waits for it
    return torch.view_as_complex(out) if input.is_complex() else out


def install_gloo_collectives() -> None:
    """Register the CPU all-gather kernel above; idempotent.

    Only the ``CPU`` dispatch key is touched, so CUDA/NCCL collectives are unaffected,
    and CPU collectives on other backends keep the original kernel.
    """
    global _lib
    if _lib is not None:
        return
    lib = torch.library.Library(C10D_FUNCTIONAL, "IMPL")
    lib.impl("all_gather_into_tensor", _all_gather_into_tensor_cpu, "CPU")
    _lib = lib


def uninstall_gloo_collectives() -> None:
    """Remove the kernel again (for tests); a no-op when it is not installed."""
    global _lib
    if _lib is not None:
        destroy_library(_lib)
        _lib = None


def installed() -> bool:
    """Whether :func:`install_gloo_collectives` is in effect in this process."""
    return _lib is not None
