"""Device meshes from parallelism sizes.

One mesh with named dims ``("pp", "dp_replicate", "dp_shard", "tp")``; dims of size 1
are kept so that ``mesh["dp_shard"]`` always exists. ``data_parallel`` picks the
data-parallel dims it needs from it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def make_mesh(dp_shard: int = -1, dp_replicate: int = 1, tp: int = 1, pp: int = 1,
              device_type: str = "cpu") -> DeviceMesh:
    """Build the ``(pp, dp_replicate, dp_shard, tp)`` mesh over all ranks.

    ``dp_shard=-1`` takes whatever the other sizes leave of the world size. The process
    group must already be initialized (``torchrun`` + ``dist.init_process_group``).
    """
    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs an initialized process group: call "
                           "torch.distributed.init_process_group first (torchrun sets it up)")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("make_mesh(device_type='cuda'), but CUDA is not available here "
                           "(no GPU, or a CPU-only torch build); use device_type='cpu'")
    world = dist.get_world_size()
    sizes = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}
    for name, size in sizes.items():
        if not isinstance(size, int) or (size < 1 and not (name == "dp_shard" and size == -1)):
            raise ValueError(f"{name} must be a positive integer (dp_shard may be -1), "
                             f"got {size!r}")
    if dp_shard == -1:
        rest = pp * dp_replicate * tp
        if world % rest:
            raise ValueError(f"world size {world} is not divisible by pp*dp_replicate*tp = {rest}")
        sizes["dp_shard"] = world // rest
    product = sizes["pp"] * sizes["dp_replicate"] * sizes["dp_shard"] * sizes["tp"]
    if product != world:
        detail = " x ".join(f"{n}={s}" for n, s in sizes.items())
        raise ValueError(f"mesh {detail} = {product} ranks, but the world size is {world}; "
                         f"make the product equal the number of processes")
    return init_device_mesh(device_type, tuple(sizes[d] for d in MESH_DIMS),
                            mesh_dim_names=MESH_DIMS)


def stage_group(mesh: DeviceMesh, timeout: datetime.timedelta | None = None
                ) -> dist.ProcessGroup | None:
    """This rank's pipeline stage (the ranks sharing its ``pp`` coordinate) as a process
    group, or None without pipeline parallelism (all ranks are then one stage).
    Collective: every rank creates every stage's group, in the same order."""
    names = mesh.mesh_dim_names or ()
    if "pp" not in names or mesh["pp"].size() == 1:
        return None
    stages = mesh.mesh.movedim(names.index("pp"), 0).flatten(1).tolist()
    mine = None
    for ranks in stages:
        group = dist.new_group(ranks, timeout=timeout)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def data_parallel_mesh(mesh: DeviceMesh, mode: str) -> DeviceMesh:
    """The sub-mesh ``mode`` runs on: ``dp_shard`` for fully_shard, ``dp_replicate`` for
    replicate, both for hybrid_shard. A mesh without our dim names is used as given."""
    names = mesh.mesh_dim_names or ()
    if not {"dp_replicate", "dp_shard"} <= set(names):
        return mesh
    replicate, shard = mesh["dp_replicate"].size(), mesh["dp_shard"].size()
    if mode == "hybrid_shard":
        return mesh["dp_replicate", "dp_shard"]
    if mode == "fully_shard":
        if replicate > 1:
            raise ValueError(f"mode='fully_shard' shards over dp_shard, but dp_replicate="
                             f"{replicate}; use mode='hybrid_shard' or set dp_replicate=1")
        return mesh["dp_shard"]
    if shard > 1:  # replicate
        raise ValueError(f"mode='replicate' replicates over dp_replicate, but dp_shard={shard}; "
                         f"build the mesh with dp_replicate=N, dp_shard=1")
    return mesh["dp_replicate"]
