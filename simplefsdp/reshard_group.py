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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.fx.traceback import annotate
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from . import eager_reshard
from ._torch_compat import c10d_functional
from ._torch_compat.checkpoint import selective_checkpoint_contexts
from .errors import ConfigError, config_errors
from .gradient_sync import gradient_flows
from .mesh import ParallelDims, pad_dim0

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
    def for_model(cls, model: nn.Module, mesh: DeviceMesh, mode: str, value: object,
                  ignored: set[int]) -> ReshardGroup | None:
        """``data_parallel``'s groups for ``reshard_after_forward=value`` (None for a
        bool), after checking the value and refusing a tensor-parallel parameter (not
        ``ignored``, of a module no earlier call sharded: those have ``_sf_compute``)."""
        value = check_reshard_after_forward(value, mesh.size(mesh.ndim - 1), mode)
        if isinstance(value, bool):
            return None
        for module in model.modules():
            if hasattr(module, "_sf_compute"):
                continue
            for name, param in module._parameters.items():
                if isinstance(param, DTensor) and id(param) not in ignored:
                    raise ValueError(f"reshard_after_forward={value}: an int is not built for "
                                     f"tensor-parallel parameters ({name!r} of "
                                     f"{type(module).__name__} is a DTensor); use true or false")
        return cls.build(mesh, value)

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

    @staticmethod
    def names(dp_mesh: DeviceMesh, group: ReshardGroup | None) -> tuple[str, ...]:
        """The names of the data-parallel process groups: ``dp_mesh``'s, and ``group``'s
        (if any), which the compiler's passes then touch too (``DP_GROUPS_META``)."""
        names = tuple(dp_mesh.get_group(d).group_name for d in range(dp_mesh.ndim))
        return names if group is None else names + (group.outer_group, group.inner_group)

    def chunk_rows(self, rows: int) -> int:
        return -(-rows // self.shard_size)

    def keep(self, full: torch.Tensor) -> torch.Tensor:
        """The piece this rank keeps, sliced from the gathered parameter (eager)."""
        c = self.chunk_rows(full.shape[0])
        padded = pad_dim0(full, self.shard_size * c)
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
        shard = pad_dim0(local, self.chunk_rows(rows))
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

    # this region decides for its ops inside a block's selective checkpoint too
    return selective_checkpoint_contexts(policy)


class ReshardToGroupReads:
    """The reads of ``data_parallel``'s gather (``_ReplicateComputation`` derives from it
    and provides ``reshard_group``, ``annotation``, ``param_dtype``, ``reduce_op``,
    ``reduce_dtype``, ``_gather`` and ``route_gradient``) with an int reshard."""

    def _gather_in_two_steps(self, source: DTensor) -> torch.Tensor:
        """Compiled: gather over the outer then the inner group; the gradient is
        reduce-scattered over the whole shard group as DTensor does it."""
        group = self.reshard_group
        with annotate(self.annotation):
            local = source.detach().to_local()
            if self.param_dtype is not None:
                local = local.to(self.param_dtype)
            value = group.gather_in_two_steps(local, source.shape[0])
            if not gradient_flows(source):
                return value
            return ReduceScatterGradient.apply(value, source, group, self.reduce_op,
                                               self.reduce_dtype)

    def read_resharding_to_group(self, sharded: DTensor, source: DTensor,
                                 to_sink: bool) -> torch.Tensor:
        """One read: eager gathers on all ranks and keeps its piece for backward;
        compiled gathers in two steps and backward recomputes only the inner one."""
        group = self.reshard_group
        if torch.compiler.is_compiling():
            local = checkpoint(self._gather_in_two_steps, source, use_reentrant=False,
                               context_fn=group.checkpoint_contexts())
            return self.route_gradient(local, sharded, to_sink)
        local = self.route_gradient(self._gather(source), sharded, to_sink)
        rows = sharded.shape[0]
        eager_reshard.note_gathered(local, None, lambda kept: group.regather(kept, rows),
                                    keep=group.keep)
        return local


def check_config(p, dims: ParallelDims) -> None:
    """``[parallel] reshard_after_forward`` as an int (``p``: the ParallelConfig): a
    divisor of the shard ranks, with ``fully_shard`` and without TP, CP or PP (what this
    module is built and tested for); a ConfigError naming the key, before any process
    group exists. With ``dp_shard = -1`` unresolved the divisor waits for the run."""
    value = p.reshard_after_forward
    if isinstance(value, bool) or not isinstance(value, int):
        return
    key = "parallel.reshard_after_forward"
    for name in ("tp", "cp_ring", "cp_ulysses", "pp"):
        if getattr(p, name) > 1:
            raise ConfigError(f"{key} = {value} (reshard to a group) is not built with "
                              f"parallel.{name} = {getattr(p, name)}: use true or false, "
                              f"or set parallel.{name} = 1")
    if dims.dp_shard >= 1:
        with config_errors():
            check_reshard_after_forward(value, dims.dp_shard, p.dp_mode, key)


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
        flat = pad_dim0(flat, group.shard_size * group.chunk_rows(grad.shape[0]))
        mine = c10d.wait_tensor(c10d.reduce_scatter_tensor(
            flat.contiguous(), ctx.reduce_op, group.shard_size, mesh.get_group(0).group_name))
        mine = mine.narrow(0, 0, local_rows).to(dtype)
        out = DTensor.from_local(mine, mesh, placements, run_check=False, shape=shape,
                                 stride=stride)
        return None, out, None, None, None
