"""Step time of one rank from its captured graphs: a roofline per op and a two-stream
(compute, communication) simulation of the scheduled graph (``compiler.simulate``).

Per op: the cost model's roofline (``compiler.cost.compute.roofline_seconds``) in its
planner setting, ``max(FLOPs / (peak * efficiency), bytes / (HBM bandwidth * memory
efficiency))`` plus a per-kernel floor, with the device profile's efficiency table
(``hardware.Efficiency``: the same figures for every configuration; nothing is tuned per
case). Model arithmetic (a block's parameters, attention's FLOPs) is
``models.llama``'s; the optimizer's memory traffic is ``compiler.cost.state``'s.

Per collective: ``alpha + beta * bytes`` for its process group, from the device's
fabrics (``hardware.Fabric``) and the layout (:class:`MeshLinks`). The simulation
issues a collective on its group's stream when the compute stream reaches it, and a
``wait`` stalls compute until it finishes: prefetched (reordered) collectives hide, eager
ones (waited on at once) are exposed.
"""

from __future__ import annotations

import math

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from ..compiler.collectives import ALL_TO_ALL, KINDS, CollectiveKind, full_value, module_fqn
from ..compiler.cost.compute import is_zero_cost, roofline_seconds
from ..compiler.cost.memory import op_schema, value_bytes
from ..compiler.cost.state import optimizer_traffic_bytes_per_param
from ..compiler.simulate import simulate_graph
from ..hardware import KNOWN_FABRICS, GpuProfile
from ..mesh import ParallelDims
from ..models.llama import ATTENTION_BACKWARD_FLOPS, attention_flops, block_matmul_params
from .float8 import FLOAT8_MATMULS, matmul_peak_flops
from .moe import ffn_tp_collectives

_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_MATMUL = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.bmm.default, *FLOAT8_MATMULS}


class MeshLinks:
    """Where each mesh dim's process group runs: NVLink inside a node, InfiniBand across
    (the device profile's two ``hardware.Fabric``), and a collective's time over it.

    A dim's group spans ``dims.stride(dim) * size`` consecutive ranks (the mesh's
    layout is ``ParallelDims``'): inside a node if that fits in ``gpus_per_node``. The
    expert-parallel groups (``"ep"``) are ``ep`` consecutive ranks (``ParallelDims.stride``:
    innermost on the experts' mesh, so with TP they ride TP's links first; under expert
    tensor parallelism, ``etp > 1``, TP is the experts' own dim, so an ``ep`` group's
    members are ``tp`` ranks apart)."""

    def __init__(self, dev: GpuProfile, dims: ParallelDims, gpus_per_node: int,
                 etp: int = 1):
        self.dev, self.dims, self.gpn, self.etp = dev, dims, gpus_per_node, etp
        self.sizes = dims.sizes

    def size(self, dim: str) -> int:
        """Ranks in one group of ``dim`` (a mesh dim, or ``"ep"``). The data-parallel
        shard group is ``dp_shard x cp`` (with context parallelism, ``dp_shard`` flattened
        with the cp dims inside it)."""
        if dim == "ep":
            return self.dims.ep
        return self.dims.dp_shard_cp if dim == "dp_shard" else self.sizes[dim]

    def link(self, dim: str) -> str:
        """NVLink when the group's consecutive span of ranks fits a node (``dp_shard``'s
        span covers the cp and tp ranks inside it)."""
        if dim == "ep":  # ``ParallelDims.expert_mesh``: the TP ranks first unless etp
            span = self.etp * self.dims.ep
        else:
            span = self.dims.stride(dim) * self.sizes[dim]
        return "nvlink" if span <= self.gpn else "ib"

    def seconds(self, kind: str, dim: str, nbytes: float) -> float:
        """One collective over ``dim``'s group; ``nbytes`` is the full tensor (an
        ``all_to_all``: this rank's buffer, of which ``(n-1)/n`` leaves the rank, as a
        ring all-gather's does)."""
        return self._collective(kind, self.size(dim), self.link(dim), nbytes)

    def subgroup_seconds(self, kind: str, dim: str, ranks: int, nbytes: float,
                         apart: int = 1) -> float:
        """One collective over ``ranks`` members of ``dim``'s group that are ``apart``
        members apart (``reshard_after_forward = N``: the inner groups are N neighbours,
        the outer groups S / N members N apart); its link is NVLink when their span of
        ranks fits a node."""
        span = self.dims.stride(dim) * ranks * apart
        return self._collective(kind, ranks, "nvlink" if span <= self.gpn else "ib", nbytes)

    def _collective(self, kind: str, n: int, link: str, nbytes: float) -> float:
        if n <= 1:
            return 0.0
        fabric = KNOWN_FABRICS[self.dev.intra_node if link == "nvlink" else self.dev.inter_node]
        bw, alpha = fabric.bus_bandwidth_Bps, fabric.alpha_s  # busbw: achievable already
        ring = (n - 1) / n
        if kind == CollectiveKind.ALL_REDUCE:  # NCCL picks tree at scale: log latency growth
            steps = min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
            return alpha + steps * fabric.ring_step_s + 2 * ring * nbytes / bw
        return alpha + (n - 1) * fabric.ring_step_s + ring * nbytes / bw

    def p2p_seconds(self, dim: str, nbytes: float) -> float:
        """One message of ``nbytes`` to the next rank of ``dim``'s group (the ring pass's
        shift, ``plan.ring_pass``): the link's latency and bandwidth, no collective's
        steps; 0 on a group of one."""
        if self.size(dim) <= 1:
            return 0.0
        link = self.link(dim)
        fabric = KNOWN_FABRICS[self.dev.intra_node if link == "nvlink" else self.dev.inter_node]
        return fabric.alpha_s + nbytes / fabric.bus_bandwidth_Bps


