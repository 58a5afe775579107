"""Apply the parallelisms to a Llama ``Transformer``, in the order they compose.

0. Context parallelism (``parallel.cp_ring``, ``parallel.cp_ulysses``;
   ``parallel/context.py``): each block's attention sees the whole sequence of which
   this rank holds a part; RoPE takes the part's global positions.
1. Tensor + sequence parallel (``parallel.tp``), Megatron-style, on ``mesh["tp"]``:
   column-wise ``wq/wk/wv/w1/w3`` (heads and FFN width split), row-wise ``wo/w2``; the
   residual stream and the norms are sharded on the sequence dim (sequence parallel),
   so each block all-gathers its normed input over the sequence before attention / FFN
   and reduce-scatters their outputs back onto it (instead of all-reducing them). The
   embedding is split by vocabulary rows and its output reduce-scattered onto the
   sequence; the output projection is split by vocabulary columns. With loss parallel
   (``parallel.loss_parallel``, the default) its logits stay split over the vocabulary
   (a DTensor, ``Shard(-1)``) and the loss runs over the pieces (``step.loss_context``);
   without, they are gathered (whole on every TP rank, for the loss). A routed FFN (MoE)
   takes ``parallel/expert.py``'s plan (:func:`moe_tp_plan`: shared expert split, router
   and routed experts whole, each TP rank routing its own part of the sequence).
2. Activation checkpointing (``activation_checkpoint.mode``) per block: ``full``
   recomputes the whole block in backward; ``selective`` is torchtitan's per-op policy:
   it keeps the outputs of attention, TP reduce-scatters and every other matmul, and
   recomputes the rest (the other matmuls, norms, activations, RoPE, and the FSDP
   all-gathers, so resharding still holds).
3. ``simplefsdp.data_parallel`` over the data-parallel dims of the same mesh, with
   ``reduce_op="sum"``: the trainer's loss is already normalized by the global token
   count, so gradients are summed, not averaged.
4. ``torch.compile`` with the simplefsdp backend (``compile.enable``).

Pipeline parallelism (splitting into stages) happens before all of this; see
``pipeline.py``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import fnmatch
import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import simplefsdp
from simplefsdp._torch_compat import (
    checkpoint_wrapper,
    custom_partitioner_base,
    raise_recompile_limits,
)
from simplefsdp.compiler.collectives import CollectiveKind
from simplefsdp.compiler.cost.state import optimizer_state_bytes
from simplefsdp.mesh import ParallelDims, stage_group
from simplefsdp.state_dict import unwrapped_name

from ..config.job import PG_TIMEOUT_S, JobConfig, check_tp
from ..errors import ConfigError
from ..models.llama import Transformer
from ..parallel.context import apply_cp
from ..parallel.expert import holds_experts, is_moe, keep_exchanges, moe_tp_plan
from .step import OPTIMIZER

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------
# Tensor parallel.
# ---------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------
# Activation checkpointing.
# ---------------------------------------------------------------------------------------
def _saved_ops() -> set:
    """Ops whose outputs selective AC keeps (torchtitan's per-op list): attention, the TP
    reduce-scatters (not the FSDP all-gathers: those must be recomputed), ``max``; and
    matmuls, of which ``_selective_policy`` keeps every other one."""
    aten = torch.ops.aten
    names = ["mm", "max", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"]
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    return ops | {CollectiveKind.REDUCE_SCATTER.op}


def _selective_policy(saved: frozenset, mm_calls: collections.Counter, ctx, func,
                      *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's op-level rule: save ``saved`` ops' outputs except every second
    ``aten.mm`` of a block's forward (its 2nd, 4th, ...; counted separately in the forward
    and in its recomputation, so both make the same decisions). In our Llama block that
    keeps wq, wv, w1, w2 and recomputes wk, wo, w3: about half the matmul memory."""
    if func is torch.ops.aten.mm.default:
        mm_calls[ctx.is_recompute] += 1
        if mm_calls[ctx.is_recompute] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    """A fresh policy per checkpointed call: the matmul count restarts with each block."""
    policy = functools.partial(_selective_policy, frozenset(_saved_ops()),
                               collections.Counter())
    return create_selective_checkpoint_contexts(policy)


def _routed_selective_context():
    """:func:`_selective_context` for a block that routes tokens to experts, its token
    exchanges kept as well (``parallel.expert.keep_exchanges``: the recomputation is
    served their outputs, so it moves no token again). Eager only: a checkpoint traced
    into a graph takes dispatch modes alone, and a routed block breaks the graph."""
    return tuple(_both(*pair) for pair in zip(_selective_context(), keep_exchanges(),
                                              strict=True))


def _routes_tokens(block: nn.Module) -> bool:
    """Whether ``block`` holds routed experts (its forward leaves the graph for them)."""
    return any(holds_experts(m) for m in block.modules())


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


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
    kwargs = {"context_fn": _routed_selective_context if _routes_tokens(block)
              else _selective_context} \
        if mode == "selective" else {}
    return checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)


