"""Selective activation checkpointing under ``torch.compile`` (``data_parallel``'s
gather, ``reshard_group``'s two-step gather): which region's policy a traced op's
``recompute`` tag comes from when checkpointed regions nest.

The gathers' own regions sit inside a block's selective checkpoint (``[activation_checkpoint]
mode = "selective"``), and their policies must decide for their ops: the gather and its
wait recomputed, the cast shard saved (the int reshard: the outer gather's result saved,
so backward repeats only the inner gather). torch 2.13 tags each op's nodes after the op
has run, so the innermost region's policy is the last to write and wins. torch 2.11 writes
the tag into the node metadata *before* passing the op on, so an enclosing region's mode,
which runs later, overwrites it: the block's policy decided, the casts were recomputed
from the float32 shards instead of saved, and the int reshard's outer gathers ran again
in backward. An op torch keeps out of the policy (``detach``) was left the tag of the op
before it: the float8 gather's weight was saved for backward through a ``detach`` that
took a view's ``MUST_SAVE``. Where torch tags before the op (:func:`_innermost_region_tags`
asks a tiny trace once), :func:`selective_checkpoint_contexts` adds the tagging after the
op, as 2.13 does; elsewhere it is torch's own. checked: 2.11 (tags added), 2.13 (torch's
own).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from itertools import islice

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["full_recompute_context_fn", "selective_checkpoint_contexts"]


def selective_checkpoint_contexts(policy_fn: Callable) -> tuple:
    """``create_selective_checkpoint_contexts(policy_fn)``, its forward mode leaving each
    op's new nodes of an AOTAutograd trace tagged with ``policy_fn``'s decision for that
    op, whatever an enclosing region's mode wrote (see the module docstring). Where
    torch does not do so itself, a mode of ours above torch's adds it, and tags the ops
    torch keeps out of the policy (``detach``, metadata queries) ``PREFER_RECOMPUTE``, as
    2.13 does. 2.11 left such an op the tag its predecessor wrote: the ``detach`` after
    the float8 gather's ``view`` took the view's ``MUST_SAVE`` (a ``detach`` is no view
    to the partitioner, which saves what it may not recompute), and backward kept the
    forward's gathered float8 weight instead of gathering it again."""
    if _innermost_region_tags():
        return create_selective_checkpoint_contexts(policy_fn)
    decision: list = [None]

    def recorded(ctx, func, *args, **kwargs):
        decision[0] = policy_fn(ctx, func, *args, **kwargs)
        return decision[0]

    caching, recompute = create_selective_checkpoint_contexts(recorded)
    return _TagsAfterTheOp(caching, decision), recompute


def _as_policy(decision) -> CheckpointPolicy:
    if decision is None:  # an op torch keeps out of the policy
        return CheckpointPolicy.PREFER_RECOMPUTE
    if isinstance(decision, bool):  # the policy's other spelling (torch's own reading)
        return CheckpointPolicy.MUST_SAVE if decision else CheckpointPolicy.PREFER_RECOMPUTE
    return decision


class _TagsAfterTheOp(TorchDispatchMode):
    """torch's caching mode (entered below this one) plus the tagging after each op. A
    ``TorchDispatchMode`` itself: torch's checkpoint takes nothing else as a compiled
    region's context."""

    # higher-order ops pass through to torch's caching mode, which has their rules
    supports_higher_order_operators = True

    def __init__(self, caching: TorchDispatchMode, decision: list):
        super().__init__()
        self.caching, self.decision = caching, decision

    def __enter__(self):
        self.caching.__enter__()
        try:
            return super().__enter__()
        except BaseException as e:
            self.caching.__exit__(type(e), e, e.__traceback__)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.caching.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        proxy = get_proxy_mode()
        if proxy is None:  # eager: no graph to tag
            return func(*args, **kwargs)
        graph = proxy.tracer.graph
        before = len(graph.nodes)
        self.decision[0] = None
        out = func(*args, **kwargs)
        policy = _as_policy(self.decision[0])
        for node in islice(reversed(graph.nodes), len(graph.nodes) - before):
            node.meta["recompute"] = policy
        return out


@functools.cache
def _innermost_region_tags() -> bool:
    """Whether this torch tags a traced op with the innermost checkpointed region's
    policy: a ``make_fx`` trace of ``sin`` in a region that saves everything inside one
    that recomputes everything. Run once, outside any mode of the caller's (it may be
    asked while AOTAutograd traces)."""
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.checkpoint import checkpoint

    from . import disable_current_modes

    def region(policy: CheckpointPolicy, fn: Callable) -> Callable:
        def contexts():
            return create_selective_checkpoint_contexts(lambda *args, **kwargs: policy)
        return lambda t: checkpoint(fn, t, use_reentrant=False, preserve_rng_state=False,
                                    context_fn=contexts)

    nested = region(CheckpointPolicy.PREFER_RECOMPUTE,
                    region(CheckpointPolicy.MUST_SAVE, torch.sin))
    with disable_current_modes(), fx_traceback.preserve_node_meta(), torch.enable_grad():
        gm = make_fx(nested)(torch.ones(2, requires_grad=True))
    sin = torch.ops.aten.sin.default
    return [n.meta.get("recompute") for n in gm.graph.nodes if n.target is sin] == [
        CheckpointPolicy.MUST_SAVE]


def full_recompute_context_fn() -> Callable | None:
    """The ``context_fn`` a full-AC block's checkpoint takes (None: none) so that, traced
    by ``torch.compile``, every op of the block is tagged for recomputation, those of a
    custom ``autograd.Function`` (the ring attention's) included, as eager full AC
    recomputes them. torch 2.13 traces a checkpoint without ``context_fn`` through its
    selective machinery with an always-recompute policy, whose dispatch mode sees those
    ops (None here). torch 2.11 tagged the region's graph before the functions were
    inlined: their ops stayed untagged, the partitioner saved them instead, and the
    traced backward lacked the ring attention's forward (the planner's eager full-AC
    step came out short by the attention's recomputation). There, a ``context_fn`` that
    gives the selective contexts with an always-recompute policy while traced, and no
    contexts in eager (plain full recomputation). checked: 2.11, 2.13."""
    from torch._higher_order_ops import wrap

    return None if hasattr(wrap, "_always_prefer_recompute") else _full_recompute_contexts


def _always_recompute(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _full_recompute_contexts() -> tuple:
    if get_proxy_mode() is None:  # eager
        return contextlib.nullcontext(), contextlib.nullcontext()
    return selective_checkpoint_contexts(_always_recompute)
