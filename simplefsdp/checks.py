"""Checks :func:`simplefsdp.data_parallel` runs before sharding anything.

Mistakes that would otherwise surface much later, as an unrelated error deep inside a
collective or DTensor: a model already wrapped by another data-parallel wrapper, and a
model that differs across ranks (a shape or dtype that depends on the rank makes the
first all-gather mismatch, and gloo only says "collective mismatch").
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def check_model(model: nn.Module, mesh: DeviceMesh) -> None:
    """Raise if ``model`` is already wrapped, or if its parameters differ across the
    ranks of ``mesh`` (one object all-gather per mesh dim of more than one rank)."""
    check_not_wrapped(model)
    check_same_parameters(model, mesh)


def _wrappers() -> list[tuple[type, str]]:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    return [(FSDPModule, "FSDP2 (torch.distributed.fsdp.fully_shard)"),
            (FullyShardedDataParallel, "FSDP1 (FullyShardedDataParallel)"),
            (DistributedDataParallel, "DDP (DistributedDataParallel)")]


def check_not_wrapped(model: nn.Module) -> None:
    """Raise a TypeError if ``model`` or a submodule is wrapped by FSDP2, FSDP1 or DDP."""
    wrappers = _wrappers()
    for name, module in model.named_modules():
        for cls, what in wrappers:
            if isinstance(module, cls):
                where = f"its submodule {name!r}" if name else "the model"
                raise TypeError(f"data_parallel: {where} is already wrapped by {what}; "
                                f"apply data_parallel to the plain model instead of, not on "
                                f"top of, another data-parallel wrapper")


def _describe(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."))
            for name, p in model.named_parameters()]


def check_same_parameters(model: nn.Module, mesh: DeviceMesh) -> None:
    """Raise a ValueError naming the first parameter whose name, shape or dtype differs
    between ranks of ``mesh``. Every rank gets the same lists, so every rank raises."""
    if not dist.is_initialized():
        return
    mine = _describe(model)
    for dim in range(mesh.ndim):
        if mesh.size(dim) == 1:
            continue
        group = mesh.get_group(dim)
        ranks = dist.get_process_group_ranks(group)
        everyone: list[Any] = [None] * len(ranks)
        dist.all_gather_object(everyone, mine, group=group)
        problem = _first_difference(everyone, ranks)
        if problem:
            raise ValueError(f"data_parallel: the model differs across ranks: {problem}; "
                             f"every rank must build the same model (same names, shapes "
                             f"and dtypes) before data_parallel")


def _first_difference(everyone: list[list[tuple]], ranks: list[int]) -> str | None:
    base = {name: (shape, dtype) for name, shape, dtype in everyone[0]}
    for rank, described in zip(ranks[1:], everyone[1:], strict=True):
        theirs = {name: (shape, dtype) for name, shape, dtype in described}
        for name in [*base, *theirs]:
            if name not in theirs:
                return f"parameter {name!r} exists on rank {ranks[0]} but not on rank {rank}"
            if name not in base:
                return f"parameter {name!r} exists on rank {rank} but not on rank {ranks[0]}"
            if base[name] != theirs[name]:
                (s0, d0), (s1, d1) = base[name], theirs[name]
                return (f"parameter {name!r} is {list(s0)} {d0} on rank {ranks[0]} but "
                        f"{list(s1)} {d1} on rank {rank}")
    return None


def check_ignored(model: nn.Module, ignored_params: Set[nn.Parameter] | None) -> set[int]:
    """The ids of ``ignored_params``; each must be one of ``model``'s parameters."""
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, Set):
        raise TypeError(f"ignored_params must be a set of the model's parameters, got "
                        f"{type(ignored_params).__name__}")
    own = {id(p) for p in model.parameters()}
    strangers = [p for p in ignored_params if id(p) not in own]
    if strangers:
        raise ValueError(f"ignored_params holds {len(strangers)} tensor(s) that are not "
                         f"parameters of this model (shape {tuple(strangers[0].shape)}); pass "
                         f"the model's own parameters, e.g. {{model.norm.weight}}")
    return {id(p) for p in ignored_params}