# ---------------------------------------------------------------------------------------
# Data parallel and compile.
# ---------------------------------------------------------------------------------------
def dp_options(cfg: JobConfig) -> dict:
    """``data_parallel``'s keyword arguments from ``[training]`` and ``[parallel]`` (the
    per-module fp32 overrides apart): one owner, for the model and for the experts
    sharded on their own mesh first (``moe_family``)."""
    t, p = cfg.training, cfg.parallel
    mp = simplefsdp.MixedPrecisionPolicy(
        param_dtype=_DTYPES[t.mixed_precision_param],
        reduce_dtype=_DTYPES[t.mixed_precision_reduce])
    return {"mode": p.dp_mode, "mp_policy": mp, "reshard_after_forward": p.reshard,
            "reduce_op": "sum"}


def apply_dp(model: nn.Module, mesh: DeviceMesh, cfg: JobConfig) -> nn.Module:
    return simplefsdp.data_parallel(model, mesh, **dp_options(cfg),
                                    mp_overrides=fp32_overrides(model, cfg))


def fp32_overrides(model: nn.Module, cfg: JobConfig) -> dict:
    """``training.mixed_precision_fp32_modules`` as ``data_parallel``'s ``mp_overrides``;
    a glob that matches no module is a ConfigError (under PP a stage holds part of the
    model: there, globs matching nothing on this stage are left out)."""
    key = "training.mixed_precision_fp32_modules"
    names = [unwrapped_name(n) for n, _ in model.named_modules()]
    overrides = {}
    for glob in cfg.training.mixed_precision_fp32_modules:
        if any(fnmatch.fnmatchcase(n, glob) for n in names):
            overrides[glob] = simplefsdp.MixedPrecisionPolicy(torch.float32, torch.float32)
        elif cfg.parallel.pp == 1:
            raise ConfigError(f"{key}: {glob!r} matches no module of the model (module "
                              f"names look like {', '.join(names[1:4])}; globs as fnmatch)")
    return overrides


def with_fp32_modules(cfg: JobConfig, globs: list[str]) -> JobConfig:
    """``cfg`` with ``globs`` added to ``training.mixed_precision_fp32_modules`` when the
    model is gathered or reduced in another dtype than float32 (MoE routers: the routing
    decision is sensitive to rounding); ``cfg`` itself otherwise."""
    t = cfg.training
    mixed = t.mixed_precision_param != "float32" or t.mixed_precision_reduce != "float32"
    new = [g for g in globs if g not in t.mixed_precision_fp32_modules]
    if not mixed or not new:
        return cfg
    return dataclasses.replace(cfg, training=dataclasses.replace(
        t, mixed_precision_fp32_modules=[*t.mixed_precision_fp32_modules, *new]))


def compile_backend_for(mesh: DeviceMesh, cfg: JobConfig, model: nn.Module | None = None):
    """Our ``torch.compile`` backend as ``[compile]`` configures it. A planned bucketing
    (auto, greedy) agrees across the ranks compiling the same graph: under PP, a stage's.
    With ``model`` (sharded), ``memory_limit_gb`` leaves room for the trainer's optimizer
    state (``step.OPTIMIZER``), which lives outside the compiled graphs."""
    c = cfg.compile
    group = None
    if c.bucketing in ("auto", "greedy"):
        group = stage_group(mesh, datetime.timedelta(seconds=PG_TIMEOUT_S))
    dp_mesh = None  # HSDP: plan each collective kind with its own group's figures
    if c.bucketing in ("auto", "greedy") and cfg.parallel.dp_replicate > 1:
        dp_mesh = ParallelDims.data_parallel_mesh(mesh, "hybrid_shard")
    outside = 0
    if model is not None and c.memory_limit_gb is not None:
        outside = optimizer_state_bytes(OPTIMIZER, model.parameters())
    return simplefsdp.compile_backend(backend=c.backend, bucketing=c.bucketing,
                                      reordering=c.reordering, module_plan=None,
                                      memory_limit_gb=c.memory_limit_gb, group=group,
                                      state_bytes_outside_graphs=outside, mesh=dp_mesh)


