"""The mixture-of-experts terms of a prediction: what the traced graphs cannot hold.

Routing is data-dependent (how many tokens each expert gets decides the shapes), which
fake tensors cannot trace. So the planner traces a dense stand-in (``stand_in``): our
Llama with the same attention (Llama's or MLA) and one SwiGLU of the activated width
(``MoEArgs.activated_hidden_dim``: ``top_k`` experts and the shared one), whose matmul
FLOPs and FFN activations per token are the routed block's. What the stand-in lacks is
added per routed block of the stage:

* the token exchange of expert parallelism (``exchange_seconds``): dispatch and combine,
  one ``all_to_all`` each on the EP group in forward and in backward (and the forward's
  again under full AC, ``EXCHANGE_FORWARDS``), each moving this rank's ``tokens x top_k x
  dim`` activations, exposed whole (the experts wait for their tokens, and the split
  sizes are read on the host first). A rank routes its own tokens (``routed_tokens``:
  under TP its part of the sequence, ``parallel.expert.moe_tp_plan``);
* the token permutations (``permute_seconds``): the memory-bound passes over the
  dispatched activations that the dispatch and combine make (gather, regroup by expert,
  weight, sum back), counted from the code, at the bandwidth measured for them;
* the routed copies kept for backward (``saved_bytes``): ``2 x tokens x top_k x dim``,
  the gathered tokens the experts multiply and the expert outputs the routing weights
  multiply without AC, the two exchanges' outputs under selective AC (none under full).

Model states come from the real shapes (``memory.rank_params``: the experts split by
``ep`` and sharded over the experts' mesh), and the stand-in's FSDP collectives stand for
the experts' (with ``ep`` = ``dp_shard`` each rank gathers nothing for its experts, the
stand-in gathers its width: a few percent of the step on the published case, README).
Under TP the stand-in's FFN is a sequence-parallel SwiGLU (gathered and reduce-scattered
over TP), as the shared expert is; the routed experts are not (``moe_tp_plan``: each TP
rank routes its own tokens). Without a shared expert the block's FFN has no TP
collective: the stand-in's are given no time (``ffn_tp_collectives``).
"""

from __future__ import annotations

import dataclasses

from ..compiler.cost.compute import roofline_seconds
from ..models.llama import ModelArgs, ffn_hidden_dim
from ..models.mla import MLAArgs

# Times a step runs a routed block's routed experts (their permutations and grouped
# matmuls): AC runs them again in backward, selective too (its policy keeps no output of
# theirs: ``parallel.activation_checkpoint._saved_ops`` has neither ``_grouped_mm`` nor the gathers
# and index ops around them). The one owner of that rule for the permutations below.
FORWARDS = {"none": 1, "selective": 2, "full": 2}
# Times a step runs a routed block's token exchanges forward: selective keeps their
# outputs (``parallel.expert.keep_exchanges``, eager and compiled), so only full AC
# exchanges the tokens again. The one owner of that rule for the exchanges' time and the
# copies they keep (``saved_bytes``).
EXCHANGE_FORWARDS = {"none": 1, "selective": 1, "full": 2}


def exchanges(ac: str) -> int:
    """All-to-alls of one routed block per step: dispatch and combine in each forward run
    (``EXCHANGE_FORWARDS``) and in backward."""
    return 2 * (EXCHANGE_FORWARDS[ac] + 1)


def stand_in(args: ModelArgs) -> ModelArgs:
    """The dense model the planner traces for ``args``: ``args`` itself, or for a mixture
    of experts the same shape with every FFN a SwiGLU of the activated width (its Llama
    rounding set so that the width comes out exactly)."""
    width = getattr(args, "activated_hidden_dim", None)
    if width is None:
        return args
    # the attention's fields (MLAArgs: Llama's or MLA) kept, the routing's dropped
    base = {f.name: getattr(args, f.name) for f in dataclasses.fields(MLAArgs)}
    unrounded = ffn_hidden_dim(MLAArgs(**{**base, "multiple_of": 1,
                                          "ffn_dim_multiplier": None}))
    # one rounding step of ``width`` above an unrounded width of 1 (1.5 / unrounded keeps
    # it off the integer boundary)
    dense = MLAArgs(**{**base, "multiple_of": width,
                       "ffn_dim_multiplier": 1.5 / unrounded})
    if ffn_hidden_dim(dense) != width:
        raise AssertionError(f"stand-in FFN width {ffn_hidden_dim(dense)} != {width}")
    return dense


