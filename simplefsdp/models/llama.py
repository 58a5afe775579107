"""A Llama-3-style decoder-only transformer, written to be sharded.

The pieces: RMSNorm, rotary position embeddings (RoPE), grouped-query attention through
``F.scaled_dot_product_attention(is_causal=True)`` and a SwiGLU feed-forward network.

Conventions that the rest of simplefsdp relies on:

* Module names follow Meta's / torchtitan's: ``tok_embeddings``, ``layers.<i>`` (an
  ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... so a pipeline stage can delete layers and
  keep the others' names), each with ``attention.{wq,wk,wv,wo}``, ``attention_norm``,
  ``feed_forward.{w1,w2,w3}``, ``ffn_norm``; then ``norm`` and ``output``.
* ``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` (pipeline stages);
  ``forward`` then takes hidden states instead of tokens and/or returns them.
* Head counts are never baked into views (``view(..., -1, head_dim)``), so a tensor
  parallel plan that shards heads needs no change here.
* ``init_weights`` only uses in-place ops on ``self.<module>.weight``: it works on
  DTensor parameters and after ``to_empty`` from a meta-device build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    """Shape of the model. ``ffn_hidden_dim`` derives the SwiGLU width from it."""

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: as many as n_heads (plain multi-head attention)
    vocab_size: int = 256
    multiple_of: int = 32  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        kv = self.n_kv_heads or self.n_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for RoPE")
        if self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={kv}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def rope_dim(self) -> int:
        """Features of a head that RoPE rotates (all of it here; MLA: its rope part)."""
        return self.head_dim

    @property
    def attention_dims(self) -> tuple[int, int]:
        """(query/key, value) features per head: what attention's score and value matmuls
        contract over (equal here; MLA's differ)."""
        return self.head_dim, self.head_dim

    @property
    def block_norm_params(self) -> int:
        """Parameters of a block's norms (attention's and the FFN's; MLA adds its own)."""
        return 2 * self.dim

    def attention_matmul_params(self) -> int:
        """Parameters of a block's attention matrices (q, k, v, o)."""
        return self.dim * self.head_dim * (2 * self.n_heads + 2 * self.kv_heads)

    def build_attention(self) -> nn.Module:
        """A block's attention module (another attention's args override this)."""
        return Attention(self)

    def ffn_matmul_params(self, layer: int | None = None, activated: bool = False) -> int:
        """Parameters of block ``layer``'s feed-forward matrices (the SwiGLU's three; a
        mixture of experts overrides this). ``activated``: only those one token runs
        through (the same here). ``layer=None``: a typical block."""
        return 3 * self.dim * ffn_hidden_dim(self)

    def routed_params(self, layer: int | None = None) -> int:
        """Of ``ffn_matmul_params``, those tensor parallelism leaves whole on every TP
        rank (a router and routed experts; none in a dense block)."""
        return 0

    def expert_params(self, layer: int | None = None) -> int:
        """Of ``routed_params``, the routed experts' (split by expert parallelism, the
        router not; none in a dense block)."""
        return 0

    def router_params(self, layer: int | None = None) -> int:
        """Of ``routed_params``, the router's (whole on every rank of its block: neither
        tensor nor expert parallelism splits it; none in a dense block)."""
        return 0


def ffn_hidden_dim(args: ModelArgs) -> int:
    """Llama's rule: 2/3 of 4*dim (SwiGLU has three matrices, not two), scaled by
    ``ffn_dim_multiplier``, rounded up to a multiple of ``multiple_of``."""
    hidden = int(2 * (4 * args.dim) / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * math.ceil(hidden / args.multiple_of)


LLAMA3_PRESETS: dict[str, ModelArgs] = {
    # ~0.8M parameters; byte-level vocabulary; trains in minutes on a laptop CPU.
    "debug": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256,
                       multiple_of=32, rope_theta=10000.0, max_seq_len=256),
    # Llama 3.1 shapes (RoPE frequency scaling for long context is not modelled).
    "llama3_8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                           vocab_size=128256, multiple_of=1024, ffn_dim_multiplier=1.3,
                           rope_theta=500000.0, max_seq_len=8192),
    "llama3_70b": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                            vocab_size=128256, multiple_of=4096, ffn_dim_multiplier=1.3,
                            rope_theta=500000.0, max_seq_len=8192),
    "llama3_405b": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                             vocab_size=128256, multiple_of=4096, ffn_dim_multiplier=1.2,
                             rope_theta=500000.0, max_seq_len=8192),
}


