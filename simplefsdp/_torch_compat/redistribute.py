"""DTensor redistribution of ``_StridedShard`` placements that are a shard within a shard
(expert tensor parallelism's layouts), made to plan and run on torch 2.11 as on 2.13."""
from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import _dtensor_spec, _redistribute
from torch.distributed.tensor.placement_types import Replicate, _StridedShard


def _undecodable(spec: _dtensor_spec.DTensorSpec) -> bool:
    """Whether ``spec``'s ``_StridedShard`` placements are meant to encode a shard order
    but do not: ``DTensorSpec._normalize_placements_into_shard_order`` refuses them."""
    return bool(spec.use_strided_shard_as_shard_order) and (
        _dtensor_spec.DTensorSpec._maybe_convert_StridedShard_to_shard_order(
            spec.placements, spec.mesh) is None)


def _needs_replicate_between(current, target) -> bool:
    """The steps torch 2.13's ``redistribute_local_tensor`` runs through Replicate and
    torch 2.11's refuses (NotImplementedError)."""
    if isinstance(target, _StridedShard):
        return current.is_shard() or current.is_partial()
    return isinstance(current, _StridedShard) and target.is_shard()


def _through_replicate(infos: list) -> list:
    """``infos`` with each step :func:`_needs_replicate_between` split in two on its mesh
    dim, ``current -> Replicate -> target``: the same collective and local chunking
    torch 2.13 runs for that step (2.11 runs both halves, with the same arguments)."""
    out = []
    for info in infos:
        current, target = info.src_dst_placements
        if not _needs_replicate_between(current, target):
            out.append(info)
            continue
        for step in ((current, Replicate()), (Replicate(), target)):
            out.append(_redistribute._TransformInfo(
                mesh_dim=info.mesh_dim, src_dst_placements=step,
                logical_shape=info.logical_shape))
    return out


def redistribute_strided_shards_as_2_13() -> bool:
    """Make DTensor plan and run redistributions of ``_StridedShard`` placements that do
    not encode a shard order as torch 2.13 does; returns whether this torch needed it.

    Expert tensor parallelism's layouts, e.g. ``(Replicate(), _StridedShard(1, sf=2))`` or
    ``(_StridedShard(0, sf=2), Shard(0), _StridedShard(1, sf=2))``, are a shard within a
    shard, not a shard order. On torch 2.11 every redistribution of them fails (the full
    state dict, checkpoint saves, DDP and compiled training), in two places of
    ``torch/distributed/tensor/_redistribute.py``:

    1. Planning: ``_gen_transform_infos_non_cached`` sends any redistribution with a
       ``_StridedShard`` to ``DTensorRedistributePlanner.generate_graph_based_transform_infos``,
       which first decodes each ``_StridedShard`` as a shard order and raises ValueError
       for these. torch 2.13 raises ``_StridedShardNotDecodableError`` there and catches
       it to plan with ``generate_greedy_transform_infos`` (the same code in 2.11). Here
       the graph-based planner takes the greedy one for exactly those specs.
    2. Running: the greedy plan holds ``_StridedShard -> Shard`` steps (and can hold
       ``Shard`` or ``Partial -> _StridedShard``), which 2.11's ``redistribute_local_tensor``
       refuses and 2.13's runs through Replicate. Here ``_optimize_transform_infos`` (which
       merges collectives across mesh dims, never a ``_StridedShard`` step) is followed by
       splitting each such step in two through Replicate, so merging sees 2.13's plan.

    Installed for torch before 2.13: both wrappers give what such a torch would compute
    itself where it already has either part. checked: 2.11 (installed), 2.13 (not).
    """
    if torch.__version__ >= "2.13":
        return False
    planner = _redistribute.DTensorRedistributePlanner
    graph_based = planner.generate_graph_based_transform_infos
    if getattr(graph_based, "simplefsdp_wrapped", False):
        return True

    @functools.wraps(graph_based)
    def generate_graph_based_transform_infos(self, src_spec, dst_spec, full_tensor_shape):
        if _undecodable(src_spec) or _undecodable(dst_spec):
            return self.generate_greedy_transform_infos(src_spec, dst_spec)
        return graph_based(self, src_spec, dst_spec, full_tensor_shape)

    optimize = _redistribute._optimize_transform_infos

    @functools.wraps(optimize)
    def optimize_transform_infos(*args, **kwargs):
        return _through_replicate(optimize(*args, **kwargs))

    generate_graph_based_transform_infos.simplefsdp_wrapped = True
    planner.generate_graph_based_transform_infos = generate_graph_based_transform_infos
    _redistribute._optimize_transform_infos = optimize_transform_infos
    return True
