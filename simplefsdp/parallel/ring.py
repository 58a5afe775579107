"""Ring attention: exact causal attention of a rank's two load-balanced sequence chunks
over the whole ring's keys and values.

Layout (``parallel/context.py`` shards the sequence): the sequence is cut into ``2 *
size`` chunks and ring rank ``r`` holds chunks ``r`` and ``2 * size - 1 - r``
(:func:`ring_chunks`). Query chunk ``i`` sees key chunks ``m < i`` whole, its own
causally, none after it. Partial results over disjoint key blocks are merged exactly with
their log-sum-exps (:func:`merge`); each block's backward is the kernel's, called with
the *merged* output and log-sum-exp, which gives that block's exact share of dq/dk/dv.

Two ways to bring the keys and values to the queries (``parallel.cp_rotate``):

* ``"allgather"`` (:class:`GatheredKVAttention`): K/V all-gathered over the ring once
  per layer; a rank holds the whole sequence's K/V for its heads (``size`` blocks each
  of K and V, after GQA's repeat), kept for backward; the all-gather's backward
  reduce-scatters dK/dV. Two kernel calls per query chunk.
* ``"ring"`` (:class:`RingPass`): K/V passed point to point around the ring, ``size``
  steps: each step a rank sends the block it holds to the next rank and receives the
  previous rank's (a ring shift: ``all_to_all_single`` with only the neighbour's split
  non-zero, functional, so compiled graphs carry it too), launched before the step's
  attention so the exchange overlaps it. A rank holds two K/V blocks at a time (the one
  in use, the one arriving) and keeps only its own for backward. The backward is
  written out and passes the blocks around again: each step the block's dK/dV
  accumulator travels with it, the step's share added; one last shift brings every
  accumulator home. The accumulators are float32 under mixed precision
  (:func:`grad_accumulator_dtype`: twice the bytes of bf16 K/V on the wire, one rounding
  to K's dtype at home). Key/value heads stay un-repeated on the wire (GQA: repeated per
  kernel call, their gradients summed back).

Kernels: ``_torch_compat.attention_with_lse`` (CPU: the flash kernel for CPU; CUDA: the
flash kernel). With the
document mask (``doc``: each position's document index over the whole sequence,
``(batch, seq)`` in order) every block is masked by
document (the formula, :func:`_masked_block`) and, in eager mode, a block no query can
see is skipped (a data-dependent test: compiled graphs compute it masked, weighed 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._torch_compat import (
    all_gather_autograd,
    all_to_all_single_autograd,
    attention_with_lse,
    attention_with_lse_backward,
)
from ..models.llama import repeat_heads


def ring_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of ``2 * size``) ring rank ``rank`` holds: head and tail."""
    return rank, 2 * size - 1 - rank


def grad_accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :class:`RingPass`'s backward accumulates dq and the travelling dK/dV in,
    and sends the dK/dV in, for q/k/v of ``dtype``: float32 at least (float64 stays). In
    ``dtype`` (bf16) every hop would round the running sum, an error growing with the
    ring size; here each partial is rounded once (by the kernel) and the sum once, at
    home. Cost: the accumulators' shifts carry 4-byte elements, 2x the bytes of bf16 K/V
    (``size`` shifts of a dK/dV block each backward). The planner counts the bytes with
    this too."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------
# One block: the kernel, or the formula under a document mask; the exact merge.
# ---------------------------------------------------------------------------------------
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


def _attend(q, k, v, causal: bool, allowed):
    """(output, log-sum-exp) of one block: the kernel, or the formula under ``allowed``."""
    if allowed is None:
        return attention_with_lse(q, k, v, causal)
    return _masked_block(q, k, v, allowed)


def _attend_backward(grad, q, k, v, out, lse, causal: bool, allowed):
    """(dq, dk, dv) of :func:`_attend` given the merged ``out`` and ``lse``."""
    if allowed is None:
        return attention_with_lse_backward(grad, q, k, v, out, lse, causal)
    return _masked_block_backward(grad, q, k, v, out, lse, allowed)


