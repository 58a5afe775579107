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

Each routed block's dispatch (``parallel.expert_dispatch``, ``Dispatch``): ``exact``
moves every routed slot and first exchanges the per-expert counts (a few bytes, read on
the host); ``padded`` moves ``E x capacity`` rows each way (``models.moe.expert_capacity``)
and its experts compute all of them (``padded_seconds``: the matmul rows beyond the
stand-in's slots), its own copies to and from the padded layout (``PADDED_PASSES``), and
keeps no exchange for a recomputation (only the exact dispatch's are kept). Eager steps
also pay the host's time per routed block (``host_seconds``): the dispatch reads split
sizes on the host every block, so the device waits for the host's launches there.

Expert tensor parallelism (``parallel.etp = tp``, ``parallel/expert_tensor.py``) adds
the TP group's two exchanges per run of a routed block's experts and their converse in
backward (``etp_exchange_seconds``), and the rows they keep (``saved_bytes``); its
states and gathers are ``memory.rank_expert_params`` and ``memory.expert_gather_bytes``,
its EP groups' links ``timing.MeshLinks``' (ranks ``tp`` apart). The gathers' time stays
the stand-in's (the same for either ``etp``). ETP's own copies (the rows repeated for
the TP peers, regrouped, the partial outputs summed) are ``ETP_PASSES`` in
``permute_seconds``.

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
from ..models.moe import expert_capacity

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


COUNT_BYTES = 8  # one int64 count per expert: the exact dispatch's first exchange


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """How the routed blocks send their slots (``parallel.expert_dispatch`` and
    ``parallel.expert_capacity_factor``)."""

    padded: bool = False
    capacity_factor: float = 1.25

    @classmethod
    def of(cls, parallel) -> Dispatch:
        return cls(parallel.expert_dispatch == "padded", parallel.expert_capacity_factor)

    def rows(self, args: ModelArgs, tokens: int) -> int:
        """Rows one rank sends each way per routed block for its ``tokens``: its slots
        (``tokens x top_k``), or padded every expert's capacity (``E x C``)."""
        slots = tokens * getattr(args, "top_k", 0)
        if not self.padded or not slots:
            return slots
        return args.num_experts * expert_capacity(slots, args.num_experts, self.capacity_factor)


EXACT = Dispatch()


def exchanges(ac: str, dispatch: Dispatch = EXACT) -> int:
    """Token all-to-alls of one routed block per step: dispatch and combine in each forward
    run and in backward. The exact dispatch's are kept for a recomputation under
    selective AC (``EXCHANGE_FORWARDS``); the padded one's are not (``FORWARDS``)."""
    forwards = FORWARDS[ac] if dispatch.padded else EXCHANGE_FORWARDS[ac]
    return 2 * (forwards + 1)


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


def dispatch_bytes(args: ModelArgs, tokens: int, elem: int,
                   dispatch: Dispatch = EXACT) -> int:
    """Bytes of one routed block's dispatched activations on one rank: each of its
    ``tokens`` goes to ``top_k`` experts (padded: ``Dispatch.rows``)."""
    return dispatch.rows(args, tokens) * args.dim * elem


def exchange_seconds(args: ModelArgs, layers: list[int], tokens: int, elem: int, ac: str,
                     fabric, dispatch: Dispatch = EXACT) -> float:
    """Exposed all-to-all seconds of the stage's routed blocks per microbatch, on the EP
    group of ``fabric`` (``timing.MeshLinks``), ``tokens`` the rank's routed ones
    (``routed_tokens``); 0 without expert parallelism. The exact dispatch first exchanges
    the counts in each forward run (a recomputation too: only the tokens are kept)."""
    if fabric.size("ep") <= 1:
        return 0.0
    one = fabric.seconds("all_to_all", "ep", dispatch_bytes(args, tokens, elem, dispatch))
    counts = 0.0 if dispatch.padded else FORWARDS[ac] * fabric.seconds(
        "all_to_all", "ep", args.num_experts * COUNT_BYTES)
    return routed_blocks(args, layers) * (exchanges(ac, dispatch) * one + counts)


# Memory passes over one routed block's dispatched activations (``dispatch_bytes``, D) that
# the stand-in lacks, counted from the code: a copy reads and writes D (2), an index's
# backward also writes its zeros (3), a reduction or an index_add reads D (1).
# In the graph (``models.moe.routed_combine``): forward the gather x[token] (2), the weight
# multiply (2), the index_add (1); backward the index_add's gather (2), the multiply's two
# gradients (the routed rows' a copy, 2; the weights' a product read twice and reduced, 2)
# and the gather's index_add (1).
GRAPH_PASSES = {"forward": 5, "backward": 7}
# The exact dispatch's regrouping (``parallel.expert._dispatch``, expert parallelism
# only): forward by local expert and back (2 + 2), backward their index backwards (3 + 3).
EXACT_PASSES = {"forward": 4, "backward": 6}
# The padded dispatch (``models.moe.padded_experts``), as (passes over the padded rows P,
# passes over the slots D). Forward: zeros P (1), the out-of-place index_add that fills
# them (a copy 2 P, the slots read 1 D), the cat of a zero row (2 P), the gather back
# (2 D). Backward: the gather's index_add into zeros (1 P + 1 D), the slice's padding
# (zeros and a copy: 3 P), the index_add's gather of the slots (2 D).
PADDED_PASSES = {"forward": (5, 3), "backward": (4, 3)}
# With expert parallelism and more than one local expert, two regroupings of the P rows
# (source-major to expert-major and back: a copy each, 2 P) in forward and in backward.
PADDED_REGROUP_PASSES = {"forward": 4, "backward": 4}
# Expert tensor parallelism's copies (``expert_tensor.width_split_ffn``), as (passes over
# the TP group's rows T = etp x D, passes over the rank's slots D). Forward: the rows
# repeated for the peers (reads D, writes T), the regrouping by expert and back (2 T
# each), the partial outputs summed (reads T, writes D). Backward: the sum's gradient
# made contiguous for the exchange (D + T), the two regroupings' index backwards (3 T
# each), the repeat's gradient summed (T + D).
ETP_PASSES = {"forward": (6, 2), "backward": (8, 2)}


def permute_seconds(args: ModelArgs, layers: list[int], tokens: int, elem: int, ac: str,
                    dev, compiled: bool, ep: int, dispatch: Dispatch = EXACT,
                    etp: int = 1) -> float:
    """Seconds of the stage's routed blocks' token permutations per microbatch: the passes
    above over D (and P, or ETP's T), the forward's counted again when AC recomputes it
    (``FORWARDS``), at the bandwidth these gathers and scatters reach
    (``hardware.Efficiency``'s ``permute_memory``, measured; compiled or not: Inductor
    keeps them as index kernels)."""
    forwards = FORWARDS[ac]
    eff = dev.efficiency
    d = dispatch_bytes(args, tokens, elem)
    nbytes = (forwards * GRAPH_PASSES["forward"] + GRAPH_PASSES["backward"]) * d
    if dispatch.padded:
        p = dispatch_bytes(args, tokens, elem, dispatch)
        (pf, df), (pb, db) = PADDED_PASSES["forward"], PADDED_PASSES["backward"]
        nbytes += forwards * (pf * p + df * d) + pb * p + db * d
        if ep > 1 and args.num_experts // ep > 1:
            nbytes += (forwards * PADDED_REGROUP_PASSES["forward"]
                       + PADDED_REGROUP_PASSES["backward"]) * p
    elif ep > 1:
        nbytes += (forwards * EXACT_PASSES["forward"] + EXACT_PASSES["backward"]) * d
    if etp > 1:
        (tf, df), (tb, db) = ETP_PASSES["forward"], ETP_PASSES["backward"]
        nbytes += forwards * (tf * etp * d + df * d) + tb * etp * d + db * d
    nbytes *= routed_blocks(args, layers)
    rate = eff.permute_memory_compiled if compiled else eff.permute_memory
    return roofline_seconds(0.0, nbytes, dev.spec.bf16_flops, dev.spec.mem_bandwidth_Bps,
                            mem_efficiency=rate)


def host_seconds(args: ModelArgs, layers: list[int], ac: str, ep: int, dev) -> float:
    """Host seconds of the stage's routed blocks per microbatch in an eager step: each
    pass (every forward run, ``FORWARDS``, and the backward) costs the profile's
    ``moe_block_host_s``, plus ``moe_exchange_host_s`` with expert parallelism; under
    selective AC each forward run also goes through the checkpoint's dispatch mode
    (``moe_selective_host_s``). The step waits for the longer of this and the device."""
    forwards = FORWARDS[ac]
    per_pass = dev.moe_block_host_s + (dev.moe_exchange_host_s if ep > 1 else 0.0)
    selective = forwards * dev.moe_selective_host_s if ac == "selective" else 0.0
    return routed_blocks(args, layers) * ((forwards + 1) * per_pass + selective)


def padded_seconds(args: ModelArgs, layers: list[int], tokens: int, ac: str, dev,
                   dispatch: Dispatch) -> float:
    """Seconds the padded dispatch's experts compute beyond the stand-in's (which computes
    the rank's slots): ``P - D`` more rows (fewer with a capacity factor under 1) through
    each routed expert's three matrices (2 FLOPs a weight), in each forward run and twice
    in backward, at the matmul rate; 0 for the exact dispatch."""
    if not dispatch.padded:
        return 0.0
    slots = tokens * args.top_k
    extra = dispatch.rows(args, tokens) - slots
    flops = extra * 2 * 3 * args.dim * args.moe_hidden_dim * (FORWARDS[ac] + 2)
    return routed_blocks(args, layers) * flops / (dev.spec.bf16_flops * dev.efficiency.matmul)


def etp_exchange_seconds(args: ModelArgs, layers: list[int], tokens: int, elem: int,
                         ac: str, fabric, etp: int) -> float:
    """Exposed seconds of the stage's routed blocks' expert-tensor-parallel exchanges per
    microbatch on the TP group of ``fabric`` (``expert_tensor.width_split_ffn``; 0 for
    ``etp = 1``), ``tokens`` the rank's routed ones (``routed_tokens``). Each run of a
    block's experts sends the rank's ``tokens x top_k`` rows (its slots: after the EP
    exchange a rank receives as many as it sends, on balance) to every TP peer (an
    all-to-all of ``etp`` copies: ``etp x D`` bytes, ``(etp - 1) / etp`` of them leave)
    and the partial outputs of the TP group's ``etp x D`` rows back (the same size), and
    backward the converse pair: ``exchanges`` of them (exact dispatch only; selective AC
    keeps their outputs, ``EXCHANGE_FORWARDS``). Each forward run first all-gathers the
    local experts' int64 counts over TP (``E / ep`` of them a rank). Exposed whole, as
    the EP exchange: the experts wait for their rows, and the split sizes are read on
    the host. The experts' FLOPs need no term: a rank computes ``etp`` times the rows at
    ``1 / etp`` of the width, as the traced stand-in's sequence-parallel FFN does."""
    if etp <= 1:
        return 0.0
    one = fabric.seconds("all_to_all", "tp", etp * dispatch_bytes(args, tokens, elem))
    local_experts = args.num_experts // fabric.size("ep")
    counts = fabric.seconds("all_gather", "tp", etp * local_experts * COUNT_BYTES)
    return routed_blocks(args, layers) * (exchanges(ac) * one + FORWARDS[ac] * counts)


def saved_bytes(args: ModelArgs, layers: list[int], tokens: int, elem: int, ac: str,
                ep: int, dispatch: Dispatch = EXACT, etp: int = 1) -> int:
    """Bytes the stage's routed blocks keep for backward beyond the stand-in's (``tokens``:
    the rank's routed ones, ``routed_tokens``), two copies of the dispatched activations
    each: without AC, the gathered tokens the experts multiply and the expert outputs the
    routing weights multiply (padded: the experts multiply the P padded rows); under
    selective with the exact dispatch's exchanges (expert parallelism), the two
    exchanges' outputs (``EXCHANGE_FORWARDS``: the tokens received and the expert outputs
    sent back); nothing under full AC, or selective otherwise (the padded exchanges are
    recomputed). Under expert tensor parallelism (``etp > 1``, exact dispatch) the
    experts multiply the TP group's ``etp x D`` gathered rows (without AC: ``etp x D +
    D``), and selective AC also keeps its two exchanges' outputs, ``etp x D`` each
    (``etp_exchange_seconds``)."""
    d = dispatch_bytes(args, tokens, elem)
    if FORWARDS[ac] == 1:
        experts_in = etp * d if etp > 1 else dispatch_bytes(args, tokens, elem, dispatch)
        return routed_blocks(args, layers) * (experts_in + d)
    if EXCHANGE_FORWARDS[ac] == 1 and not dispatch.padded:
        kept = (2 * d if ep > 1 else 0) + (2 * etp * d if etp > 1 else 0)
        return routed_blocks(args, layers) * kept
    return 0
