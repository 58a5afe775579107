"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as a choice of our decoder's attention.

Per token (``q_lora_rank = 0``: DeepSeek-V3 16B's plain query projection):

* ``wq``: ``dim -> heads x (nope + rope)`` queries; the last ``rope`` features of each head
  are rotated (RoPE), the first ``nope`` are not;
* ``wkv_a``: ``dim -> kv_lora_rank + rope``: a compressed key/value latent and one rotated
  key part shared by every head;
* ``kv_norm`` (RMSNorm on the latent), then ``wkv_b``: ``kv_lora_rank -> heads x (nope +
  v)``: each head's unrotated key part and its value;
* keys = (unrotated part, shared rotated part), softmax attention at scale
  ``(nope + rope) ** -0.5`` (SDPA's default for that query size), ``wo``: ``heads x v ->
  dim``.

Query/key heads (``nope + rope``, 192) and value heads (``v``, 128) differ in size, so on
a GPU SDPA cannot use its flash kernel (it needs one head size) and would run the
memory-efficient one, whose backward is slow. :func:`mla_attention` calls cuDNN's fused
kernel by name instead where it runs (CUDA, bf16/fp16; probed once), else SDPA. On CPU
tensors SDPA takes its math path (the scores materialized), so the planner's trace swaps
in :func:`fused_kernel_attention`, the GPU's kernel called by name, and costs it at that
kernel's efficiency (``plan/timing.py``, ``hardware.Efficiency``).
YaRN's frequency correction and softmax ``mscale`` only act beyond the original context
(DeepSeek-V3 16B trains at 4096, its ``original_seq_len``) and are not modelled.

``MLAArgs.attention`` picks ``"gqa"`` (our Llama's, the default) or ``"mla"``; the MoE
family's ``deepseek_v3_16b`` preset uses MLA. Tensor and context parallelism, Hugging Face
export and initialization are refused for it at config load (``models/moe_family.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._torch_compat import cudnn_attention, cudnn_attention_runs
from .llama import ModelArgs, RMSNorm, _trunc_normal, apply_rope, causal_attention

ATTENTIONS = ("gqa", "mla")


@dataclass
class MLAArgs(ModelArgs):
    """Llama's shape plus the attention choice and MLA's sizes (used with ``"mla"``)."""

    attention: str = "gqa"  # gqa | mla
    kv_lora_rank: int = 512  # width of the compressed key/value latent
    qk_nope_head_dim: int = 128  # query/key features per head without RoPE
    qk_rope_head_dim: int = 64  # query/key features per head with RoPE (key: shared)
    v_head_dim: int = 128  # value features per head

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r}: choose one of {ATTENTIONS}")
        if not self.mla:
            return
        sizes = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 with "
                                 f"attention='mla'")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")
        if self.kv_heads != self.n_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads}: attention='mla' has one key and "
                             f"value per query head; leave n_kv_heads out")

    @property
    def mla(self) -> bool:
        return self.attention == "mla"

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim if self.mla else super().rope_dim

    @property
    def attention_dims(self) -> tuple[int, int]:
        if not self.mla:
            return super().attention_dims
        return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim

    @property
    def block_norm_params(self) -> int:
        return super().block_norm_params + (self.kv_lora_rank if self.mla else 0)

    def attention_matmul_params(self) -> int:
        """MLA: ``wq``, ``wkv_a``, ``wkv_b`` and ``wo`` (the latent's norm is not a matmul)."""
        if not self.mla:
            return super().attention_matmul_params()
        qk, v = self.attention_dims
        h, r = self.n_heads, self.kv_lora_rank
        return self.dim * (h * qk + r + self.qk_rope_head_dim) \
            + r * h * (self.qk_nope_head_dim + v) + h * v * self.dim

    def build_attention(self) -> nn.Module:
        return MultiHeadLatentAttention(self) if self.mla else super().build_attention()


class MultiHeadLatentAttention(nn.Module):
    """MLA (module docstring); ``forward`` takes what our Llama attention takes."""

    def __init__(self, args: MLAArgs):
        super().__init__()
        self.nope, self.rope, self.v_dim = (args.qk_nope_head_dim, args.qk_rope_head_dim,
                                            args.v_head_dim)
        self.rank = args.kv_lora_rank
        h = args.n_heads
        self.wq = nn.Linear(args.dim, h * (self.nope + self.rope), bias=False)
        self.wkv_a = nn.Linear(args.dim, self.rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.rank, args.norm_eps)
        self.wkv_b = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(h * self.v_dim, args.dim, bias=False)
        self.core = mla_attention  # (q, k, v, mask) -> output, as Llama's

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        q = self.wq(x).view(bsz, seq_len, -1, self.nope + self.rope)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rot, rope)], dim=-1)
        latent, k_rot = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        k_rot = apply_rope(k_rot.unsqueeze(2), rope)  # one head, shared by all
        kv = self.wkv_b(self.kv_norm(latent)).view(bsz, seq_len, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        out = self.core(q, k, v, mask)
        return self.wo(out.reshape(bsz, seq_len, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wkv_a, self.wkv_b):
            _trunc_normal(linear.weight, 0.02)
        self.kv_norm.init_weights()
        _trunc_normal(self.wo.weight, init_std)


def fused_kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None = None) -> torch.Tensor:
    """``causal_attention`` (same layout and call) on cuDNN's fused kernel called by name
    (``_torch_compat.cudnn_attention``): what :func:`mla_attention` runs on a GPU, and the
    planner's fake-tensor trace (that kernel has no CPU implementation). A document mask
    keeps SDPA."""
    if mask is not None:
        return causal_attention(q, k, v, mask)
    out = cudnn_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          causal=True)
    return out.transpose(1, 2)


def mla_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """MLA's attention core: :func:`fused_kernel_attention` where cuDNN's kernel runs for
    these head sizes and dtype, else SDPA (``causal_attention``): for MLA's unequal
    query/key and value head sizes SDPA picks its memory-efficient kernel, much slower
    than cuDNN's in backward (figures: docs/performance.md)."""
    if mask is None and cudnn_attention_runs(q.device, q.dtype, q.shape[-1], v.shape[-1]):
        return fused_kernel_attention(q, k, v)
    return causal_attention(q, k, v, mask)