def _call(node: fx.Node) -> tuple[object, tuple, dict]:
    """(op, args, kwargs) a node runs. Under full AC the compiled graphs wrap random ops,
    attention among them, in torch's RNG-state operators (``run_and_save_rng_state(op,
    *args)`` in forward, ``run_with_rng_state(state, op, *args)`` for the recompute):
    the op inside is what costs."""
    name = getattr(node.target, "__name__", str(node.target))
    if name == "run_and_save_rng_state":
        return node.args[0], node.args[1:], node.kwargs
    if name == "run_with_rng_state":
        return node.args[1], node.args[2:], node.kwargs
    return node.target, node.args, node.kwargs


def _arg(call: tuple[object, tuple, dict], name: str, default=None):
    """Argument ``name`` of an op call (``_call``), by its schema (positional, keyword,
    or the schema's default when the call left it out)."""
    target, args, kwargs = call
    schema = op_schema(target)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.name == name:
            if i < len(args):
                return args[i]
            return kwargs.get(name, a.default_value if a.has_default_value() else default)
    return default


def attention_kernel(name: str, qk_dim: int, v_dim: int) -> str:
    """Which SDPA kernel a GPU runs for an attention op: "attention" (flash),
    "efficient_attention" (the memory-efficient one) or "cudnn_attention" (cuDNN's, which
    our MLA calls by name: ``models.mla.mla_attention``). Flash needs one head size for
    queries, keys and values (torch's ``sdp_utils`` head-dim check), so SDPA with
    different sizes (MLA's 192 / 128) falls to the memory-efficient kernel
    (pytorch/torchtitan#1610), as does an op the graph already names so; the CPU trace's
    own op name says nothing about the GPU's."""
    if "cudnn" in name:
        return "cudnn_attention"
    return "efficient_attention" if "efficient" in name or qk_dim != v_dim else "attention"


def attention_op(node: fx.Node) -> str | None:
    """The name of the attention kernel ``node`` runs (forward or backward; inside full
    AC's RNG-state wrappers too), None for other nodes."""
    name = str(_call(node)[0]) if node.op == "call_function" else ""
    return name if any(a in name for a in _ATTENTION) else None


def _flops(node: fx.Node) -> tuple[str, float]:
    """(class, FLOPs) of one node: "matmul", "memory", or an attention kernel's class,
    named as its ``hardware.Efficiency`` field: the kernel (``attention_kernel``) with
    "_backward" for a backward op; flash's forward is "attention" (causal) or
    "attention_unmasked" (no mask).
    Attention: its queries against its keys (a ring's block of another rank's keys is a
    full rectangle, its own block causal)."""
    call = _call(node)
    name = str(call[0])
    if any(a in name for a in _ATTENTION):
        q = _arg(call, "query").meta["val"]
        b, h, s, d = (int(x) for x in q.shape)
        k, v = _arg(call, "key").meta["val"], _arg(call, "value").meta["val"]
        dv = int(v.shape[-1])
        causal = bool(_arg(call, "is_causal", True))
        backward = "backward" in name
        flops = attention_flops(b * h, s, int(k.shape[2]), d, causal=causal, value_dim=dv)
        kind = attention_kernel(name, d, dv)
        if backward:
            kind += "_backward"
        elif kind == "attention" and not causal:
            kind = "attention_unmasked"
        return kind, flops * (ATTENTION_BACKWARD_FLOPS if backward else 1.0)
    if node.target in _MATMUL:
        packet = node.target.overloadpacket
        args = [a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args]
        return "matmul", float(flop_registry[packet](*args, out_val=node.meta["val"]))
    return "memory", 0.0


