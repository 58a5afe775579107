"""Per-rank memory: model states from the model's shapes, activations from a liveness
pass over the captured forward and backward graphs, plus the eager loss and pipeline
microbatches in flight.

* Model states (``states_bytes``): the trainer builds the model in float32, so every
  parameter shard is float32, and so are its gradient and AdamW's two moments:
  16 bytes per parameter per rank (``cost.state.model_state_bytes_per_param``).
  Gradients (``gradient_bytes``) are counted whole from the step's first backward on
  (the largest they get, at the end of backward); before it they do not exist (set to
  None after each step), so the forward's and the loss's peaks of a step's only
  microbatch leave them out (``predict._role_memory``).
* Activations (``graph_memory``): the cost model's liveness (``live_bytes``): a tensor is
  live from the node that makes it to its last use (views, ``getitem``, waits and
  in-place ops alias their input). Parameter
  shards and the reduce-scattered gradients are left out (they are model states).
  Tensors whose size scales with the data-parallel shard (found by dataflow from the
  shards) are rescaled from the traced to the planned ``dp_shard``.
* Loss (``loss_peaks``): the trainer computes the cross-entropy eagerly on the logits
  the compiled model returns: ``logits.float()``, ``log_softmax`` (kept for backward),
  then in backward its gradient, the ``log_softmax`` gradient and the cast back. Under
  loss parallel each TP rank holds its vocabulary columns only (``loss_vocab``), and
  torch's DTensor handlers hold more of them at once (16 B per logit, not 12).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from ..compiler.collectives import ALL_GATHER, REDUCE_SCATTER
from ..compiler.cost.memory import (
    alias_bases,
    alias_roots,
    held_by_caller,
    live_bytes,
    value_bytes,
)
from ..compiler.cost.state import model_state_bytes_per_param
from ..config.job import DTYPES
from ..models.llama import block_matmul_params
from .trace import Trace


@dataclass
class GraphMemory:
    """Bytes of one traced forward+backward at the planned data-parallel size."""

    forward_peak: int  # during the forward graph
    saved: int  # kept from forward for backward (not counting the returned output)
    output: int  # the forward's returned tensor (logits or hidden states)
    backward_peak: int  # during the backward graph


def shard_nodes(graph: fx.Graph, shards: set, dp_groups: set[str],
                seeds: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """Nodes whose size is a parameter shard's: shard placeholders, ``seeds`` (the
    backward's saved inputs that were shard-sized in the forward, e.g. a bf16 cast of a
    shard), outputs of reduce-scatters over a data-parallel group (``dp_groups``; the
    tensor-parallel ones are sequence-parallel activations), and anything computed
    from those alone (casts, bucket copy-ins)."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if node in seeds or isinstance(val, torch.Tensor) and (
                    tuple(int(d) for d in val.shape), val.dtype) in shards:
                found.add(node)
        elif node.op == "call_function":
            if node.target == REDUCE_SCATTER and node.args[-1] in dp_groups:
                found.add(node)
            elif node.target != ALL_GATHER:
                inputs = [a for a in node.all_input_nodes if "val" in a.meta]
                if inputs and all(a in found for a in inputs):
                    found.add(node)
    return found


def forward_outputs(tr: Trace) -> tuple[list[fx.Node], list[fx.Node]]:
    """The forward graph's (user outputs, tensors saved for backward): AOTAutograd's
    forward returns the user's outputs first, then what the backward takes."""
    outputs = next(n for n in tr.forward.graph.nodes if n.op == "output").args[0]
    nodes = [(i, a) for i, a in enumerate(outputs) if isinstance(a, fx.Node)]
    return ([a for i, a in nodes if i < tr.n_forward_outputs],
            [a for i, a in nodes if i >= tr.n_forward_outputs])


def saved_inputs(tr: Trace) -> dict[fx.Node, fx.Node]:
    """Backward placeholder -> the forward node it was saved from (the partitioner names
    a saved tensor's backward input after its forward node)."""
    by_name = {a.name: a for a in forward_outputs(tr)[1]}
    return {n: by_name[n.name] for n in tr.backward.graph.nodes
            if n.op == "placeholder" and n.name in by_name}


