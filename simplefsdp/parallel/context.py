"""Context parallelism: one sequence split over ranks, attention made whole again.

Layout. ``cp = cp_ring x cp_ulysses`` ranks share one data-parallel slice: they read the
same batch and each keeps part of every sequence (:func:`shard_sequence`). The sequence
is cut into ``2 * cp_ring`` chunks and ring rank ``r`` holds chunks ``r`` and
``2 * cp_ring - 1 - r`` (head-tail load balance: an early chunk has little causal work, a
late one much, so every rank gets the same); Ulysses rank ``u`` then takes the ``u``-th
contiguous piece of its ring rank's part. RoPE turns each token by its global position
(:func:`positions`, set on the model).

Attention (:class:`ContextAttention`, swapped into each block's ``attention.core``):

* Ulysses (``cp_ulysses``, neighbouring ranks): ``all_to_all_single`` trades the
  sequence shard of q/k/v for a head shard (whole ring part, ``heads / cp_ulysses``
  heads), and the output back. Key/value heads that ``cp_ulysses`` does not divide are
  repeated to the smallest count it does (the query-to-KV head map is kept).
* Ring (``cp_ring``): K/V are **all-gathered** over the ring (not passed point to point):
  the rank then holds the whole sequence's K/V for its heads, ``2 * seq * kv_heads *
  head_dim`` values per layer, kept for backward (a point-to-point ring would keep the
  same for backward unless it re-sent them). Each local query chunk attends to the key
  chunks before it (one full block) and to its own (one causal block); the partial
  results are merged exactly with their log-sum-exps. Backward is written out: each
  block's kernel backward is called with the *merged* output and log-sum-exp, which gives
  its exact share of dq/dk/dv; the all-gather's backward reduce-scatters dk/dv.

Kernels: ``_torch_compat.attention_with_lse`` (CPU: the flash kernel for CPU; CUDA: the
flash kernel, not run here). The document mask (``data.document_mask``): every rank learns
each position's document over the whole sequence (:class:`ContextDocuments`); the ring
masks each (query chunk, key block) pair by it and skips the pairs no query can see
(:class:`RingCore`); Ulysses alone masks its whole sequence as without CP.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._torch_compat import (
    all_gather_autograd,
    all_to_all_single_autograd,
    attention_with_lse,
    attention_with_lse_backward,
    flatten_mesh,
)
from ..mesh import CP_DIMS, ParallelDims
from ..models.llama import causal_attention, document_index


# ---------------------------------------------------------------------------------------
# Layout.
# ---------------------------------------------------------------------------------------
def ring_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of ``2 * size``) ring rank ``rank`` holds: head and tail."""
    return rank, 2 * size - 1 - rank


def positions(seq_len: int, ring: tuple[int, int], ulysses: tuple[int, int] = (0, 1)
              ) -> torch.Tensor:
    """Global positions of the tokens a rank holds, in its order: ``ring`` and ``ulysses``
    are its (index, size) in each group."""
    (r, ring_size), (u, uly_size) = ring, ulysses
    chunk = seq_len // (2 * ring_size)
    part = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in ring_chunks(r, ring_size)])
    piece = part.numel() // uly_size
    return part[u * piece:(u + 1) * piece]