def apply_compile(model: nn.Module, mesh: DeviceMesh, cfg: JobConfig,
                  fullgraph: bool = True) -> nn.Module:
    """``fullgraph = False`` lets the model leave the graph where it must (an MoE's
    data-dependent expert dispatch); our passes then run on each graph."""
    backend = compile_backend_for(mesh, cfg, model)
    if not fullgraph:
        # Traced module by module, each block's frames compile once per block (Dynamo
        # guards a block's own modules): past the default limit (8) the rest ran eagerly.
        raise_recompile_limits(len(getattr(model, "layers", {})) + 8)
        _compile_checkpointed_blocks(model, backend)
    return torch.compile(model, fullgraph=fullgraph, backend=backend)


def ac_mode_run(mode: str, compiled: bool, fullgraph: bool) -> str:
    """The activation checkpointing a block's graphs get for
    ``activation_checkpoint.mode``: ``selective`` recomputes them whole in a compiled
    model that leaves the graph (``fullgraph = False``: an MoE's; only the token exchanges
    between them are kept, :func:`_compile_checkpointed_blocks`)."""
    return "full" if mode == "selective" and compiled and not fullgraph else mode


def _compile_checkpointed_blocks(model: nn.Module, backend) -> None:
    """Compile each checkpointed block's own call, in a model that leaves the graph (an
    MoE's eager expert dispatch). A block with a break cannot be one checkpoint region of
    a graph: its checkpoint runs eagerly around compiled frames, and the recomputation in
    backward, called by autograd outside the compiled model, ran the block eagerly,
    saving other tensors than the compiled forward did (torch.utils.checkpoint refused:
    "Recomputed values ... have different metadata"; at step 1 for a routed block, at
    step 2 for DeepSeek's dense first block, whose checkpoint, traced from the outer
    frames, broke too). Compiled on their own, the forward and its recomputation run the
    same graphs.

    Under ``selective`` such a block's graphs are recomputed whole: the op-level policy
    cannot see into an Inductor graph. What a routed block keeps is the outputs of the
    eager token exchanges between them (``parallel.expert.keep_exchanges``), so the
    recomputation moves no token again. No selective-checkpoint mode runs around these
    graphs: in the recomputation it met ops of Inductor's runtime wrappers that the
    forward had not run (torch 2.13: "aten._unsafe_view.default encountered during
    backward but not found in storage"). A dense block (DeepSeek's first) has no break:
    Dynamo traces its checkpoint into the graph, where ``context_fn`` must make dispatch
    modes, so it gets none (full AC, as the graphs of a routed block)."""
    for block in getattr(model, "layers", {}).values():
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        if inner is None:
            continue
        inner.compile(backend=backend)
        fn, keywords = block.checkpoint_fn, dict(block.checkpoint_fn.keywords)
        if keywords.get("context_fn") is not None:  # selective
            if _routes_tokens(block):  # its checkpoint runs eagerly, around the dispatch
                keywords["context_fn"] = keep_exchanges
            else:  # traced whole: compile takes dispatch-mode contexts only; as full
                del keywords["context_fn"]
            block.checkpoint_fn = functools.partial(fn.func, *fn.args, **keywords)


def check_composition(ac_mode: str, compiled: bool, backend: str = "inductor") -> None:
    """Refuse, before any work, the combinations this torch cannot compile. Full AC
    compiles through ``compiler/recompute.py`` (min-cut, then the saved values put back in
    the runtime's layout); Inductor needs ``custom_partitioner_fn`` for it (2.13 has it)."""
    if compiled and ac_mode == "full" and backend == "inductor" \
            and custom_partitioner_base() is None:
        raise ConfigError(
            "activation_checkpoint.mode = 'full' with compile.enable = true and "
            f"compile.backend = 'inductor' needs Inductor's custom_partitioner_fn, which "
            f"torch {torch.__version__} lacks; use compile.backend = 'aot_eager', "
            "activation_checkpoint.mode = 'selective', or compile.enable = false")


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: JobConfig,
                before_dp=None, fullgraph: bool = True) -> nn.Module:
    """TP, activation checkpointing, data parallel, compile: in that order, in place
    (the returned module is the compiled wrapper when compile is on). ``before_dp(model,
    mesh, cfg)`` runs just before data parallel (MoE: expert parallelism); ``fullgraph``
    is ``apply_compile``'s."""
    check_composition(cfg.activation_checkpoint.mode, cfg.compile.enable, cfg.compile.backend)
    if cfg.parallel.dims().cp > 1:
        apply_cp(model, mesh, cfg.training.seq_len, cfg.parallel.cp_rotate)
    if cfg.parallel.tp > 1:
        apply_tp(model, mesh["tp"], cfg.training.seq_len, cfg.parallel.vocab_sharded_loss)
    apply_ac(model, cfg.activation_checkpoint.mode)
    if before_dp is not None:
        before_dp(model, mesh, cfg)
    model = apply_dp(model, mesh, cfg)
    if cfg.compile.enable:
        model = apply_compile(model, mesh, cfg, fullgraph)
    return model