def trace_shards(tr: Trace) -> tuple[set[fx.Node], set[fx.Node]]:
    """Shard-sized nodes of the forward and backward graphs. A shard-sized tensor saved
    for backward stays shard-sized there even when its dtype is no parameter's (the
    bf16 casts of the shards): without that, the backward would count it at the
    traced ``dp_shard``."""
    dp = {name for name, dim in tr.groups.items() if dim in ("dp_replicate", "dp_shard")}
    fw = shard_nodes(tr.forward.graph, tr.shards, dp)
    seeds = {p for p, a in saved_inputs(tr).items() if a in fw}
    return fw, shard_nodes(tr.backward.graph, tr.shards, dp, seeds)


def _backward_aliases(tr: Trace) -> Callable:
    """``alias_of`` for the backward graph: a saved input whose forward allocation
    another saved input already holds (a tensor and its view or wait, both saved) is
    that input's alias, so the allocation is counted once, as the forward counts it."""
    root = alias_roots(tr.forward.graph)
    first: dict[fx.Node, fx.Node] = {}
    alias: dict[fx.Node, fx.Node] = {}
    for p, a in saved_inputs(tr).items():
        for r in root[a]:
            if r in first:
                alias[p] = first[r]
            else:
                first[r] = p
    return lambda n: [alias[n]] if n in alias else alias_bases(n)


def _live(graph: fx.Graph, size: dict[fx.Node, int], skip: set[fx.Node],
          alias_of: Callable = alias_bases) -> list[int]:
    """Live bytes per node; ``skip``: tensors not counted (model states). Inputs the
    caller holds for the whole graph (``held_by_caller``: the batch, a backward's
    incoming gradient, e.g. the logits') stay live throughout, as the cost model counts
    them."""
    return live_bytes(graph, lambda n: 0 if n in skip else size.get(n, 0),
                      pinned=held_by_caller(graph), alias_of=alias_of)


def graph_memory(tr: Trace, dp_shard: int) -> GraphMemory:
    """Liveness of ``tr``'s graphs with shard-sized tensors scaled to ``dp_shard``."""
    scale = tr.key.dp_shard / dp_shard
    sizes, skips = [], []
    for gm, shard in zip((tr.forward, tr.backward), trace_shards(tr), strict=True):
        size = {n: int(value_bytes(n.meta.get("val")) * (scale if n in shard else 1))
                for n in gm.graph.nodes}
        # model states: parameter shards in, gradient shards out of the backward. The
        # forward's shard-sized outputs are activations saved for backward (the bf16
        # casts of the shards, under mixed precision): counted.
        skip = {n for n in shard if n.op == "placeholder" and _is_param_shard(n, tr.shards)}
        if gm is tr.backward:
            out = next(n for n in gm.graph.nodes if n.op == "output")
            skip |= {a for a in out.all_input_nodes if a in shard}
        sizes.append(size)
        skips.append(skip)
    fw, bw = tr.forward.graph, tr.backward.graph
    fw_live = _live(fw, sizes[0], skips[0])
    user, saved = forward_outputs(tr)
    root = alias_roots(fw)

    def held(nodes: list[fx.Node]) -> int:  # each allocation once, model states left out
        allocs = dict.fromkeys(r for a in nodes for r in root[a])
        return sum(sizes[0].get(r, 0) for r in allocs if r not in skips[0])

    user_bytes = held(user)
    saved_bytes = held(saved)
    bw_live = _live(bw, sizes[1], skips[1], _backward_aliases(tr))
    return GraphMemory(max(fw_live, default=0), saved_bytes, user_bytes, max(bw_live, default=0))


def _is_param_shard(node: fx.Node, shards: set) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and (
        tuple(int(d) for d in val.shape), val.dtype) in shards


def loss_peaks(tokens: int, vocab: int, logits_bytes_per_elem: int,
               vocab_sharded: bool = False) -> tuple[int, int]:
    """Extra bytes over the saved activations while the eager cross-entropy runs, per
    logit (``vocab``: one rank's, ``loss_vocab``), counted from the ops torch runs:

    * plain: forward, the logits + their float32 copy + ``log_softmax`` (kept for
      backward); backward, ``log_softmax`` + ``nll_loss_backward``'s gradient +
      ``_log_softmax_backward_data``'s: 12 B.
    * loss parallel (``vocab_sharded``): torch's DTensor handlers run unfused ops on the
      local columns. Forward, ``log_softmax`` keeps the shifted logits and their ``exp``
      alive next to the float32 copy: logits + 12 B. Backward, one function does both
      gradients, ``(zeros_like(x) + exp(x)) * grad``: the saved ``log_softmax`` x, the
      zeros (held to the end), ``exp(x)`` or the sum, and the product: 16 B."""
    n, e = tokens * vocab, logits_bytes_per_elem
    copy = 4 if e != 4 else 0
    if vocab_sharded:
        return n * (e + copy + 8), 16 * n
    return n * (e + copy + 4), 12 * n