def shard_sequence(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x``'s tokens (dim 1) at ``index`` (from :func:`positions`)."""
    return x.index_select(1, index.to(x.device))


# ---------------------------------------------------------------------------------------
# Ring attention: the exact merge and its backward.
# ---------------------------------------------------------------------------------------
def _blocks(chunk: int, length: int) -> list[tuple[int, int, bool]]:
    """Key ranges (start, end, causal) that query chunk ``chunk`` (of ``length`` tokens)
    attends to, in the naturally ordered sequence: all earlier chunks, then its own."""
    start = chunk * length
    full = [(0, start, False)] if chunk else []
    return full + [(start, start + length, True)]


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention results over disjoint key sets of the same queries as one: weights
    ``exp(lse_i - lse)`` with ``lse = logaddexp(lse_a, lse_b)``, in float32 at least."""
    lse = torch.logaddexp(lse_a, lse_b)
    acc = torch.promote_types(out_a.dtype, torch.float32)
    out = (out_a.to(acc) * (lse_a - lse).exp().unsqueeze(-1)
           + out_b.to(acc) * (lse_b - lse).exp().unsqueeze(-1))
    return out.to(out_a.dtype), lse


def _masked_block(q, k, v, allowed):
    """(output, log-sum-exp) of attention under a boolean mask, by the formula (float32
    at least). A row with no visible key gets output 0 and log-sum-exp -inf, which the
    merge weighs by exp(-inf) = 0."""
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # no key: -inf - -inf
    return (probs @ v.to(acc)).to(q.dtype), lse


def _masked_block_backward(grad, q, k, v, out, lse, allowed):
    """(dq, dk, dv) of one masked block given the *merged* output and log-sum-exp (so the
    probabilities are this block's share of the whole row's softmax)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    q, k, v, grad, out = (x.to(acc) for x in (q, k, v, grad, out))
    scale = q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    probs = torch.exp(scores.masked_fill(~allowed, float("-inf")) - lse.unsqueeze(-1))
    dscores = probs * (grad @ v.transpose(-1, -2) - (grad * out).sum(-1, keepdim=True))
    return dscores @ k * scale, dscores.transpose(-1, -2) @ q * scale, \
        probs.transpose(-1, -2) @ grad


class RingCore(torch.autograd.Function):
    """Causal attention of a rank's two query chunks over the whole (naturally ordered)
    key/value sequence, ``(batch, heads, seq, head_dim)`` each. With ``doc`` (each
    position's document index, ``(batch, seq)``, natural order) a query sees only keys of
    its own document: each block is masked (``_masked_block``), and a block no query of the
    chunk can see is skipped (eager only: the test is data-dependent)."""

    @staticmethod
    def forward(ctx, q, k, v, rank: int, size: int, doc=None):
        length = q.shape[2] // 2
        outs, lses = [], []
        for i, chunk in enumerate(ring_chunks(rank, size)):
            qi = q[:, :, i * length:(i + 1) * length]
            out = lse = None
            for start, end, causal, allowed in _visible(chunk, length, doc):
                if allowed is None:
                    o, s = attention_with_lse(qi, k[:, :, start:end], v[:, :, start:end],
                                              causal)
                else:
                    o, s = _masked_block(qi, k[:, :, start:end], v[:, :, start:end], allowed)
                out, lse = (o, s) if out is None else merge(out, lse, o, s)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, doc)
        ctx.rank, ctx.size = rank, size
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, doc = ctx.saved_tensors
        length = q.shape[2] // 2
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for i, chunk in enumerate(ring_chunks(ctx.rank, ctx.size)):
            rows = slice(i * length, (i + 1) * length)
            gi, qi = grad[:, :, rows].contiguous(), q[:, :, rows]
            oi, si = out[:, :, rows].contiguous(), lse[:, :, rows].contiguous()
            for start, end, causal, allowed in _visible(chunk, length, doc):
                kv = k[:, :, start:end], v[:, :, start:end]
                if allowed is None:
                    g = attention_with_lse_backward(gi, qi, *kv, oi, si, causal)
                else:
                    g = _masked_block_backward(gi, qi, *kv, oi, si, allowed)
                dq[:, :, rows] += g[0]
                dk[:, :, start:end] += g[1]
                dv[:, :, start:end] += g[2]
        return dq, dk, dv, None, None, None


