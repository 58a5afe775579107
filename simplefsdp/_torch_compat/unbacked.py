"""Traced data-dependent shapes (the exact MoE dispatch under ``torch.compile``): the
Dynamo config that captures them, the checks that tell the tracer what the data
guarantees, and the even functional all-to-all of the per-expert counts."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_to_all_single(inp: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """An even ``all_to_all_single`` (no gradient), waited for: a functional collective, so
    a compiled graph holds it as a node. checked: 2.13
    (``_functional_collectives.all_to_all_single`` with ``None`` splits on gloo)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single(inp, None, None, group))


def check_size(size) -> None:
    """Tell the tracer that ``size`` (an int read from a tensor: unbacked when traced) is a
    valid size, >= 0; a plain check in eager. checked: 2.13 (``torch._check(size >= 0)``,
    which replaces the deprecated ``_check_is_size``), 2.11-2.12 (``_check_is_size``)."""
    if _TORCH_MINOR >= 13:
        torch._check(size >= 0)
    else:
        torch._check_is_size(size)


_TORCH_MINOR = int(torch.__version__.split(".")[1])


def check_that(condition) -> None:
    """Tell the tracer that ``condition`` (on unbacked sizes) holds, so it needs no guard;
    raises in eager where it is false. checked: 2.13 (``torch._check``)."""
    torch._check(condition)


def data_dependent_shapes():
    """A context in which Dynamo traces a tensor's values read on the host (``tolist``,
    ``item``) as unbacked sizes and ops whose output shape depends on the data, instead
    of breaking the graph (the exact MoE dispatch's split sizes). checked: 2.13
    (``_dynamo.config.capture_scalar_outputs`` / ``capture_dynamic_output_shape_ops``)."""
    return torch._dynamo.config.patch(capture_scalar_outputs=True,
                                      capture_dynamic_output_shape_ops=True)
