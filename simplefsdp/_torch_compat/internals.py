"""Private torch names the package must spell (op namespaces, op names, a logger) and the
private members of torch classes it reaches (the checkpoint wrapper's function, a
``ParallelStyle``'s apply hook): the rest of ``_torch_compat``, kept in its own file so
each stays short. Each: checked 2.13.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

# torch.ops namespaces: the functional collectives (what DTensor and compiled graphs call)
# and DTensor's own ops.
C10D_FUNCTIONAL = "_c10d_functional"
DTENSOR_OPS = "_dtensor"
# The logger of torch's warning about a checkpoint region with a ``context_fn`` under
# torch.compile (``parallel.activation_checkpoint.quiet_our_checkpoint_warning``).
CHECKPOINT_CONTEXT_FN_LOGGER = "torch._higher_order_ops.wrap"
# Where that warning is logged from (a frame of the logger's module).
CHECKPOINT_CONTEXT_FN_FRAME = "tag_activation_checkpoint_impl"
# The region's meta key that frame reads its context_fn from (2.13 binds it to a local
# ``context_fn`` before warning, 2.11 only after). checked: 2.11, 2.13.
CHECKPOINT_CONTEXT_FN_META = "_checkpoint_context_fn"
_ATTENTION_OPS = ("_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention")


def attention_ops() -> set:
    """The default overloads of the fused attention ops (SDPA's kernels) this torch has."""
    aten = torch.ops.aten
    return {getattr(aten, name).default for name in _ATTENTION_OPS if hasattr(aten, name)}


def checkpointed_inner(block: nn.Module) -> nn.Module | None:
    """The module a ``checkpoint_wrapper`` wraps; None for any other module."""
    return getattr(block, "_checkpoint_wrapped_module", None)


def checkpoint_keywords(block: nn.Module) -> dict:
    """The keyword arguments a checkpoint wrapper passes to ``torch.utils.checkpoint``."""
    return dict(block.checkpoint_fn.keywords)


def set_checkpoint_keywords(block: nn.Module, keywords: dict) -> None:
    """Make a checkpoint wrapper pass ``keywords`` to ``torch.utils.checkpoint`` instead."""
    fn = block.checkpoint_fn
    block.checkpoint_fn = functools.partial(fn.func, *fn.args, **keywords)


def module_style(apply: Callable[[nn.Module, DeviceMesh], nn.Module]) -> ParallelStyle:
    """A ``ParallelStyle`` for ``parallelize_module`` that runs ``apply(module, mesh)``
    (torch's styles implement the private ``_apply`` hook)."""

    class _Style(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            return apply(module, device_mesh)

    return _Style()


def record_memory_history(enabled: bool) -> None:
    """Start (or stop) the CUDA caching allocator's record of every allocation and free
    with its stack, which :func:`dump_memory_snapshot` writes. checked: 2.13."""
    torch.cuda.memory._record_memory_history("all" if enabled else None)


def dump_memory_snapshot(path: str) -> None:
    """The allocator's recorded history as a pickle for pytorch.org/memory_viz.
    checked: 2.13."""
    torch.cuda.memory._dump_snapshot(path)