def _block_mask(doc: torch.Tensor | None, q_start: int, length: int, k_start: int,
                k_end: int, causal: bool) -> tuple[bool, torch.Tensor | None]:
    """(visible, allowed) of queries ``[q_start, q_start + length)`` over keys ``[k_start,
    k_end)`` of the natural sequence: without ``doc`` (True, None); with it the mask
    (same document; causal on the diagonal), and whether any query sees a key (always
    True while compiling: the test is data-dependent)."""
    if doc is None:
        return True, None
    allowed = doc[:, None, q_start:q_start + length, None] == doc[:, None, None, k_start:k_end]
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool,
                                       device=doc.device).tril()
    return torch.compiler.is_compiling() or bool(allowed.any()), allowed


# ---------------------------------------------------------------------------------------
# All-gathered K/V.
# ---------------------------------------------------------------------------------------
def _blocks(chunk: int, length: int) -> list[tuple[int, int, bool]]:
    """Key ranges (start, end, causal) that query chunk ``chunk`` (of ``length`` tokens)
    attends to, in the naturally ordered sequence: all earlier chunks, then its own."""
    start = chunk * length
    full = [(0, start, False)] if chunk else []
    return full + [(start, start + length, True)]


def _visible(chunk: int, length: int, doc: torch.Tensor | None):
    """:func:`_blocks` with each block's document mask; blocks no query sees left out."""
    for start, end, causal in _blocks(chunk, length):
        visible, allowed = _block_mask(doc, chunk * length, length, start, end, causal)
        if visible:
            yield start, end, causal, allowed


class GatheredKVAttention(torch.autograd.Function):
    """Causal attention of a rank's two query chunks over the whole (naturally ordered,
    all-gathered) key/value sequence, ``(batch, heads, seq, head_dim)`` each; within
    documents with ``doc``."""

    @staticmethod
    def forward(ctx, q, k, v, rank: int, size: int, doc=None):
        length = q.shape[2] // 2
        outs, lses = [], []
        for i, chunk in enumerate(ring_chunks(rank, size)):
            qi = q[:, :, i * length:(i + 1) * length]
            out = lse = None
            for start, end, causal, allowed in _visible(chunk, length, doc):
                o, s = _attend(qi, k[:, :, start:end], v[:, :, start:end], causal, allowed)
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
                g = _attend_backward(gi, qi, *kv, oi, si, causal, allowed)
                dq[:, :, rows] += g[0]
                dk[:, :, start:end] += g[1]
                dv[:, :, start:end] += g[2]
        return dq, dk, dv, None, None, None


def natural_order(size: int, length: int) -> torch.Tensor:
    """Token index into the ring's all-gather (rank 0's two chunks, rank 1's, ...) for
    each position of the sequence in order."""
    gathered = [c for r in range(size) for c in ring_chunks(r, size)]
    slot = {c: i for i, c in enumerate(gathered)}
    return torch.cat([torch.arange(slot[c] * length, (slot[c] + 1) * length)
                      for c in range(2 * size)])


