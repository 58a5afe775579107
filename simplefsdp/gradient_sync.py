"""Gradient sync control for ``data_parallel``: FSDP2's ``set_requires_gradient_sync``
and ``set_requires_all_reduce``, and the replica all-reduce they can skip.

With sync off, a read's gradient is routed to a leaf "sink" (``GradientToSink``)
instead of the collective that would reduce it, so autograd accumulates it unreduced
in ``sink.grad``: full-size before the reduce-scatter/all-reduce, or the reduced shard
before HSDP's replica all-reduce. Turning sync back on moves that sum to a pending
gradient that the next forward hands to its backward (``AddToGradient``, or
``ReduceOverReplicas``' ``pending``), so one collective reduces every micro-step's sum.
The flags are read in forward, so a compiled graph specializes on them (Dynamo guards
on the attributes) and flipping one never runs a stale graph.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ._torch_compat import c10d_functional


class ReduceOverReplicas(torch.autograd.Function):
    """Identity in forward on the sharded (Replicate, Shard) parameter; in backward,
    all-reduce its gradient's local shard over the HSDP replica group (in ``dtype``).

    With the gather's gradient labelled (Replicate, Partial), backward first
    reduce-scatters over the shard group and then all-reduces only the reduced shard,
    as HSDP should (DTensor alone would all-reduce the full gradient first). Kept on
    the DTensor (no ``from_local`` in forward), which activation checkpointing under
    compile cannot save. ``pending`` (a local tensor or None): gradients accumulated
    while the all-reduce was off, added before this one all-reduce."""

    @staticmethod
    def forward(ctx, shard: DTensor, group_name: str, reduce_op: str,
                dtype: torch.dtype | None, pending: torch.Tensor | None = None) -> DTensor:
        ctx.group_name, ctx.reduce_op, ctx.dtype = group_name, reduce_op, dtype
        _keep_for_backward(ctx, pending)
        return shard.view_as(shard)

    @staticmethod
    def backward(ctx, grad: DTensor):
        c10d = c10d_functional
        local = grad.to_local()
        reduced = local.to(ctx.dtype) if ctx.dtype is not None else local
        pending = _kept_for_backward(ctx)
        if pending is not None:
            reduced = reduced + pending.to(reduced.dtype)
        reduced = c10d.wait_tensor(c10d.all_reduce(reduced.contiguous(), ctx.reduce_op,
                                                   ctx.group_name)).to(local.dtype)
        out = DTensor.from_local(reduced, grad.device_mesh, grad.placements, run_check=False,
                                 shape=grad.shape, stride=grad.stride())
        return out, None, None, None, None


def _keep_for_backward(ctx, tensor: torch.Tensor | None) -> None:
    """Keep ``tensor`` for backward. Compiled: a saved tensor (the graph's input). Eager:
    a plain attribute, so an activation-checkpoint recomputation (which runs without it:
    the pending gradient was consumed by the first forward) saves the same tensors."""
    ctx.has_kept, ctx.kept = tensor is not None, tensor
    if tensor is not None and torch.compiler.is_compiling():
        ctx.save_for_backward(tensor)
        ctx.kept = None


def _kept_for_backward(ctx) -> torch.Tensor | None:
    if not ctx.has_kept:
        return None
    return ctx.saved_tensors[0] if ctx.kept is None else ctx.kept


class GradientToSink(torch.autograd.Function):
    """Identity on ``value`` (which does not require grad); its gradient goes to the leaf
    ``sink`` (cast to the sink's dtype), where autograd accumulates it in ``sink.grad``.
    Used while gradient sync (or the HSDP all-reduce) is off: the gradient stops before
    the collective that would reduce it."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        ctx.sink_dtype = sink.dtype
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad.to(ctx.sink_dtype)


class AddToGradient(torch.autograd.Function):
    """Identity in forward; backward adds ``pending`` (the gradients accumulated while
    sync was off) to the gradient before it reaches the reduction: one collective
    reduces the sum of every micro-step."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        _keep_for_backward(ctx, pending)
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pending = _kept_for_backward(ctx)
        return (grad.to(pending.dtype) + pending).to(grad.dtype), None


class GradientSyncControl:
    """The gradient-sync half of a parameter's gather (``data_parallel``'s
    ``_ReplicateComputation`` derives from it and provides ``replicated``,
    ``replica_group``, ``tp``, ``param_dtype`` and ``reduce_dtype``)."""

    def init_sync(self) -> None:
        # Gradient sync control (``set_requires_gradient_sync`` / ``set_requires_all_reduce``).
        # Read in forward, so a compiled graph is specialized on them (Dynamo guards on
        # these attributes): flipping one compiles the other variant once, never a stale one.
        self.gradient_sync = True
        self.all_reduce = True
        # What each level does given those (:meth:`set_sync`): reduce over the shard group
        # (or, replicate, nothing to skip there) and all-reduce over the replicas.
        self.full_on = True
        self.replica_on = True
        # While sync is off: leaves whose ``.grad`` accumulates the unreduced gradient,
        # full-size (``full_sink``) or the reduce-scattered shard (``shard_sink``, HSDP
        # with the all-reduce off). When sync comes back their sums wait in ``pending_*``
        # until the next forward hands them to the backward that reduces them.
        self.full_sink: torch.Tensor | None = None
        self.shard_sink: DTensor | None = None
        self.pending_full: torch.Tensor | None = None
        self.pending_shard: torch.Tensor | None = None

    def compute_device(self, sharded: DTensor) -> torch.device:
        """Where gradients are computed and, with sync off, accumulate: the compute
        device (with CPU offload the shard itself is on the host)."""
        offload = getattr(self, "offload", None)
        return sharded.device if offload is None else offload.device

    @property
    def accumulation_dtype(self) -> torch.dtype | None:
        """Unreduced gradients accumulate in the reduction dtype (as FSDP2 does)."""
        return self.reduce_dtype or self.param_dtype

    def set_sync(self, sharded: DTensor, gradient_sync: bool, all_reduce: bool) -> None:
        """Switch gradient sync; eager, between steps. Turning one back on moves what
        its sink accumulated into the pending gradient of the next backward.

        ``replicate`` skips its one collective, the all-reduce, at the replica level,
        where the sum is added in the reduction dtype; ``fully_shard``/``hybrid_shard``
        stop the gradient before the reduce-scatter, where the sum is added to the
        compute-dtype gradient (exact without mixed precision; with a low-precision
        ``param_dtype`` the sum is rounded to it once before being reduced)."""
        self.gradient_sync, self.all_reduce = gradient_sync, all_reduce
        if not sharded.requires_grad:
            return  # frozen: never reduced anyway
        self.full_on = gradient_sync or self.replicated
        self.replica_on = all_reduce and (gradient_sync or not self.replicated)
        if not self.full_on and self.full_sink is None:
            shape = self.tp[2] if self.tp is not None else sharded.shape
            dtype = self.accumulation_dtype or sharded.dtype
            # only its gradient is used: a stride-0 view costs no memory
            self.full_sink = torch.zeros((), dtype=dtype, device=self.compute_device(sharded)) \
                .expand(shape).requires_grad_()
        if self.full_on and self.full_sink is not None:
            self.pending_full = plus(self.pending_full, self.full_sink.grad)
            self.full_sink = None
        if self.replica_group is not None and not self.replica_on and self.shard_sink is None:
            self.shard_sink = torch.zeros_like(sharded, dtype=self.reduce_dtype or sharded.dtype,
                                               device=self.compute_device(sharded)) \
                .requires_grad_()
        if self.replica_on and self.shard_sink is not None:
            grad = self.shard_sink.grad
            self.pending_shard = plus(self.pending_shard,
                                      None if grad is None else grad.to_local())
            self.shard_sink = None

    def replica_step(self, sharded: DTensor, to_sink: bool):
        """(sink, pending) for the replica all-reduce of this read's gradient, or None
        when there is none (no replica group, no gradient, or the gradient stops at the
        full-size sink). Consumes ``pending_shard``: only one read of a tied parameter
        adds it."""
        if self.replica_group is None or to_sink or not gradient_flows(sharded):
            return None
        if not self.replica_on:
            return self.shard_sink, None
        pending = self.pending_shard
        if pending is not None:  # written only then: torch 2.11's Dynamo refuses any
            self.pending_shard = None  # attribute store inside a checkpointed region
        return None, pending

    def route_gradient(self, local: torch.Tensor, sharded: DTensor,
                       to_sink: bool) -> torch.Tensor:
        """The gathered tensor the computation uses: with sync off its gradient goes to
        the full-size sink; otherwise a pending sum joins its gradient once."""
        if to_sink:  # sync off: the full gradient accumulates, unreduced
            return GradientToSink.apply(local, self.full_sink)
        if self.pending_full is not None and gradient_flows(sharded):
            local = AddToGradient.apply(local, self.pending_full)
            self.pending_full = None  # one read (of a tied parameter) adds it
        return local


def gradient_flows(sharded: torch.Tensor) -> bool:
    return sharded.requires_grad and torch.is_grad_enabled()


def plus(total: torch.Tensor | None, more: torch.Tensor | None) -> torch.Tensor | None:
    if total is None or more is None:
        return more if total is None else total
    return total + more


def gathers(model: nn.Module) -> Iterator[tuple[GradientSyncControl, DTensor]]:
    """Each parameter's gather (once for a tied one) and its sharded parameter, including
    those of submodules sharded by an earlier call (experts on their own mesh)."""
    seen: set[int] = set()
    for module in model.modules():
        for name, gather in getattr(module, "_sf_compute", {}).items():
            if id(gather) not in seen:
                seen.add(id(gather))
                yield gather, module._parameters[name]


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """FSDP2's ``set_requires_gradient_sync``: with False, backward reduces nothing and
    each parameter's full-size gradient accumulates unreduced (in the reduction dtype);
    the next backward with True adds that sum to its own gradient and reduces it once
    (one reduce-scatter / all-reduce per optimizer step). Bound to the model as a method
    by :func:`data_parallel`; a compiled model compiles one graph for each setting."""
    if not isinstance(requires_gradient_sync, bool):
        raise TypeError(f"set_requires_gradient_sync takes a bool, got {requires_gradient_sync!r}")
    for gather, param in gathers(model):
        gather.set_sync(param, requires_gradient_sync, gather.all_reduce)


def set_requires_all_reduce(model: nn.Module, requires_all_reduce: bool) -> None:
    """FSDP2's ``set_requires_all_reduce`` (``hybrid_shard``, also ``replicate``): with
    False, backward still reduce-scatters over the shard group but skips the all-reduce
    over replicas; the reduced shards accumulate and the next backward with True
    all-reduces their sum once. No effect on ``fully_shard`` (it has no replicas)."""
    if not isinstance(requires_all_reduce, bool):
        raise TypeError(f"set_requires_all_reduce takes a bool, got {requires_all_reduce!r}")
    for gather, param in gathers(model):
        gather.set_sync(param, gather.gradient_sync, requires_all_reduce)
