"""Step time of one rank from its captured graphs: a roofline per op and a two-stream
(compute, communication) simulation of the scheduled graph.

Per op: ``max(FLOPs / (peak * efficiency), bytes / (HBM bandwidth * MEM_EFF))`` plus a
per-kernel floor. The efficiencies are a handful of global constants (below), the same
for every configuration and device; nothing is tuned per case.

Per collective: ``alpha + beta * bytes`` for its process group, from the device's
fabric and the layout (``comm_seconds``). The simulation issues a collective on its
group's stream when the compute stream reaches it, and a ``wait`` stalls compute until
it finishes: prefetched (reordered) collectives hide, eager ones (waited on at once)
are exposed.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from .._torch_compat import OpOverload
from ..compiler.collectives import KINDS, WAIT
from ..hardware import KNOWN_FABRICS, GpuProfile
from .memory import _tensor_bytes

# Fractions of the datasheet peak that real kernels reach (H100 figures from cuBLAS,
# FlashAttention-2 and memory-bound kernel benchmarks); global, not per case.
MATMUL_EFF = 0.60  # large bf16 GEMMs
ATTENTION_EFF = 0.40  # flash attention, forward and backward, causal half counted
MEM_EFF = 0.70  # memory-bound kernels: fraction of HBM bandwidth
KERNEL_FLOOR_S = {False: 6e-6, True: 3e-6}  # per kernel: eager launch / compiled
FUSED_MEMORY = 0.4  # compiled: memory-bound traffic left after Inductor's fusion
RING_STEP_S = {"nvlink": 1e-6, "ib": 4e-6}  # per ring step latency

_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention")
_MATMUL = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.bmm.default}


class Fabric:
    """Where each mesh dim's process group runs: NVLink inside a node, InfiniBand across.

    The mesh is ``(pp, dp_replicate, dp_shard, tp)`` over consecutive ranks, so a dim's
    group strides by the product of the sizes to its right."""

    def __init__(self, dev: GpuProfile, sizes: dict[str, int], gpus_per_node: int):
        self.dev, self.sizes, self.gpn = dev, sizes, gpus_per_node

    def link(self, dim: str) -> str:
        stride = 1
        for d in ("tp", "dp_shard", "dp_replicate", "pp"):
            if d == dim:
                break
            stride *= self.sizes[d]
        return "nvlink" if stride * self.sizes[dim] <= self.gpn else "ib"

    def seconds(self, kind: str, dim: str, nbytes: float) -> float:
        """One collective over mesh dim ``dim``; ``nbytes`` is the full tensor."""
        n = self.sizes[dim]
        if n <= 1:
            return 0.0
        link = self.link(dim)
        fabric = KNOWN_FABRICS[self.dev.intra_node if link == "nvlink" else self.dev.inter_node]
        bw, alpha = fabric.bus_bandwidth_Bps, fabric.alpha_s  # busbw: achievable already
        ring = (n - 1) / n
        if kind == "all_reduce":  # NCCL picks tree at scale: log latency growth
            steps = min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
            return alpha + steps * RING_STEP_S[link] + 2 * ring * nbytes / bw
        return alpha + (n - 1) * RING_STEP_S[link] + ring * nbytes / bw


def _flops(node: fx.Node) -> tuple[str, float]:
    """(class, FLOPs) of one node: "matmul", "attention" or "memory"."""
    name = str(node.target)
    if any(a in name for a in _ATTENTION):
        q = node.args[0].meta["val"]
        b, h, s, d = (int(x) for x in q.shape)
        k = node.args[1].meta["val"]
        flops = 4 * b * h * s * int(k.shape[2]) * d / 2  # causal: half the scores
        return "attention", flops * (2.5 if "backward" in name else 1.0)
    if node.target in _MATMUL:
        packet = node.target.overloadpacket
        args = [a.meta["val"] if isinstance(a, fx.Node) else a for a in node.args]
        return "matmul", float(flop_registry[packet](*args, out_val=node.meta["val"]))
    return "memory", 0.0


def _zero_cost(node: fx.Node) -> bool:
    if node.op != "call_function":
        return True
    t = node.target
    return (t is operator.getitem or getattr(t, "is_view", False)
            or not isinstance(t, OpOverload)
            or t.name().startswith(("_c10d_functional", "c10d")))


def node_seconds(node: fx.Node, dev: GpuProfile, compiled: bool, scale: float = 1.0) -> float:
    """Roofline time of one compute node (``scale`` multiplies shard-sized bytes)."""
    if _zero_cost(node):
        return 0.0
    kind, flops = _flops(node)
    nbytes = _tensor_bytes(node.meta.get("val")) * scale + sum(
        _tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    dtype = next((a.meta["val"].dtype for a in node.all_input_nodes
                  if isinstance(a.meta.get("val"), torch.Tensor)), torch.float32)
    peak = dev.spec.bf16_flops if dtype in (torch.bfloat16, torch.float16) \
        else dev.spec.fp32_flops
    if kind == "memory" and compiled:
        nbytes *= FUSED_MEMORY
    eff = {"matmul": MATMUL_EFF, "attention": ATTENTION_EFF, "memory": 1.0}[kind]
    return max(flops / (peak * eff), nbytes / (dev.spec.mem_bandwidth_Bps * MEM_EFF)) \
        + KERNEL_FLOOR_S[compiled]


def simulate(gm: fx.GraphModule, dev: GpuProfile, fabric: Fabric, groups: dict[str, str],
             compiled: bool, shard_scale: float, shard: set) -> tuple[float, float]:
    """(seconds, exposed communication seconds) of one graph on a compute stream and
    one communication stream per process group."""
    now, exposed = 0.0, 0.0
    stream_free: dict[str, float] = {}
    done: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in KINDS:
            kind = KINDS[node.target]
            dim = groups.get(node.args[-1], "dp_shard")
            full = node.meta["val"] if kind == "all_gather" else node.args[0].meta["val"]
            nbytes = _tensor_bytes(full) * (shard_scale if kind == "all_reduce"
                                            and node in shard else 1.0)
            start = max(now, stream_free.get(dim, 0.0))
            stream_free[dim] = done[node] = start + fabric.seconds(kind, dim, nbytes)
        elif node.target == WAIT and node.args[0] in done:
            finish = done[node.args[0]]
            if finish > now:
                exposed += finish - now
                now = finish
        else:
            now += node_seconds(node, dev, compiled, shard_scale if node in shard else 1.0)
    return now, exposed


def loss_seconds(tokens: int, vocab: int, dev: GpuProfile) -> float:
    """The eager cross-entropy on (tokens, vocab) logits: about 28 bytes per logit move
    through HBM (cast, log_softmax, its backward, the cast back)."""
    return 28 * tokens * vocab / (dev.spec.mem_bandwidth_Bps * MEM_EFF) + 10 * KERNEL_FLOOR_S[False]


def optimizer_seconds(params_per_rank: float, dev: GpuProfile) -> float:
    """AdamW + gradient clipping on the float32 shards: ~36 bytes per parameter
    (read param, grad, 2 moments; write 3; the norm and the clip scale reread grads)."""
    return 36 * params_per_rank / (dev.spec.mem_bandwidth_Bps * MEM_EFF)


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
    from ..models.llama import ffn_hidden_dim

    hd = args.head_dim
    params = args.dim * hd * (2 * args.n_heads + 2 * args.kv_heads) \
        + 3 * args.dim * ffn_hidden_dim(args)
    passes = 4 if recompute else 3  # forward 1, backward 2 (grad input, grad weight)
    matmul = 2 * passes * params / tp * tokens
    # per query token: 4 * heads * seq * head_dim / 2 (causal), backward 2.5x forward
    attention = 2 * (args.n_heads / tp) * seq * hd * tokens * (1 + 2.5 + recompute)
    peak = dev.spec.bf16_flops
    return blocks * (matmul / (peak * MATMUL_EFF) + attention / (peak * ATTENTION_EFF))


def head_floor_seconds(args, tokens: int, tp: int, dev: GpuProfile) -> float:
    """A lower bound on the simulated output projection of ``tokens`` tokens on one
    tensor-parallel rank (split by vocabulary columns): its forward and two backward
    matmuls' FLOPs at the bf16 roofline. At 8B it is ~4% of the step, and leaving it
    out of the search's speed bound let layouts that cannot win be traced."""
    return 3 * 2 * tokens * args.dim * args.vocab_size / tp / (dev.spec.bf16_flops * MATMUL_EFF)


def tp_comm_floor_seconds(args, tokens: int, blocks: int, head: bool, elem: int,
                          fabric: Fabric) -> float:
    """A lower bound on the exposed tensor-parallel communication of ``blocks`` blocks
    (and the output projection when ``head``): each block's forward all-gathers the
    normed input before attention and before the MLP and reduce-scatters both outputs
    (sequence parallelism), its backward does the converse, and the output all-gathers
    the logits. Each feeds the very next matmul, so the simulation exposes it whole
    (measured on the 8B traces at tp 2-8: forward exposure >= these sums; the backward
    has two more per block, not counted here)."""
    if fabric.sizes["tp"] <= 1:
        return 0.0
    act = tokens * args.dim * elem
    per_block = 4 * (fabric.seconds("all_gather", "tp", act)
                     + fabric.seconds("reduce_scatter", "tp", act))
    logits = fabric.seconds("all_gather", "tp", tokens * args.vocab_size * elem)
    return blocks * per_block + (logits if head else 0.0)
