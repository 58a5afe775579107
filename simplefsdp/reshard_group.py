"""``reshard_after_forward=<int>``: after forward keep each parameter sharded over a
smaller group (FSDP2's int, ZeRO++'s hpZ), so backward's all-gather runs inside it.

The data-parallel shard dim of ``S`` ranks is split into ``S / N`` groups of ``N``
neighbouring ranks (the *inner* groups, e.g. a node) and, across them, ``N`` groups of
``S / N`` ranks with the same place in their inner group (the *outer* groups). A
parameter of ``R`` rows is stored as ``Shard(0)``: rank ``r`` holds chunk ``r`` of ``S``
chunks of ``c = ceil(R / S)`` rows. The piece a rank keeps between forward and backward
is the ``S / N`` chunks ``i, i + N, i + 2N, ...`` (``i``: its place in its inner group):
exactly what its outer group holds, so the inner group gathers the whole parameter from
them, and ``N`` ranks together keep one full copy.

* eager: forward gathers on all ``S`` ranks as with ``True``; the kept piece is sliced
  from the gathered copy (no communication) and held by the saved-tensor hooks
  (``eager_reshard``) instead of the full copy; backward gathers it on the inner group.
* compiled: the partitioner can only recompute a value from values the forward graph
  already holds, so forward gathers in two steps with the same bytes as one flat
  gather: the outer group (that piece, saved), then the inner group (the full
  parameter, tagged for recomputation). Backward recomputes only the second step.

Either way the gradient is reduce-scattered over all ``S`` ranks in one collective, as
with ``True``, so the arithmetic is the same. The sub-meshes are built once per
``data_parallel`` call and shared by its parameters (DTensor caches decisions by mesh).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ._torch_compat import c10d_functional
from .mesh import ParallelDims

_OUTER, _INNER = "sf_reshard_outer", "sf_reshard_inner"


def reshard_divisors(shard_size: int) -> list[int]:
    """The valid ints: divisors of the shard dim's size other than 1 and itself."""
    return [n for n in range(2, shard_size) if shard_size % n == 0]


def check_reshard_after_forward(value: object, shard_size: int, mode: str,
                                key: str = "reshard_after_forward") -> bool | int:
    """``value`` as ``data_parallel`` uses it (a bool, or an int group size), or a
    ValueError naming ``key`` and the valid values. ``key`` is how the caller spells it
    (``parallel.reshard_after_forward`` in the trainer)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ValueError(f"{key}={value!r}: pass true, false or an int group size")
    valid = reshard_divisors(shard_size)
    if mode != "fully_shard":
        raise ValueError(f"{key}={value}: an int (reshard to a smaller group) is built for "
                         f"mode 'fully_shard' only, not {mode!r}; use true or false")
    if value not in valid:
        hint = (f"one of {valid}" if valid else
                f"none exists for {shard_size} shard ranks: use true or false")
        raise ValueError(f"{key}={value}: the group size must divide the {shard_size} "
                         f"data-parallel shard ranks and lie strictly between 1 and "
                         f"{shard_size}: {hint}")
    return value


@dataclass(frozen=True)
class ReshardGroup:
    """The inner/outer groups of one ``data_parallel`` call (see the module docstring)."""

    size: int  # N: ranks of an inner group
    outer_size: int  # S / N
    shard_size: int  # S
    place: int  # this rank's place in its inner group
    inner_group: str  # process group names, for the functional collectives
    outer_group: str
    mesh: DeviceMesh  # the (outer, inner) mesh, kept alive with its groups

    @classmethod
    def build(cls, dp_mesh: DeviceMesh, size: int) -> ReshardGroup:
        """Split the 1-D shard mesh into (S / N, N); every rank calls this once."""
        shard_size = dp_mesh.size()
        mesh = dp_mesh._unflatten(0, (shard_size // size, size), (_OUTER, _INNER))
        return cls(size, shard_size // size, shard_size, ParallelDims.local_rank(mesh, 1),
                   mesh.get_group(1).group_name, mesh.get_group(0).group_name, mesh)

    def checkpoint_contexts(self):
        """``context_fn`` for the compiled gather's checkpoint (:func:`two_step_contexts`)."""
        return functools.partial(two_step_contexts, self.outer_group)

    def groups(self) -> tuple[str, str]:
        return self.outer_group, self.inner_group

    def chunk_rows(self, rows: int) -> int:
        return -(-rows // self.shard_size)

    def keep(self, full: torch.Tensor) -> torch.Tensor:
        """The piece this rank keeps, sliced from the gathered parameter (eager)."""
        c = self.chunk_rows(full.shape[0])
        padded = _pad_rows(full, self.shard_size * c)
        grid = padded.view(self.outer_size, self.size, c, *full.shape[1:])
        return grid[:, self.place].reshape(self.outer_size * c, *full.shape[1:]).clone()

    def regather(self, kept: torch.Tensor, rows: int) -> torch.Tensor:
        """The full parameter (``rows`` rows) from each inner-group rank's kept piece."""
        c10d = c10d_functional
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(
            kept.contiguous(), self.size, self.inner_group))
        c = kept.shape[0] // self.outer_size
        rest = kept.shape[1:]
        # gathered is ordered (inner place j, outer index o); chunk o * N + j goes first by o
        grid = gathered.view(self.size, self.outer_size, c, *rest).transpose(0, 1)
        return grid.reshape(self.shard_size * c, *rest).narrow(0, 0, rows)

    def gather_in_two_steps(self, local: torch.Tensor, rows: int) -> torch.Tensor:
        """Compiled forward: the outer group's gather (the kept piece), then the inner's."""
        c10d = c10d_functional
        shard = _pad_rows(local, self.chunk_rows(rows))
        kept = c10d.wait_tensor(c10d.all_gather_into_tensor(
            shard.contiguous(), self.outer_size, self.outer_group))
        return self.regather(kept, rows)


