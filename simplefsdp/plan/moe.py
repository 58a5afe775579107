"""The mixture-of-experts terms of a prediction: what the traced graphs cannot hold.

Routing is data-dependent (how many tokens each expert gets decides the shapes), which
fake tensors cannot trace. So the planner traces a dense stand-in (``stand_in``): our
Llama with the same attention (Llama's or MLA) and one SwiGLU of the activated width
(``MoEArgs.activated_hidden_dim``: ``top_k`` experts and the shared one), whose matmul
FLOPs and FFN activations per token are the routed block's. What the stand-in lacks is
added per routed block of the stage:

* the token exchange of expert parallelism (``exchange_seconds``): dispatch and combine,
  one ``all_to_all`` each on the EP group in forward and in backward (and the forward's
  again when full AC recomputes the block), each moving this rank's ``tokens x top_k x
  dim`` activations, exposed whole (the experts wait for their tokens, and the split
  sizes are read on the host first);
* the routed copies kept for backward (``saved_bytes``): the gathered tokens the experts
  multiply and the expert outputs the routing weights multiply, ``2 x tokens x top_k x
  dim`` (none when full AC recomputes the block).

Model states come from the real shapes (``memory.stage_params``: every expert), and the
stand-in's FSDP collectives stand for the experts' (with ``ep`` = ``dp_shard`` each rank
gathers nothing for its experts, the stand-in gathers its width: a few percent of the
step on the published case, README).
"""

from __future__ import annotations

import dataclasses

from ..models.llama import ModelArgs, ffn_hidden_dim
from ..models.mla import MLAArgs

# all-to-alls of one routed block per step: dispatch + combine, forward and backward
EXCHANGES = {"none": 4, "selective": 4, "full": 6}  # full AC: the forward's once more


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


def routed_blocks(args: ModelArgs, layers: list[int]) -> int:
    """How many of ``layers`` route their tokens to experts."""
    return sum(1 for i in layers if args.routed_params(i))


def dispatch_bytes(args: ModelArgs, tokens: int, elem: int) -> int:
    """Bytes of one routed block's dispatched activations on one rank: each of its
    ``tokens`` goes to ``top_k`` experts."""
    return tokens * getattr(args, "top_k", 0) * args.dim * elem


def exchange_seconds(args: ModelArgs, layers: list[int], tokens: int, elem: int, ac: str,
                     fabric) -> float:
    """Exposed all-to-all seconds of the stage's routed blocks per microbatch, on the EP
    group of ``fabric`` (``timing.MeshLinks``); 0 without expert parallelism."""
    if fabric.size("ep") <= 1:
        return 0.0
    one = fabric.seconds("all_to_all", "ep", dispatch_bytes(args, tokens, elem))
    return routed_blocks(args, layers) * EXCHANGES[ac] * one


def saved_bytes(args: ModelArgs, layers: list[int], tokens: int, elem: int, ac: str) -> int:
    """Bytes the stage's routed blocks keep for backward beyond the stand-in's."""
    if ac == "full":
        return 0
    return routed_blocks(args, layers) * 2 * dispatch_bytes(args, tokens, elem)