def node_seconds(node: fx.Node, dev: GpuProfile, compiled: bool, scale: float = 1.0) -> float:
    """Roofline time of one compute node (``scale`` multiplies shard-sized bytes)."""
    op, args, _ = _call(node)
    wrapped = op is not node.target  # an RNG-state wrapper: its op runs a kernel
    if not wrapped and is_zero_cost(node, planner=True):
        return 0.0
    kind, flops = _flops(node)
    inputs = [a for a in args if isinstance(a, fx.Node)] if wrapped else node.all_input_nodes
    nbytes = value_bytes(node.meta.get("val")) * scale + sum(
        value_bytes(a.meta.get("val")) for a in inputs)
    dtype = next((a.meta["val"].dtype for a in inputs
                  if isinstance(a.meta.get("val"), torch.Tensor)), torch.float32)
    peak = matmul_peak_flops(dev.spec, dtype)
    eff = dev.efficiency
    if kind == "memory" and compiled:
        nbytes *= eff.fused_memory
    flop_eff = 1.0 if kind == "memory" else getattr(eff, kind)
    return roofline_seconds(flops, nbytes, peak, dev.spec.mem_bandwidth_Bps,
                            flop_efficiency=flop_eff, mem_efficiency=eff.memory,
                            overlap=True, floor_s=eff.floor_s(compiled))


def graph_seconds(gm: fx.GraphModule, dev: GpuProfile, fabric: MeshLinks,
                  groups: dict[str, str], compiled: bool, shard_scale: float, shard: set,
                  ffn_tp: bool = True) -> tuple[float, float]:
    """(seconds, exposed communication seconds) of one graph: the step simulator
    (``compiler.simulate.simulate_graph``) with this device's roofline per op and the
    layout's links per collective (one stream per mesh dim's group). ``ffn_tp`` False:
    the feed-forward's tensor-parallel collectives take no time (a mixture of experts'
    stand-in FFN without a shared expert, ``moe.ffn_tp_collectives``)."""
    def collective(node: fx.Node) -> tuple[str, float]:
        kind = KINDS[node.target]
        dim = groups.get(node.args[-1], "dp_shard")
        if not ffn_tp and dim == "tp" and ".feed_forward" in f".{module_fqn(node)}":
            return dim, 0.0
        nbytes = value_bytes(full_value(node)) * (
            shard_scale if kind == CollectiveKind.ALL_REDUCE and node in shard else 1.0)
        return dim, fabric.seconds(kind, dim, nbytes)

    exchanged = [0.0]

    def op(node: fx.Node) -> float:
        # an all-to-all (Ulysses' heads for sequence): its data feeds the next op, so it
        # runs on the compute stream's time, exposed whole; the ring pass's shifts (on the
        # cp_ring group) hide behind attention, costed by ``plan.ring_pass``
        if node.target == ALL_TO_ALL:
            dim = groups[node.args[-1]]
            if dim == "cp_ring":
                return 0.0
            seconds = fabric.seconds("all_to_all", dim, value_bytes(node.meta.get("val")))
            exchanged[0] += seconds
            return seconds
        return node_seconds(node, dev, compiled, shard_scale if node in shard else 1.0)

    seconds, exposed = simulate_graph(gm.graph, op, collective)
    return seconds, exposed + exchanged[0]


def loss_seconds(tokens: int, vocab: int, dev: GpuProfile) -> float:
    """The eager cross-entropy on (tokens, vocab) logits: about 28 bytes per logit move
    through HBM (cast, log_softmax, its backward, the cast back)."""
    eff = dev.efficiency
    return roofline_seconds(0, 28 * tokens * vocab, 1.0, dev.spec.mem_bandwidth_Bps,
                            mem_efficiency=eff.memory, floor_s=10 * eff.floor_s(False))


def optimizer_seconds(params_per_rank: float, dev: GpuProfile) -> float:
    """AdamW + gradient clipping on the float32 shards: memory-bound, its traffic
    (``cost.state.optimizer_traffic_bytes_per_param``) at the memory efficiency."""
    return roofline_seconds(0, optimizer_traffic_bytes_per_param("adamw") * params_per_rank,
                            1.0, dev.spec.mem_bandwidth_Bps,
                            mem_efficiency=dev.efficiency.memory)


def pp_step_seconds(stage_seconds: float, pp: int, microbatches: int) -> float:
    """1F1B / GPipe: ``microbatches + pp - 1`` slots of the slowest stage's fwd+bwd."""
    return (microbatches + pp - 1) * stage_seconds


