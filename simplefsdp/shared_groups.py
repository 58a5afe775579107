"""Process groups built once per process: one mesh per layout, one set of pipeline stage
groups per mesh.

Each mesh creates a process group per dim (on gloo a transport thread that wakes every
10 ms for as long as the group lives; on NCCL communicators that hold GPU memory), and
torch keeps every group until the default one is destroyed. So a second model, a compiled
copy or a trainer run again in the same process (tests, notebooks, sweeps) takes the
first one's mesh and groups instead of adding its own. Both are held for good, not
weakly: whether a mesh is reused must not depend on when a garbage collection ran, which
differs between ranks (building one is collective). A mesh built over a process group
since destroyed is never handed out again. Nothing is stored on the mesh objects
themselves: Inductor pickles meshes into its cache keys.
"""

from __future__ import annotations

import datetime
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# layout -> (the process group it was built over, weakly; the mesh)
_MESHES: dict[tuple, tuple[weakref.ref, DeviceMesh]] = {}
# (id(mesh), timeout) -> (the mesh, weakly; this rank's stage group)
_STAGE_GROUPS: dict[tuple, tuple[weakref.ref, dist.ProcessGroup]] = {}


def shared_mesh(device_type: str, ranks: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """The mesh of ``ranks`` (dims ``names``) over the current process group: the one this
    process built before for the same layout, else a new one (collective)."""
    world = dist.group.WORLD
    if world is None:  # no process group: DeviceMesh raises its own error
        return DeviceMesh(device_type, ranks, mesh_dim_names=names)
    key = (device_type, names, tuple(ranks.shape), tuple(ranks.flatten().tolist()))
    built_over, mesh = _MESHES.get(key, (None, None))
    if mesh is None or built_over() is not world:
        mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names)
        _MESHES[key] = weakref.ref(world), mesh
    return mesh


def stage_group(mesh: DeviceMesh, timeout: datetime.timedelta | None = None
                ) -> dist.ProcessGroup | None:
    """This rank's pipeline stage (the ranks sharing its ``pp`` coordinate) as a process
    group, or None without pipeline parallelism (all ranks are then one stage).
    Collective the first time for a mesh and ``timeout``: every rank creates every stage's
    group, in the same order; later calls return the same group."""
    names = mesh.mesh_dim_names or ()
    if "pp" not in names or mesh["pp"].size() == 1:
        return None
    key = (id(mesh), timeout)
    made_for, mine = _STAGE_GROUPS.get(key, (None, None))
    if mine is None or made_for() is not mesh:
        stages = mesh.mesh.movedim(names.index("pp"), 0).flatten(1).tolist()
        for ranks in stages:
            group = dist.new_group(ranks, timeout=timeout)
            if dist.get_rank() in ranks:
                mine = group
        _STAGE_GROUPS[key] = weakref.ref(mesh), mine
    return mine
