"""Attention kernels by their aten names (ring and all-gather context parallelism, MLA):
the output with its log-sum-exp, and the matching backward."""

from __future__ import annotations

import torch


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of softmax attention, ``(batch, heads, seq, head_dim)`` in,
    the log-sum-exp ``(batch, heads, seq)`` float32; ``causal`` masks top-left aligned.
    CPU: the flash kernel for CPU (checked: 2.13). CUDA: the flash kernel (fp16/bf16
    only; 2.11 (CUDA))."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return tuple(aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal))
    return tuple(aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2])


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """cuDNN's fused attention by name, ``(batch, heads, seq, head_dim)``; query/key and value
    head sizes may differ (MLA; flash refuses). checked: 2.13 (meta), 2.11 (CUDA, H200)."""
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    return op(q, k, v, None, True, 0.0, causal)[0]  # the log-sum-exp kept for backward


def attention_with_lse_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                causal: bool) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of :func:`attention_with_lse` for the given ``out`` and ``lse``:
    passing the merged output and log-sum-exp of several key blocks gives each block's
    exact share of the gradient (the kernels recompute the probabilities from ``lse``).
    CPU checked: 2.13. CUDA (2.11): no sequence offsets (None; defined ones mean
    variable-length batches, int32) and no dropout state."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal)
    return aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, None, None)
