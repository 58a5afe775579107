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


def check_mesh_sizes(pp: int = 1, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1,
                     prefix: str = "") -> None:
    """Raise a ValueError unless every size is a positive integer (``dp_shard`` may be -1,
    the rest of the world size). Needs no world size, so a config can check it at load.

    ``prefix`` is how the caller's settings spell the sizes: ``"parallel."`` for the
    trainer's ``[parallel]`` section, empty for keyword arguments."""
    for name, size in (("pp", pp), ("dp_replicate", dp_replicate), ("dp_shard", dp_shard),
                       ("tp", tp)):
        rest = name == "dp_shard" and size == -1
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and not rest):
            extra = " or -1 (the rest of the world size)" if name == "dp_shard" else ""
            raise ValueError(f"{prefix}{name} = {size!r} is out of range: it must be a "
                             f"positive integer{extra}")


def mesh_sizes(world_size: int, pp: int = 1, dp_replicate: int = 1, dp_shard: int = -1,
               tp: int = 1, prefix: str = "") -> dict[str, int]:
    """The checked sizes ``{"pp", "dp_replicate", "dp_shard", "tp"}`` of a mesh over
    ``world_size`` ranks, ``dp_shard = -1`` filled in with the rest. A pure function: the
    ValueError (named with ``prefix``, see ``check_mesh_sizes``) says what to change."""
    check_mesh_sizes(pp, dp_replicate, dp_shard, tp, prefix)
    rest = pp * dp_replicate * tp
    if dp_shard == -1:
        if world_size % rest:
            raise ValueError(
                f"world size {world_size} is not divisible by {prefix}pp * {prefix}dp_replicate"
                f" * {prefix}tp = {pp} * {dp_replicate} * {tp} = {rest}; change those sizes "
                f"or the number of processes")
        dp_shard = world_size // rest
    if rest * dp_shard != world_size:
        raise ValueError(
            f"{prefix}pp * {prefix}dp_replicate * {prefix}dp_shard * {prefix}tp = {pp} * "
            f"{dp_replicate} * {dp_shard} * {tp} = {rest * dp_shard}, but the world size is "
            f"{world_size}; set {prefix}dp_shard = -1 to use the rest, or change the sizes")
    return {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp}


def check_dp_mode(mode: str, dp_replicate: int, dp_shard: int, prefix: str = "") -> None:
    """Raise a ValueError if data-parallel ``mode`` cannot run on these sizes:
    ``fully_shard`` shards over ``dp_shard`` alone (``dp_replicate`` must be 1),
    ``replicate`` replicates over ``dp_replicate`` alone (``dp_shard`` must be 1; not
    checked while it is still -1), ``hybrid_shard`` uses both. ``prefix`` as in
    ``check_mesh_sizes``; the mode is ``{prefix}dp_mode``, or ``mode`` without one."""
    mode_key = f"{prefix}dp_mode" if prefix else "mode"
    if mode == "fully_shard" and dp_replicate > 1:
        raise ValueError(f"{mode_key}='fully_shard' shards over {prefix}dp_shard only, but "
                         f"{prefix}dp_replicate = {dp_replicate}; use {mode_key}='hybrid_shard' "
                         f"or set {prefix}dp_replicate = 1")
    if mode == "replicate" and dp_shard > 1:
        raise ValueError(f"{mode_key}='replicate' replicates over {prefix}dp_replicate only, "
                         f"but {prefix}dp_shard = {dp_shard}; set {prefix}dp_shard = 1 and "
                         f"{prefix}dp_replicate = {dp_replicate * dp_shard}, or use "
                         f"{mode_key}='fully_shard' / 'hybrid_shard'")


def make_mesh(dp_shard: int = -1, dp_replicate: int = 1, tp: int = 1, pp: int = 1,
              device_type: str = "cpu") -> DeviceMesh:
    """Build the ``(pp, dp_replicate, dp_shard, tp)`` mesh over all ranks.

    ``dp_shard=-1`` takes whatever the other sizes leave of the world size (see
    ``mesh_sizes``). The process group must already be initialized (``torchrun`` +
    ``dist.init_process_group``).
    """
    if not dist.is_initialized():
        raise RuntimeError("make_mesh needs an initialized process group: call "
                           "torch.distributed.init_process_group first (torchrun sets it up)")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("make_mesh(device_type='cuda'), but CUDA is not available here "
                           "(no GPU, or a CPU-only torch build); use device_type='cpu'")
    sizes = mesh_sizes(dist.get_world_size(), pp, dp_replicate, dp_shard, tp)
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
    check_dp_mode(mode, mesh["dp_replicate"].size(), mesh["dp_shard"].size())
    if mode == "hybrid_shard":
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"] if mode == "fully_shard" else mesh["dp_replicate"]