def two_step_contexts(outer_group: str):
    """Selective-checkpoint contexts for :meth:`ReshardGroup.gather_in_two_steps`: save
    the outer gather's result, recompute everything after it (the inner gather and the
    copy that orders its rows), so backward never holds the forward's full copy. A
    module-level function of the group's name (``functools.partial``): Dynamo calls
    ``context_fn`` with no arguments and drops a bound method's ``self``."""
    state = {"outer_pending": False}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func is c10d_functional.all_gather_into_tensor.default:
            state["outer_pending"] = args[2] == outer_group
            return CheckpointPolicy.MUST_RECOMPUTE
        if func is c10d_functional.wait_tensor.default and state["outer_pending"]:
            state["outer_pending"] = False
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


class ReduceScatterGradient(torch.autograd.Function):
    """Identity on ``value`` (the gathered parameter, computed without autograd); its
    gradient is reduce-scattered over all shard ranks into the sharded parameter's
    gradient: the collective DTensor issues for ``Partial -> Shard(0)`` (same padding,
    dtype casts and op), so the result equals ``reshard_after_forward=True``'s."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, sharded: DTensor, group: ReshardGroup,
                reduce_op: str, reduce_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.spec = (sharded.device_mesh, sharded.placements, sharded.shape, sharded.stride(),
                    sharded.dtype, sharded.to_local().shape[0])
        ctx.group, ctx.reduce_op, ctx.reduce_dtype = group, reduce_op, reduce_dtype
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mesh, placements, shape, stride, dtype, local_rows = ctx.spec
        group = ctx.group
        c10d = c10d_functional
        flat = grad.to(ctx.reduce_dtype) if ctx.reduce_dtype is not None else grad
        flat = _pad_rows(flat, group.shard_size * group.chunk_rows(grad.shape[0]))
        mine = c10d.wait_tensor(c10d.reduce_scatter_tensor(
            flat.contiguous(), ctx.reduce_op, group.shard_size, mesh.get_group(0).group_name))
        mine = mine.narrow(0, 0, local_rows).to(dtype)
        out = DTensor.from_local(mine, mesh, placements, run_check=False, shape=shape,
                                 stride=stride)
        return None, out, None, None, None