def _visible(chunk: int, length: int, doc: torch.Tensor | None):
    """:func:`_blocks` with each block's document mask (None without ``doc``); blocks no
    query can see left out (not while compiling: a data-dependent test)."""
    for start, end, causal in _blocks(chunk, length):
        if doc is None:
            yield start, end, causal, None
            continue
        q_doc = doc[:, None, chunk * length:(chunk + 1) * length, None]
        allowed = q_doc == doc[:, None, None, start:end]
        if causal:
            allowed = allowed & torch.ones(length, length, dtype=torch.bool,
                                           device=doc.device).tril()
        if torch.compiler.is_compiling() or bool(allowed.any()):
            yield start, end, causal, allowed


def natural_order(size: int, length: int) -> torch.Tensor:
    """Token index into the ring's all-gather (rank 0's two chunks, rank 1's, ...) for
    each position of the sequence in order."""
    gathered = [c for r in range(size) for c in ring_chunks(r, size)]
    slot = {c: i for i, c in enumerate(gathered)}
    return torch.cat([torch.arange(slot[c] * length, (slot[c] + 1) * length)
                      for c in range(2 * size)])


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup, rank: int, size: int,
                   doc: torch.Tensor | None = None) -> torch.Tensor:
    """Exact causal attention of this ring rank's tokens (its two chunks, ``(batch, seq,
    heads, head_dim)``; k/v may have fewer heads) over the whole ring's sequence; within
    documents with ``doc`` (:class:`RingCore`)."""
    length = q.shape[1] // 2
    order = natural_order(size, length).to(q.device)

    def gather(x):  # (b, s, h, d) -> whole sequence in order, (b, h, S, d)
        whole = all_gather_autograd(x.transpose(0, 1).contiguous(), group)
        return whole.index_select(0, order).permute(1, 2, 0, 3)

    k, v = gather(k), gather(v)
    n_rep = q.shape[2] // k.shape[1]
    if n_rep > 1:  # grouped-query attention: each K/V head serves n_rep query heads
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    out = RingCore.apply(q.transpose(1, 2), k, v, rank, size, doc)
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------
# Ulysses.
# ---------------------------------------------------------------------------------------
def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """``(b, s, h, d)`` sequence-sharded -> ``(b, size * s, h / size, d)`` head-sharded."""
    b, s, h, d = x.shape
    x = x.reshape(b, s, size, h // size, d).permute(2, 0, 1, 3, 4).reshape(size * b, s, -1, d)
    y = all_to_all_single_autograd(x.contiguous(), [b] * size, [b] * size, group)
    return y.view(size, b, s, -1, d).transpose(0, 1).reshape(b, size * s, -1, d)


def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`."""
    b, whole, hs, d = y.shape
    s = whole // size
    y = y.reshape(b, size, s, hs, d).transpose(0, 1).reshape(size * b, s, hs, d)
    x = all_to_all_single_autograd(y.contiguous(), [b] * size, [b] * size, group)
    return x.view(size, b, s, hs, d).permute(1, 2, 0, 3, 4).reshape(b, s, size * hs, d)


def kv_repeats(kv_heads: int, size: int) -> int:
    """How many times to repeat each key/value head so that ``size`` divides them."""
    return size // math.gcd(kv_heads, size)


class ContextAttention:
    """A block's attention core (``Attention.core``) over the cp ranks: Ulysses inside
    (heads for sequence), ring across (K/V all-gathered)."""

    def __init__(self, mesh: DeviceMesh):
        self.ring_size, self.uly_size = mesh["cp_ring"].size(), mesh["cp_ulysses"].size()
        self.ring_rank = ParallelDims.local_rank(mesh, "cp_ring")
        self.ring_group = mesh["cp_ring"].get_group()
        self.uly_group = mesh["cp_ulysses"].get_group()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 doc: torch.Tensor | None = None) -> torch.Tensor:
        """``doc`` (document mask): each position's document index over the whole
        sequence, ``(batch, seq)`` in order (:class:`ContextDocuments`)."""
        if self.uly_size > 1:
            repeats = kv_repeats(k.shape[2], self.uly_size)
            if repeats > 1:
                k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
            q, k, v = (seq_to_heads(x, self.uly_group, self.uly_size) for x in (q, k, v))
        if self.ring_size > 1:
            out = ring_attention(q, k, v, self.ring_group, self.ring_rank, self.ring_size, doc)
        else:  # Ulysses alone: the whole sequence, in order
            out = causal_attention(q, k, v, None if doc is None else document_mask(doc))
        if self.uly_size > 1:
            out = heads_to_seq(out, self.uly_group, self.uly_size)
        return out


def document_mask(doc: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask ``(batch, 1, seq, seq)`` of document indices."""
    causal = torch.ones(doc.shape[1], doc.shape[1], dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


class ContextDocuments:
    """The model's ``documents`` under context parallelism: this rank's token positions
    within their documents, and for the attention cores each position's document index
    over the whole sequence (``(batch, seq)``, in order). The token ids of the whole
    sequence are all-gathered over the CP ranks first (``batch * seq`` ids per forward)."""

    def __init__(self, mesh: DeviceMesh, seq_len: int, group: dist.ProcessGroup):
        self.group = group  # cp_group(mesh)
        ring, uly = mesh["cp_ring"].size(), mesh["cp_ulysses"].size()
        # the global positions of the gathered tokens (CP ranks in group order: ring
        # outside, Ulysses inside), and of this rank's
        self.slots = torch.cat([positions(seq_len, (r, ring), (u, uly))
                                for r in range(ring) for u in range(uly)])
        self.mine = rank_positions(mesh, seq_len)

    def __call__(self, tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        gathered = all_gather_autograd(tokens.t().contiguous(), self.group)  # (seq, batch)
        whole = torch.empty_like(gathered).index_copy_(0, self.slots.to(tokens.device),
                                                       gathered).t()
        where, doc = document_index(whole, eos_id)
        return where[:, self.mine.to(tokens.device)], doc


def rank_positions(mesh: DeviceMesh, seq_len: int) -> torch.Tensor:
    """This rank's token positions (:func:`positions`) in ``mesh``'s cp dims."""
    return positions(seq_len, (ParallelDims.local_rank(mesh, "cp_ring"), mesh["cp_ring"].size()),
                     (ParallelDims.local_rank(mesh, "cp_ulysses"), mesh["cp_ulysses"].size()))


def apply_cp(model: nn.Module, mesh: DeviceMesh, seq_len: int) -> None:
    """Context parallelism on a Llama ``Transformer``, in place: each block's attention
    core becomes :class:`ContextAttention`, RoPE takes this rank's global positions. The
    inputs must then be this rank's tokens (``shard_sequence(x, rank_positions(...))``).
    Modules with a ``token_group`` (``models/moe.MoE``) get the context-parallel group."""
    core = ContextAttention(mesh)
    for block in model.layers.values():
        block.attention.core = core
    model.positions = rank_positions(mesh, seq_len)
    group = cp_group(mesh)
    model.documents = ContextDocuments(mesh, seq_len, group)  # with data.document_mask
    for module in model.modules():  # statistics over whole sequences (MoE balance loss)
        if hasattr(module, "token_group"):
            module.token_group = group


def cp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """One process group over this rank's context-parallel ranks (ring x Ulysses)."""
    dims = tuple(d for d in CP_DIMS if mesh[d].size() > 1)
    if len(dims) == 1:
        return mesh[dims[0]].get_group()
    return flatten_mesh(mesh[dims], "cp").get_group()


def cp_batches(batches: list[tuple[torch.Tensor, ...]], mesh: DeviceMesh,
               seq_len: int) -> list[tuple[torch.Tensor, ...]]:
    """This rank's tokens of each tensor of each batch (inputs, targets): the loader
    serves data-parallel ranks, the context-parallel ranks of one slice split it."""
    index = rank_positions(mesh, seq_len)
    return [tuple(shard_sequence(x, index) for x in batch) for batch in batches]