def ffn_tp_collectives(args: ModelArgs) -> bool:
    """Whether the traced FFN's tensor-parallel gather and reduce-scatter are the model's:
    a dense SwiGLU's, or a mixture of experts' shared expert's (the same ``tokens x dim``
    each way); a mixture of experts without a shared expert has none (the routed experts
    take each TP rank's own tokens, ``parallel.expert.moe_tp_plan``)."""
    return getattr(args, "activated_hidden_dim", None) is None or args.shared_hidden_dim > 0


def routed_blocks(args: ModelArgs, layers: list[int]) -> int:
    """How many of ``layers`` route their tokens to experts."""
    return sum(1 for i in layers if args.routed_params(i))


def routed_tokens(tokens: int, dims) -> int:
    """Tokens one rank routes to the experts, of the ``tokens`` it computes
    (``memory.rank_tokens``): under TP each rank routes its own ``1 / tp`` of the sequence
    (``parallel.expert.moe_tp_plan``: no gather before the router)."""
    return tokens // dims.tp


def dispatch_bytes(args: ModelArgs, tokens: int, elem: int) -> int:
    """Bytes of one routed block's dispatched activations on one rank: each of its
    ``tokens`` goes to ``top_k`` experts."""
    return tokens * getattr(args, "top_k", 0) * args.dim * elem


def exchange_seconds(args: ModelArgs, layers: list[int], tokens: int, elem: int, ac: str,
                     fabric) -> float:
    """Exposed all-to-all seconds of the stage's routed blocks per microbatch, on the EP
    group of ``fabric`` (``timing.MeshLinks``), ``tokens`` the rank's routed ones
    (``routed_tokens``); 0 without expert parallelism."""
    if fabric.size("ep") <= 1:
        return 0.0
    one = fabric.seconds("all_to_all", "ep", dispatch_bytes(args, tokens, elem))
    return routed_blocks(args, layers) * exchanges(ac) * one


# Memory passes over one routed block's dispatched activations (``dispatch_bytes``, D) that
# the stand-in lacks, counted from the code: a copy reads and writes D (2), an index's
# backward also writes its zeros (3), a reduction or an index_add reads D (1).
# In the graph (``models.moe.routed_combine``): forward the gather x[token] (2), the weight
# multiply (2), the index_add (1); backward the index_add's gather (2), the multiply's two
# gradients (the routed rows' a copy, 2; the weights' a product read twice and reduced, 2)
# and the gather's index_add (1).
GRAPH_PASSES = {"forward": 5, "backward": 7}
# Outside any graph (``parallel.expert._dispatch``, expert parallelism only): forward the
# regrouping by local expert and back (2 + 2), backward their index backwards (3 + 3).
EAGER_PASSES = {"forward": 4, "backward": 6}


def permute_seconds(args: ModelArgs, layers: list[int], tokens: int, elem: int, ac: str,
                    dev, compiled: bool, ep: int) -> float:
    """Seconds of the stage's routed blocks' token permutations per microbatch: the passes
    above over D, the forward's counted again when AC recomputes it (``FORWARDS``), at
    the bandwidth these gathers and scatters reach (``hardware.Efficiency``'s
    ``permute_memory``, measured; compiled or not: Inductor keeps them as index kernels)."""
    forwards = FORWARDS[ac]
    eff = dev.efficiency
    passes = forwards * GRAPH_PASSES["forward"] + GRAPH_PASSES["backward"]
    if ep > 1:
        passes += forwards * EAGER_PASSES["forward"] + EAGER_PASSES["backward"]
    nbytes = routed_blocks(args, layers) * passes * dispatch_bytes(args, tokens, elem)
    rate = eff.permute_memory_compiled if compiled else eff.permute_memory
    return roofline_seconds(0.0, nbytes, dev.spec.bf16_flops, dev.spec.mem_bandwidth_Bps,
                            mem_efficiency=rate)


def saved_bytes(args: ModelArgs, layers: list[int], tokens: int, elem: int, ac: str,
                ep: int) -> int:
    """Bytes the stage's routed blocks keep for backward beyond the stand-in's (``tokens``:
    the rank's routed ones, ``routed_tokens``), two copies of the dispatched activations
    each: without AC, the gathered tokens the experts multiply and the expert outputs the
    routing weights multiply; under selective with expert parallelism, the two exchanges'
    outputs (``EXCHANGE_FORWARDS``: the tokens received and the expert outputs sent
    back); nothing under full AC, or selective without exchanges."""
    if FORWARDS[ac] == 1 or (EXCHANGE_FORWARDS[ac] == 1 and ep > 1):
        return routed_blocks(args, layers) * 2 * dispatch_bytes(args, tokens, elem)
    return 0