def _allgather_attention(q, k, v, group, rank, size, doc):
    """:class:`GatheredKVAttention` on the all-gathered K/V; ``(batch, heads, seq,
    head_dim)``."""
    order = natural_order(size, q.shape[2] // 2).to(q.device)

    def gather(x):  # (b, h, s, d) -> the whole sequence in order, (b, h, S, d)
        whole = all_gather_autograd(x.permute(2, 0, 1, 3).contiguous(), group)
        return whole.index_select(0, order).permute(1, 2, 0, 3)

    n_rep = q.shape[1] // k.shape[1]
    k, v = (repeat_heads(gather(x), n_rep, dim=1) for x in (k, v))
    return GatheredKVAttention.apply(q, k, v, rank, size, doc)


# ---------------------------------------------------------------------------------------
# K/V passed around the ring.
# ---------------------------------------------------------------------------------------
def _shift(x: torch.Tensor, group: str, rank: int, size: int) -> torch.Tensor:
    """``x`` sent to the next ring rank, the previous rank's ``x`` received (same shape):
    ``all_to_all_single`` with only the neighbours' splits non-zero (the functional
    collective; :class:`RingPass` records no autograd graph inside, its backward is
    written out). In eager mode the result is waited for when first used, so work issued
    in between overlaps it."""
    n = x.shape[0]
    send, recv = [0] * size, [0] * size
    send[(rank + 1) % size], recv[(rank - 1) % size] = n, n
    return all_to_all_single_autograd(x.contiguous(), recv, send, group)


def block_pairs(rank: int, holder: int, size: int, length: int, doc):
    """The (query chunk, key chunk) pairs with work when ``rank`` holds ring rank
    ``holder``'s K/V: (query slice, key slice, causal, allowed), slices of the two
    chunks each rank holds; a key chunk after the query chunk has none."""
    for i, q_chunk in enumerate(ring_chunks(rank, size)):
        for j, k_chunk in enumerate(ring_chunks(holder, size)):
            if k_chunk > q_chunk:
                continue
            causal = k_chunk == q_chunk
            visible, allowed = _block_mask(doc, q_chunk * length, length, k_chunk * length,
                                           (k_chunk + 1) * length, causal)
            if visible:
                yield (slice(i * length, (i + 1) * length),
                       slice(j * length, (j + 1) * length), causal, allowed)


class RingPass(torch.autograd.Function):
    """Causal attention of a rank's two query chunks, ``(batch, heads, 2 * length,
    head_dim)``, over the ring's K/V passed point to point (``(batch, kv_heads, 2 *
    length, head_dim)``, this rank's two chunks; ``group``: the ring's process group
    name); within documents with ``doc``."""

    @staticmethod
    def forward(ctx, q, k, v, group: str, rank: int, size: int, doc=None):
        length, n_rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
        out = [None, None]  # per query chunk: (output, log-sum-exp) so far
        held = torch.stack((k, v))
        for step in range(size):
            arriving = _shift(held, group, rank, size) if step < size - 1 else None
            for rows, keys, causal, allowed in block_pairs(rank, (rank - step) % size,
                                                           size, length, doc):
                i = rows.start // length
                o, s = _attend(q[:, :, rows], repeat_heads(held[0][:, :, keys], n_rep, dim=1),
                               repeat_heads(held[1][:, :, keys], n_rep, dim=1), causal, allowed)
                out[i] = (o, s) if out[i] is None else merge(*out[i], o, s)
            held = arriving
        result, lse = (torch.cat(x, dim=2) for x in zip(*out, strict=True))
        ctx.save_for_backward(q, k, v, result, lse, doc)
        ctx.group, ctx.rank, ctx.size = group, rank, size
        return result

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, doc = ctx.saved_tensors
        group, rank, size = ctx.group, ctx.rank, ctx.size
        length, n_rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
        acc = grad_accumulator_dtype(k.dtype)
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=acc)
        held, travelling = torch.stack((k, v)), None  # a block, and its dK/dV so far
        for step in range(size):
            arriving = _shift(held, group, rank, size) if step < size - 1 else None
            dkv = torch.zeros_like(held, dtype=acc)
            for rows, keys, causal, allowed in block_pairs(rank, (rank - step) % size,
                                                           size, length, doc):
                kv = (repeat_heads(held[0][:, :, keys], n_rep, dim=1),
                      repeat_heads(held[1][:, :, keys], n_rep, dim=1))
                g = _attend_backward(grad[:, :, rows], q[:, :, rows], *kv,
                                     out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(),
                                     causal, allowed)
                dq[:, :, rows] += g[0]
                for x, dx in zip(dkv, g[1:], strict=True):  # GQA: the repeats' sum
                    x[:, :, keys] += dx.unflatten(1, (-1, n_rep)).sum(2, dtype=acc)
            if travelling is not None:
                dkv = dkv + travelling
            travelling = _shift(dkv, group, rank, size)  # after the last step: home
            held = arriving
        dk, dv = travelling.to(k.dtype)  # rounded to K's dtype once, at home
        return dq.to(q.dtype), dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup, rank: int, size: int,
                   doc: torch.Tensor | None = None, rotate: str = "allgather") -> torch.Tensor:
    """Exact causal attention of this ring rank's tokens (its two chunks, ``(batch, seq,
    heads, head_dim)``; k/v may have fewer heads) over the whole ring's sequence; within
    documents with ``doc``. ``rotate`` (``parallel.cp_rotate``): how K/V reach the
    queries, "allgather" (:class:`GatheredKVAttention`) or "ring" (:class:`RingPass`)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if rotate == "ring":
        out = RingPass.apply(q, k, v, group.group_name, rank, size, doc)
    else:
        out = _allgather_attention(q, k, v, group, rank, size, doc)
    return out.transpose(1, 2)
