"""The ring pass's K/V exchange (``parallel.cp_rotate = "ring"``): what the traced graphs
cannot time, as ``parallel.ring.RingPass`` schedules it.

Per attention layer on a ring of ``n`` ranks (``RingPass``):

* forward, steps ``0 .. n-1``: at each step but the last a rank sends the K/V block it
  holds (its own first; un-repeated GQA heads, K's dtype: the traced shift's tensor) to
  the next rank, launched before that step's attention, so the step's kernels hide it:
  exposed ``max(0, transfer - attention of the step)``;
* backward, steps ``0 .. n-1``: each step but the last sends the K/V block on again
  (launched before the step's kernels; eager only: compiled, the forward's received
  blocks are kept instead, see :func:`ring_pass_seconds`), and after each step's kernels
  the block's dK/dV accumulator (``ring.grad_accumulator_dtype``) follows it, waited
  for at the next step's end: during step ``s`` the K/V block for step ``s + 1`` and the
  accumulator of step ``s - 1`` are in flight, hidden by step ``s``'s backward kernels;
  the last accumulator shift brings every block's gradients home, exposed whole;
* full activation checkpointing runs the forward's exchange again in backward.

Point to point: one message per shift over the ring's link (``timing.MeshLinks``), no
ring-collective factor. Attention per step: the traced kernels of the ring's rank 0
grouped by step (:func:`step_kernels`: the ``ring.block_pairs`` with work; every rank
has two blocks' work per step), each at ``timing.node_seconds``. The shifts in the traced
graphs are costed here only (``timing.graph_seconds`` gives them no time).
"""

from __future__ import annotations

import torch
from torch import fx

from ..compiler.collectives import ALL_TO_ALL
from ..compiler.cost.memory import value_bytes
from ..parallel.ring import block_pairs, grad_accumulator_dtype
from .timing import attention_op, node_seconds


def step_kernels(size: int, rank: int = 0) -> list[int]:
    """Kernel calls of ring rank ``rank`` at each ring step: the (query chunk, key chunk)
    pairs ``RingPass`` attends when it holds that step's block (``ring.block_pairs``, no
    document mask). Rank 0: 3 at step 0 (its own chunks: two causal, one full), 2 after
    (the later query chunk over both arriving chunks)."""
    return [sum(1 for _ in block_pairs(rank, (rank - step) % size, size, 1, None))
            for step in range(size)]


def ring_shifts(graph: fx.Graph, groups: dict[str, str]) -> list[fx.Node]:
    """The ring pass's shifts in ``graph``: all-to-alls on the ``cp_ring`` group (the
    only exchange there: the all-gathered rotation all-gathers)."""
    return [n for n in graph.nodes
            if n.target == ALL_TO_ALL and groups.get(n.args[-1]) == "cp_ring"]


def _steps(graph: fx.Graph, size: int, backward: bool, dev, compiled: bool) -> list[float]:
    """Attention seconds of every ring step of every layer in ``graph``, in order: its
    attention kernels (forward ones, or backward ones) grouped by :func:`step_kernels`."""
    kernels = [node_seconds(n, dev, compiled) for n in graph.nodes
               if attention_op(n) and ("backward" in attention_op(n)) == backward]
    per_step, out = step_kernels(size), []
    while kernels:
        for count in per_step:
            out.append(sum(kernels[:count]))
            kernels = kernels[count:]
    return out


def shift_bytes(tr) -> tuple[int, int]:
    """(K/V block, dK/dV accumulator) bytes of one shift in trace ``tr`` ((0, 0) without
    the ring pass): what each rank sends to the next per ring step, the block in forward
    and backward, the accumulator in backward. The block is the traced shift's tensor,
    the accumulator the same elements in ``ring.grad_accumulator_dtype``."""
    shifts = ring_shifts(tr.forward.graph, tr.groups)
    if not shifts:
        return 0, 0
    block = shifts[0].meta["val"]  # (K and V, batch, kv heads, 2 chunks, head dim)
    elem = torch.empty((), dtype=grad_accumulator_dtype(block.dtype)).element_size()
    return value_bytes(block), block.numel() * elem


def ring_pass_seconds(tr, dev, fabric, recompute: bool) -> tuple[float, float]:
    """(forward, backward) exposed seconds of the ring pass's shifts in trace ``tr`` (its
    traced blocks; 0 without shifts), ``recompute``: full AC's second forward. The
    backward sends the K/V blocks on again in eager mode (``RingPass.backward``); the
    compiled step keeps the forward's received blocks instead (AOTAutograd merges the
    backward's shifts with the forward's: the traced backward shifts only accumulators)."""
    block, accumulator = shift_bytes(tr)
    if not block:
        return 0.0, 0.0
    size, compiled = tr.key.cp_ring, tr.key.compile
    fw_shifts = len(ring_shifts(tr.forward.graph, tr.groups))
    resent = not compiled or len(ring_shifts(tr.backward.graph, tr.groups)) > (
        fw_shifts // (size - 1) * size)
    kv = fabric.p2p_seconds("cp_ring", block)
    acc = fabric.p2p_seconds("cp_ring", accumulator)
    forward = sum(max(0.0, kv - a) for s, a in enumerate(
        _steps(tr.forward.graph, size, False, dev, compiled)) if s % size < size - 1)
    backward = 0.0
    for s, a in enumerate(_steps(tr.backward.graph, size, True, dev, compiled)):
        step = s % size
        flight = (kv if resent and step < size - 1 else 0.0) + (acc if step >= 1 else 0.0)
        backward += max(0.0, flight - a) + (acc if step == size - 1 else 0.0)  # home
    return forward, backward + (forward if recompute else 0.0)
