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
* Ring (``cp_ring``, ``parallel/ring.py``): each local query chunk attends to the key
  chunks before it and causally to its own, partial results merged exactly with their
  log-sum-exps. K/V reach the queries all-gathered over the ring or passed point to point
  around it (``rotate``, ``parallel.cp_rotate``; the memory each holds is there).

The document mask (``data.document_mask``): every rank learns each position's document
over the whole sequence (:class:`ContextDocuments`); the ring masks each (query chunk,
key block) pair by it and skips the pairs no query can see; Ulysses alone masks its
whole sequence as without CP.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._torch_compat import all_gather_autograd, all_to_all_single_autograd, flatten_mesh
from ..mesh import CP_DIMS, ParallelDims
from ..models.llama import causal_attention, document_index, repeat_heads
from .ring import ring_attention, ring_chunks


# ---------------------------------------------------------------------------------------
# Layout.
# ---------------------------------------------------------------------------------------
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
    (heads for sequence), ring across (K/V all-gathered or passed around: ``rotate``)."""

    def __init__(self, mesh: DeviceMesh, rotate: str = "allgather"):
        self.rotate = rotate
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
            k, v = repeat_heads(k, repeats, dim=2), repeat_heads(v, repeats, dim=2)
            q, k, v = (seq_to_heads(x, self.uly_group, self.uly_size) for x in (q, k, v))
        if self.ring_size > 1:
            out = ring_attention(q, k, v, self.ring_group, self.ring_rank, self.ring_size, doc,
                                 self.rotate)
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


def apply_cp(model: nn.Module, mesh: DeviceMesh, seq_len: int, rotate: str = "allgather"
             ) -> None:
    """Context parallelism on a Llama ``Transformer``, in place: each block's attention
    core becomes :class:`ContextAttention` (``rotate``: the ring's K/V exchange), RoPE
    takes this rank's global positions. The inputs must then be this rank's tokens
    (``shard_sequence(x, rank_positions(...))``). Modules with a ``token_group``
    (``models/moe.MoE``) get the context-parallel group."""
    core = ContextAttention(mesh, rotate)
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
