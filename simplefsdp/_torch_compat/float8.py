"""Float8 matmuls (``simplefsdp/float8.py``, ``plan/float8.py``): torch's private
``_scaled_mm``, behind the names the rest of the package uses."""

from __future__ import annotations

import functools

import torch

__all__ = ["has_scaled_mm", "inner_tensors", "scaled_mm", "scaled_mm_op"]


def has_scaled_mm() -> bool:
    """Whether this torch has ``torch._scaled_mm`` (a float8 matmul with scales).
    checked: 2.11, 2.13."""
    return hasattr(torch, "_scaled_mm")


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` in ``out_dtype`` from float8 ``a`` (row-major)
    and ``b`` (column-major), ``torch._scaled_mm``: tensorwise (0-d) or rowwise
    ((M, 1) and (1, N)) float32 scales; CPU and GPUs of compute capability 8.9+.
    checked: 2.11, 2.13."""
    if a.device.type == "cpu" and scale_a.numel() * scale_b.numel() > 1 \
            and not _cpu_takes_rowwise_scales():
        # torch 2.11's CPU kernel takes tensorwise scales only: dequantize and multiply
        # in float32, as later kernels do on the CPU
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


@functools.cache
def _cpu_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes (M, 1) / (1, N) scales (2.13 does,
    2.11 asserts tensorwise), probed once on a 16 x 16 product."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
        return True
    except RuntimeError:
        return False


def scaled_mm_op():
    """The ATen op of :func:`scaled_mm`, as traced graphs name it. checked: 2.13."""
    return torch.ops.aten._scaled_mm.default


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor] | None:
    """The plain tensors a wrapper tensor subclass holds (e.g. torchao's float8 training
    weight, whose own storage is not a real one), None for any other tensor; through
    torch's subclass protocol (``__tensor_flatten__``). checked: 2.13."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return None
    return [getattr(t, name) for name in t.__tensor_flatten__()[0]]
