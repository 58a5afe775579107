"""Apply the parallelisms to a Llama ``Transformer``, in the order they compose.

1. Tensor parallel (``parallel.tp``): Megatron-style, per block, on ``mesh["tp"]``:
   column-wise ``wq/wk/wv/w1/w3`` (heads and FFN width split), row-wise ``wo/w2`` (the
   block's output is all-reduced). Embeddings, norms and the output projection stay
   replicated over TP: every TP rank computes them on the same data.
2. Activation checkpointing (``activation_checkpoint.mode``) per block: ``full``
   recomputes the whole block in backward; ``selective`` keeps the outputs of matmuls,
   attention and TP reductions and recomputes the cheap rest (norms, activations,
   RoPE, and the FSDP all-gathers, so resharding still holds).
3. ``simplefsdp.data_parallel`` over the data-parallel dims of the same mesh, with
   ``reduce_op="sum"``: the trainer's loss is already normalized by the global token
   count, so gradients are summed, not averaged.
4. ``torch.compile`` with the simplefsdp backend (``compile.enable``).

Pipeline parallelism (splitting into stages) happens before all of this; see
``pipeline.py``.
"""

from __future__ import annotations

import datetime
import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import simplefsdp
from simplefsdp._torch_compat import c10d_functional, checkpoint_wrapper
from simplefsdp.mesh import stage_group

from ..models.llama import Transformer
from .config import PG_TIMEOUT_S, ConfigError, JobConfig, check_tp

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------
# Tensor parallel.
# ---------------------------------------------------------------------------------------
def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Shard every block's attention heads and FFN width over ``tp_mesh``, in place.

    The attention module computes ``n_rep`` from the global head counts and views with
    ``-1`` heads, so with ``n_heads`` and ``n_kv_heads`` both divisible by the TP size
    each rank runs the same attention on its own heads, unchanged.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    check_tp(model.args, tp_mesh.size())
    plan = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plan)


# ---------------------------------------------------------------------------------------
# Activation checkpointing.
# ---------------------------------------------------------------------------------------
def _saved_ops() -> set:
    aten, c10d = torch.ops.aten, c10d_functional
    names = [(aten, "mm"), (aten, "addmm"), (aten, "bmm"),
             (aten, "_scaled_dot_product_flash_attention"),
             (aten, "_scaled_dot_product_flash_attention_for_cpu"),
             (aten, "_scaled_dot_product_efficient_attention"),
             (aten, "_scaled_dot_product_cudnn_attention"),
             # TP reductions (not the FSDP all-gathers: those must be recomputed).
             (c10d, "all_reduce"), (c10d, "reduce_scatter_tensor")]
    return {getattr(ns, name).default for ns, name in names if hasattr(ns, name)}


def _selective_policy(saved: frozenset, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    policy = functools.partial(_selective_policy, frozenset(_saved_ops()))
    return create_selective_checkpoint_contexts(policy)


def apply_ac(model: nn.Module, mode: str) -> None:
    """Wrap each block of ``model.layers`` for ``full`` or ``selective`` checkpointing.

    The wrapper's name (``_checkpoint_wrapped_module``) is stripped from state dict
    keys by the wrapper itself, so checkpoints do not depend on the mode.
    """
    if mode == "none":
        return
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpointed(block, mode)


def checkpointed(block: nn.Module, mode: str) -> nn.Module:
    """``block`` wrapped for ``full`` or ``selective`` activation checkpointing (the one
    place the wrapper is built: our Llama's blocks and Hugging Face decoder layers)."""
    if mode not in ("full", "selective"):
        raise ConfigError(f"activation_checkpoint.mode = {mode!r} is unknown")
    kwargs = {"context_fn": _selective_context} if mode == "selective" else {}
    return checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)


# ---------------------------------------------------------------------------------------
# Data parallel and compile.
# ---------------------------------------------------------------------------------------
def apply_dp(model: nn.Module, mesh: DeviceMesh, cfg: JobConfig) -> nn.Module:
    t, p = cfg.training, cfg.parallel
    mp = simplefsdp.MixedPrecisionPolicy(
        param_dtype=_DTYPES[t.mixed_precision_param],
        reduce_dtype=_DTYPES[t.mixed_precision_reduce])
    # Under PP each microbatch would gather the parameters again in backward; keeping
    # them until backward is the usual trade (as torchtitan does).
    reshard = p.reshard_after_forward and p.pp == 1
    return simplefsdp.data_parallel(model, mesh, mode=p.dp_mode, mp_policy=mp,
                                    reshard_after_forward=reshard, reduce_op="sum")


def apply_compile(model: nn.Module, mesh: DeviceMesh, cfg: JobConfig) -> nn.Module:
    c = cfg.compile
    # Auto wrapping agrees its measurements across the ranks compiling the same graph:
    # under PP, those of this stage.
    group = None
    if c.bucketing == "auto":
        group = stage_group(mesh, datetime.timedelta(seconds=PG_TIMEOUT_S))
    backend = simplefsdp.compile_backend(backend=c.backend, bucketing=c.bucketing,
                              reordering=c.reordering, module_plan=None,
                              memory_limit_gb=c.memory_limit_gb, group=group)
    return torch.compile(model, fullgraph=True, backend=backend)


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: JobConfig) -> nn.Module:
    """TP, activation checkpointing, data parallel, compile: in that order, in place
    (the returned module is the compiled wrapper when compile is on)."""
    if cfg.parallel.tp > 1:
        apply_tp(model, mesh["tp"])
    apply_ac(model, cfg.activation_checkpoint.mode)
    model = apply_dp(model, mesh, cfg)
    if cfg.compile.enable:
        model = apply_compile(model, mesh, cfg)
    return model
