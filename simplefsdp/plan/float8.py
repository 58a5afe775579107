"""The planner's float8: which traced ops are float8 matmuls and the peak they run at.

A job with ``[float8] enable`` is traced as it runs (``simplefsdp/float8.py``): its
converted linear layers become ``torch._scaled_mm`` calls on float8 operands, and with
``float8.all_gather`` their weights' all-gathers move ``uint8`` bytes, which the
collective pricing already counts at one byte an element; the scales' all-reduce runs
in a graph of its own before the forward (``trace.Trace.prologue``). What is left for
the roofline is the matmul class and rate, here.
"""

from __future__ import annotations

import torch

from .._torch_compat.float8 import scaled_mm_op
from ..float8 import E4M3, E5M2
from ..hardware import GpuSpec

FLOAT8_MATMULS = frozenset({scaled_mm_op()})


def matmul_peak_flops(spec: GpuSpec, dtype: torch.dtype) -> float:
    """Dense peak FLOP/s of a matmul whose operands are ``dtype`` on ``spec``'s GPU: the
    float8 tensor cores for float8 operands (a GPU without them is refused), bf16's for
    bf16/fp16, fp32's otherwise."""
    if dtype in (E4M3, E5M2):
        if spec.fp8_flops is None:
            raise ValueError(f"{spec.name} has no float8 tensor cores: plan it with "
                             f"float8.enable = false, or pick a GPU that has them (--gpu)")
        return spec.fp8_flops
    return spec.bf16_flops if dtype in (torch.bfloat16, torch.float16) else spec.fp32_flops