def compute_floor_seconds(args, tokens: int, seq: int, tp: int, blocks: int,
                          recompute: bool, dev: GpuProfile) -> float:
    """A lower bound on the simulated forward + backward of ``blocks`` blocks for
    ``tokens`` tokens on one tensor-parallel rank: only the FLOP term of their matmuls
    and attention (``node_seconds`` takes the max of that and the memory term, and
    ``simulate`` adds memory-bound ops, kernel floors and exposed communication), at the
    bf16 peak. ``recompute``: full activation checkpointing runs each block's forward
    again in backward. Lets the search skip layouts that cannot win without tracing."""
    params = block_matmul_params(args, activated=True)
    passes = 4 if recompute else 3  # forward 1, backward 2 (grad input, grad weight)
    matmul = 2 * passes * params / tp * tokens
    qk, v = args.attention_dims
    forward = attention_flops(args.n_heads / tp, tokens, seq, qk, causal=True, value_dim=v)
    peak, eff = dev.spec.bf16_flops, dev.efficiency
    if attention_kernel("", qk, v) == "attention":  # a ring's blocks may run unmasked
        fwd_eff = max(eff.attention, eff.attention_unmasked)
        bwd_eff = eff.attention_backward
    else:  # the kernel our MLA runs (models.mla.mla_attention)
        fwd_eff, bwd_eff = eff.cudnn_attention, eff.cudnn_attention_backward
    attention = forward * (1 + recompute) / fwd_eff + forward * ATTENTION_BACKWARD_FLOPS / bwd_eff
    return blocks * (matmul / (peak * eff.matmul) + attention / peak)


def head_floor_seconds(args, tokens: int, tp: int, dev: GpuProfile) -> float:
    """A lower bound on the simulated output projection of ``tokens`` tokens on one
    tensor-parallel rank (split by vocabulary columns): its forward and two backward
    matmuls' FLOPs at the bf16 roofline (left out, the search's speed bound would let
    layouts that cannot win be traced)."""
    return 3 * 2 * tokens * args.dim * args.vocab_size / tp / (
        dev.spec.bf16_flops * dev.efficiency.matmul)


def tp_comm_floor_seconds(args, tokens: int, blocks: int, head: bool, elem: int,
                          fabric: MeshLinks) -> float:
    """A lower bound on the exposed tensor-parallel communication of ``blocks`` blocks
    (and the output projection's logits when ``head``, gathered without loss parallel):
    each block's forward all-gathers the normed input before attention and before the
    MLP and reduce-scatters both outputs (sequence parallelism), its backward does the
    converse, and the output all-gathers the logits. Each feeds the very next matmul, so
    the simulation exposes it whole (the backward has two more per block, not counted
    here). A mixture of experts without a shared expert has none around its FFN
    (``moe.ffn_tp_collectives``)."""
    if fabric.sizes["tp"] <= 1:
        return 0.0
    act = tokens * args.dim * elem
    per_block = (4 if ffn_tp_collectives(args) else 2) * (fabric.seconds("all_gather", "tp", act)
                     + fabric.seconds("reduce_scatter", "tp", act))
    logits = fabric.seconds("all_gather", "tp", tokens * args.vocab_size * elem)
    return blocks * per_block + (logits if head else 0.0)


def dp_comm_floor_seconds(args, blocks: list[int], role: str, tp: int, param_elem: int,
                          reduce_elem: int, regather: bool, fabric: MeshLinks) -> float:
    """A lower bound on one micro-step's data-parallel communication stream (the
    ``dp_shard`` group's, ``fully_shard`` / ``hybrid_shard``) of a dense stage role:
    forward all-gathers every matrix of its blocks and its embedding / output
    projection, backward gathers the blocks' matrices and the output projection again
    when ``regather`` (resharded after forward; the embedding's backward needs no
    weight) and reduce-scatters every gradient. Each term counts only the matrices,
    split ``tp`` ways (the embedding and output projection too, whatever TP does to
    them), and one collective's cost per kind (a sum of buckets costs at least that).
    The simulation waits for every collective it issues, and one group's collectives
    run one after another on its stream, so a graph takes at least this long.
    """
    matrices = sum(block_matmul_params(args, i) for i in blocks) / tp
    table = args.vocab_size * args.dim / tp  # the embedding's or the output's matrix
    embedding = table if role in ("full", "first") else 0.0
    output = table if role in ("full", "last") else 0.0
    # tied: one parameter, gathered and reduced once, needed again by the output's backward
    distinct = matrices + embedding + output - (table if args.tie_embeddings
                                                and role == "full" else 0.0)
    gathered = (distinct + (matrices + output if regather else 0.0)) * param_elem
    reduced = distinct * reduce_elem
    return fabric.seconds(CollectiveKind.ALL_GATHER, "dp_shard", gathered) \
        + fabric.seconds(CollectiveKind.REDUCE_SCATTER, "dp_shard", reduced)