# ---------------------------------------------------------------------------------------
# Building blocks.
# ---------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 for stability."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def rope_cache(head_dim: int, max_seq_len: int, theta: float,
               device: torch.device | None = None) -> torch.Tensor:
    """``(max_seq_len, head_dim // 2, 2)``: cos and sin of ``position * frequency``.

    Pair ``i`` of a head, the features ``(2i, 2i+1)``, turns by the angle
    ``position * theta ** (-2i / head_dim)``: Meta's interleaved layout, in real numbers
    (complex buffers are awkward for DTensor and the compiler).
    """
    freqs = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                      / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(batch, seq, heads, head_dim)`` by the first ``seq`` angles
    of ``cache``, or, for a ``(batch, seq, head_dim // 2, 2)`` cache (each token's own
    position, see ``document_positions``), by each token's angles."""
    if cache.dim() == 4:
        cos, sin = cache[..., 0].unsqueeze(2), cache[..., 1].unsqueeze(2)
    else:
        seq_len = x.shape[1]
        cos = cache[:seq_len, :, 0].view(1, seq_len, 1, -1)
        sin = cache[:seq_len, :, 1].view(1, seq_len, 1, -1)
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def document_index(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed documents end at ``eos_id`` (the EOS is the last token of its document).
    Returns each token's position in its document, restarting at 0 after every EOS and
    at the sequence start, and its document's index in the sequence, ``(batch, seq)``."""
    is_eos = (tokens == eos_id).long()
    doc = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens strictly before
    index = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    starts = torch.ones_like(is_eos)
    starts[:, 1:] = is_eos[:, :-1]  # a document starts after each EOS
    first = torch.cummax(index * starts, dim=1).values  # its first token's index
    return index - first, doc


def document_positions(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`document_index`'s positions and the block-diagonal causal mask
    ``(batch, 1, seq, seq)``: a token attends to earlier tokens of its own document."""
    positions, doc = document_index(tokens, eos_id)
    causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool,
                        device=tokens.device).tril()
    mask = (doc[:, :, None] == doc[:, None, :]) & causal
    return positions, mask[:, None]


def repeat_heads(x: torch.Tensor, n_rep: int, dim: int) -> torch.Tensor:
    """Grouped-query attention's key/value heads (dimension ``dim``) each repeated
    ``n_rep`` times in place, so head ``h`` serves query heads ``h * n_rep`` to ``(h + 1)
    * n_rep - 1``; ``x`` itself when ``n_rep`` is 1."""
    return x.repeat_interleave(n_rep, dim=dim) if n_rep > 1 else x


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention on ``(batch, seq, heads, head_dim)`` tensors (``mask``, a
    document mask, replaces the causal one). ``k`` and ``v`` may have fewer heads: each
    serves ``heads // kv_heads`` query heads, in order (grouped-query attention)."""
    n_rep = q.shape[2] // k.shape[2]
    k, v = repeat_heads(k, n_rep, dim=2), repeat_heads(v, n_rep, dim=2)
    # SDPA wants (batch, heads, seq, head_dim).
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=mask,
                                         is_causal=mask is None)
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Grouped-query attention: ``n_kv_heads`` key/value heads shared by ``n_heads``
    query heads (each key/value head serves ``n_heads // n_kv_heads`` query heads)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # (q, k, v, mask) -> output, like causal_attention; context parallelism
        # (parallel/context.py) swaps in one that sees the whole sequence.
        self.core = causal_attention

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.core(q, k, v, mask)
        return self.wo(out.reshape(bsz, seq_len, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _trunc_normal(linear.weight, 0.02)
        _trunc_normal(self.wo.weight, init_std)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        _trunc_normal(self.w1.weight, 0.02)
        _trunc_normal(self.w2.weight, init_std)
        _trunc_normal(self.w3.weight, init_std)


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``.

    ``feed_forward`` replaces the SwiGLU FFN (a model family's own, e.g. the routed MoE of
    ``models/moe.py``): any module mapping ``(batch, seq, dim)`` to the same shape with an
    ``init_weights(init_std)``."""

    def __init__(self, layer_id: int, args: ModelArgs, feed_forward: nn.Module | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.n_layers = args.n_layers
        self.attention = args.build_attention()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward or FeedForward(args.dim, ffn_hidden_dim(args))
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        # Deeper layers start smaller, so the residual stream does not grow with depth
        # (torchtitan's depth-scaled init).
        init_std = 0.02 / (2 * (self.layer_id + 1)) ** 0.5
        self.attention.init_weights(init_std)
        self.feed_forward.init_weights(init_std)
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()


class Transformer(nn.Module):
    """The decoder: embeddings, ``n_layers`` blocks, final norm, output projection."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.build_block(i, args)
                                     for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one Parameter, two uses
        # Derived from args, so not saved in checkpoints; init_weights recomputes it.
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        # data.document_mask: the EOS id that ends packed documents; None: plain causal.
        self.document_eos: int | None = None
        # Each input token's place in the whole sequence (RoPE's angle): context
        # parallelism sets it (a rank holds chunks of the sequence); None: 0, 1, 2, ...
        self.positions: torch.Tensor | None = None
        # (tokens, EOS id) -> (positions in their documents, the attention cores' mask);
        # context parallelism swaps in its own (its tokens are part of the sequence)
        self.documents = document_positions

    def build_block(self, layer_id: int, args: ModelArgs) -> TransformerBlock:
        """Block ``layer_id``; a model family that swaps the FFN overrides this."""
        return TransformerBlock(layer_id, args)

    def _rope_cache(self, device: torch.device | None = None) -> torch.Tensor:
        a = self.args
        return rope_cache(a.rope_dim, a.max_seq_len, a.rope_theta, device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (batch, seq) -> logits (batch, seq, vocab). A pipeline stage without
        ``tok_embeddings`` takes hidden states (batch, seq, dim) instead; one without
        ``output`` returns hidden states."""
        if tokens.shape[1] > self.args.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len="
                             f"{self.args.max_seq_len}")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope, mask = self.rope_cache, None
        if self.positions is not None:
            rope = self.rope_cache[self.positions.to(rope.device)]
        if self.document_eos is not None:  # positions restart per document
            positions, mask = self.documents(tokens, self.document_eos)
            rope = self.rope_cache[positions]
        h = self.run_blocks(h, rope, mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def run_blocks(self, h: torch.Tensor, rope: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
        """The blocks in order. A method of its own so that a graph break inside a block
        (the MoE's routed experts) falls on this call, outside any loop of ``forward``:
        torch.compile then keeps the embedding (with its tensor-parallel output hooks) in
        one graph and the norm and output in another, instead of giving up on ``forward``
        and tracing every module, and every module hook, as a frame of its own."""
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        return h

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize every parameter from torch's RNG and recompute the RoPE buffer.

        In-place ops only, so it works on sharded DTensor parameters (run it under
        ``simplefsdp.disable_active_parametrization()``) and after ``to_empty``.
        """
        self.rope_cache = self._rope_cache(self.rope_cache.device)
        if self.tok_embeddings is not None:
            _trunc_normal(self.tok_embeddings.weight, 0.02)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.init_weights()
        tied = self.args.tie_embeddings and self.tok_embeddings is not None
        if self.output is not None and not tied:
            _trunc_normal(self.output.weight, 0.02)


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    """Normal(0, std) cut at three standard deviations, in place."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


# ---------------------------------------------------------------------------------------
# Counting.
# ---------------------------------------------------------------------------------------
def num_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of distinct parameters (a tied weight counts once; a DTensor counts with
    its global size). ``exclude_embeddings`` drops ``tok_embeddings``."""
    total = sum(p.numel() for p in model.parameters())
    embeddings = getattr(model, "tok_embeddings", None)
    if exclude_embeddings and embeddings is not None:
        total -= embeddings.weight.numel()
    return total


# Model arithmetic: the one owner of a Llama block's parameter count and of the FLOPs of
# its matmuls and attention (the trainer's MFU, the planner's memory and speed bound).
ATTENTION_BACKWARD_FLOPS = 2.5  # attention's backward over its forward (FlashAttention-2)


def block_matmul_params(args: ModelArgs, layer: int | None = None,
                        activated: bool = False) -> int:
    """Parameters of block ``layer``'s matrices (attention's q/k/v/o and the FFN's,
    ``args.ffn_matmul_params``), the ones that take part in matmuls; its two norms
    (``2 * dim``) are not. ``activated``: those one token runs through (a mixture of
    experts: its top-k experts, not all). ``layer=None``: a typical block."""
    return args.attention_matmul_params() + args.ffn_matmul_params(layer, activated)


def attention_flops(heads: float, queries: int, keys: int, head_dim: int,
                    causal: bool = False, value_dim: int | None = None) -> float:
    """Forward FLOPs of attention's score and value matmuls: ``2 * heads * queries * keys
    * (head_dim + value_dim)`` (``value_dim``: the values' features, ``head_dim`` unless
    given), half of it under a causal mask (the scores above the diagonal are skipped)."""
    flops = 2 * heads * queries * keys * (head_dim + (value_dim or head_dim))
    return flops / 2 if causal else flops


def flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Training FLOPs per token: ``6 * N + 12 * L * H * Q * T`` (PaLM appendix B).

    ``N`` counts the parameters that take part in matmuls: all but the token embedding
    (a lookup); the output projection counts even when tied. ``6 N`` is forward (2) plus
    backward (4); the second term is attention's score and value matmuls over ``T``
    positions for ``L`` layers, ``H`` heads of size ``Q`` (not halved for causality),
    forward and backward (3x the forward). A mixture of experts counts the parameters a
    token activates (router, top-k experts, shared expert). Where query/key and value heads
    differ in size (MLA: 192 and 128), ``Q`` is their mean.
    """
    n = sum(block_matmul_params(args, i, activated=True) + args.block_norm_params
            for i in range(args.n_layers)) + args.dim + args.dim * args.vocab_size
    qk, v = args.attention_dims
    return 6 * n + 3 * args.n_layers * attention_flops(args.n_heads, 1, seq_len, qk,
                                                       value_dim=v)