def loss_vocab(args, parallel) -> int:
    """Logits per token one rank's loss holds: the vocabulary, split over TP under loss
    parallel (``parallel.vocab_sharded_loss``; the output projection's columns)."""
    return args.vocab_size // parallel.tp if parallel.vocab_sharded_loss else args.vocab_size


def stage_params(args, role: str, layers: list[int], tp: int) -> float:
    """Parameters other than the routed experts one tensor-parallel rank of a stage
    holds before data-parallel sharding (``layers``: the stage's block indices): the
    blocks' matrices split ``tp`` ways, but a mixture of experts' router whole on every TP
    rank (each routes its own tokens), norms and embeddings whole. The routed experts are
    :func:`rank_params`' second term."""
    total = sum((block_matmul_params(args, i) - args.routed_params(i)) / tp
                + args.router_params(i) + args.block_norm_params
                for i in layers)
    if role in ("full", "first"):
        total += args.vocab_size * args.dim
    if role in ("full", "last"):
        total += args.dim + (0 if args.tie_embeddings and role == "full"
                             else args.vocab_size * args.dim)
    return total


def rank_params(args, role: str, layers: list[int], dims, mode: str, etp: int = 1) -> float:
    """Parameters one rank of a stage holds (``dims``: resolved ``ParallelDims``, ``mode``:
    the data-parallel mode): :func:`stage_params` sharded over ``dp_shard x cp``, plus the
    routed experts (:func:`rank_expert_params`)."""
    return stage_params(args, role, layers, dims.tp) / dims.dp_shard_cp \
        + rank_expert_params(args, layers, dims, mode, etp)


def rank_expert_params(args, layers: list[int], dims, mode: str, etp: int = 1) -> float:
    """Routed-expert parameters of ``layers`` one rank stores: split ``ep`` ways and each
    part sharded over the ranks holding the same experts (``ParallelDims.expert_shard``).
    ``etp = 1``: not split by TP, the experts' mesh puts TP ranks among those, so in
    ``fully_shard`` a rank holds ``1 / (dp_shard x cp x tp)`` of them. ``etp = tp``
    (``parallel/expert_tensor.py``): each expert's width split ``etp`` ways, the rest
    sharded over ``dp_shard x cp / ep``: the same ``fully_shard`` share, ``1 / etp`` of
    the ``etp = 1`` share where the experts are not sharded (``replicate``)."""
    experts = sum(args.expert_params(i) for i in layers)
    return experts / (etp * dims.ep * dims.expert_shard(mode, etp))


def expert_gather_bytes(args, layers: list[int], dims, mode: str, elem: int,
                        etp: int = 1) -> tuple[float, float]:
    """(bytes a read returns, bytes that reach the rank) of one rank's data-parallel
    all-gathers of ``layers``' routed experts per read (a forward, or a backward
    re-gather; ``elem``: bytes per gathered element, the mixed-precision dtype's). A read
    returns the rank's experts whole, ``1 / ep`` of them, under ETP only its ``1 / etp``
    width slice; of that the ``S - 1`` other shards of its ``S =
    ParallelDims.expert_shard`` arrive (none where the experts are not sharded)."""
    read = sum(args.expert_params(i) for i in layers) / (dims.ep * etp) * elem
    shard = dims.expert_shard(mode, etp)
    return read, read * (shard - 1) / shard


def rank_tokens(batch: int, seq_len: int, dims) -> int:
    """Tokens of a ``batch x seq_len`` microbatch one rank computes: with context
    parallelism (``dims.cp`` ranks per sequence) its part of each sequence, the logits
    of which its loss holds."""
    return batch * seq_len // dims.cp


def activation_elem_bytes(training) -> int:
    """Bytes per activation element (logits, TP-collective activations): the mixed
    precision parameter dtype the compiled step computes in."""
    return DTYPES[training.mixed_precision_param].itemsize


def states_bytes(params_per_rank: float) -> float:
    """float32 shard + gradient + AdamW exp_avg and exp_avg_sq (the optimizer's layout is
    ``cost.state``'s)."""
    return model_state_bytes_per_param("adamw") * params_per_rank


def gradient_bytes(params_per_rank: float) -> float:
    """The gradients' part of ``states_bytes``: one float32 per parameter, as the
    shards they reduce to."""
    return torch.float32.itemsize * params_per_rank
