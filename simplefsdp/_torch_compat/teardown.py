"""Tearing down the process groups torch objects keep alive (private DeviceMesh state)."""
from __future__ import annotations

import torch


def destroy_library(lib: torch.library.Library) -> None:
    """Remove the registrations of a ``torch.library.Library``. checked: 2.13."""
    lib._destroy()


def release_mesh_groups() -> int:
    """After ``destroy_process_group``: drop the process groups that DeviceMesh objects
    still hold, and return how many were dropped.

    A mesh keeps its groups in ``DeviceMesh._pg_registry`` (checked: 2.13; older
    releases resolve groups by name and hold none), and DTensor's sharding caches keep
    meshes alive after the model is gone, so ``destroy_process_group`` alone leaves every
    mesh group's backend alive (on gloo: its worker and transport threads) until the
    interpreter exits. Dropping the last reference here destroys each backend now,
    joining its threads while the interpreter is whole. Every group is already destroyed
    when this runs, so no mesh was usable anyway."""
    import gc

    from torch.distributed.device_mesh import DeviceMesh

    dropped = 0
    # the object's own type, not isinstance: isinstance reads ``__class__``, which a
    # weakref.proxy forwards to its referent, and one whose referent is gone raises
    # ReferenceError (compiled graphs under activation checkpointing leave such proxies)
    meshes = [obj for obj in gc.get_objects() if issubclass(type(obj), DeviceMesh)]
    for mesh in meshes:
        registry = getattr(mesh, "_pg_registry", None)
        if registry:
            dropped += len(registry)
            registry.clear()
    return dropped
