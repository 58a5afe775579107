"""Tensor + sequence parallel (and loss parallel) for a Llama ``Transformer``, on a
one-dimensional ``tp`` mesh; usable without the trainer (a model, a mesh, plain options).

Megatron-style: column-wise ``wq/wk/wv/w1/w3`` (heads and FFN width split), row-wise
``wo/w2``; the residual stream and the norms are sharded on the sequence dim (sequence
parallel), so each block all-gathers its normed input over the sequence before attention
/ FFN and reduce-scatters their outputs back onto it (instead of all-reducing them). The
embedding is split by vocabulary rows and its output reduce-scattered onto the sequence;
the output projection is split by vocabulary columns. With loss parallel
(``loss_parallel=True``) its logits stay split over the vocabulary (a DTensor,
``Shard(-1)``) and the loss runs over the pieces (:func:`loss_context`); without, they
are gathered (whole on every TP rank, for the loss). A routed FFN (MoE) takes
``parallel/expert.py``'s plan (``moe_tp_plan``: shared expert split, router and routed
experts whole, each TP rank routing its own part of the sequence).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..config.shapes import check_tp
from ..errors import ConfigError
from ..mesh import local_shard
from ..models.llama import Transformer
from .expert import is_moe, moe_tp_plan

# Targets equal to this are left out of the loss (``F.cross_entropy``'s ignore_index).
IGNORE_INDEX = -100


def check_sequence_parallel(args, tp: int, seq_len: int | None = None) -> None:
    """Raise a ConfigError if the TP + sequence-parallel plan cannot split this model."""
    check_tp(args, tp)
    if tp == 1:
        return
    if args.tie_embeddings:
        raise ConfigError("model.tie_embeddings = true cannot be combined with parallel.tp > 1: "
                          "the embedding is split by rows and the output projection by "
                          "columns of the same weight; untie them")
    if args.vocab_size % tp:
        raise ConfigError(f"parallel.tp = {tp} does not divide model.vocab_size = "
                          f"{args.vocab_size} (the embedding and output are split over TP)")
    if seq_len is not None and seq_len % tp:
        raise ConfigError(f"parallel.tp = {tp} does not divide training.seq_len = {seq_len} "
                          f"(sequence parallel shards the sequence over TP)")


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, seq_len: int | None = None,
             loss_parallel: bool = False) -> None:
    """Tensor + sequence parallel over ``tp_mesh``, in place (see the module docstring).

    The attention core takes ``n_rep`` from the heads it is given and views with
    ``-1`` heads, so with ``n_heads`` and ``n_kv_heads`` both divisible by the TP size
    each rank runs the same attention on its own heads, unchanged. A pipeline stage
    passes sequence-sharded hidden states to the next (each TP rank its own piece).
    ``loss_parallel``: the output projection returns its vocabulary-sharded logits as a
    DTensor (``Shard(-1)``) instead of gathering them.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_sequence_parallel(model.args, tp_mesh.size(), seq_len)
    root = {}
    if model.tok_embeddings is not None:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1))
    if model.norm is not None:
        root["norm"] = SequenceParallel()
    if model.output is not None:
        root["output"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel)
    if root:
        parallelize_module(model, tp_mesh, root)
    # attention(x, rope, mask): only x is sequence-sharded
    gather_sequence = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                         desired_input_layouts=(Replicate(), None, None))
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": gather_sequence,
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    dense_ffn = {
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.layers.values():  # a routed FFN: parallel/expert.py's plan
        ffn = moe_tp_plan(block.feed_forward) if is_moe(block.feed_forward) else dense_ffn
        parallelize_module(block, tp_mesh, {**block_plan, **ffn})


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the next-token cross-entropies, in float32. Vocabulary-sharded
    logits (a DTensor, under ``loss_context(True)``): computed over the shards, the sum
    returned as a plain tensor, the same on every tensor-parallel rank."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                           reduction="sum", ignore_index=IGNORE_INDEX)
    return local_shard(loss)


def loss_context(vocab_sharded: bool):
    """Where the loss and its backward run: with vocabulary-sharded logits
    (``parallel.vocab_sharded_loss``), torch's ``loss_parallel``, whose cross-entropy
    reduces the log-sum-exp and the target logits over the tensor-parallel ranks (a few
    floats per token) instead of gathering the logits; else nothing."""
    if not vocab_sharded:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
