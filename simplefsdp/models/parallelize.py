"""A model family's ``parallelize``: the job's config read into each parallelism's
plain options, applied to a built model in the order they compose. Each parallelism is
its own module, usable without the trainer; this is the one place a ``JobConfig`` meets
them.

Float8 first (``float8``; ``simplefsdp/float8.py``): linear layers swapped for float8
ones, so data parallel gathers their weights in float8 (``float8.all_gather``).

0. Context parallelism (``parallel.cp_ring``, ``parallel.cp_ulysses``;
   ``parallel/context.py``): each block's attention sees the whole sequence of which
   this rank holds a part; RoPE takes the part's global positions.
1. Tensor + sequence parallel (``parallel.tp``; ``parallel/tensor.py``) on ``mesh["tp"]``,
   loss parallel with ``parallel.loss_parallel``.
2. Activation checkpointing (``activation_checkpoint.mode``;
   ``parallel/activation_checkpoint.py``) per block.
3. ``simplefsdp.data_parallel`` over the data-parallel dims of the same mesh, with
   ``reduce_op="sum"``: the trainer's loss is already normalized by the global token
   count, so gradients are summed, not averaged.
4. ``torch.compile`` with the simplefsdp backend (``compile.enable``).

Pipeline parallelism (splitting into stages, ``parallel/pipeline.py``) happens before
all of this; expert parallelism (``parallel/expert.py``) in ``before_dp`` (the MoE
family's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fnmatch
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import simplefsdp

from .._torch_compat import data_dependent_shapes, raise_recompile_limits
from .._torch_compat.unbacked import forward_side_effects_once
from ..compiler import cost
from ..compiler.cost.state import optimizer_state_bytes
from ..config.job import DTYPES, PG_TIMEOUT_S, JobConfig
from ..errors import ConfigError
from ..mesh import ParallelDims, stage_group
from ..optim import OPTIMIZER
from ..parallel.activation_checkpoint import (
    apply_ac,
    check_composition,
    compile_checkpointed_blocks,
)
from ..parallel.context import apply_cp
from ..parallel.expert import holds_experts
from ..parallel.tensor import apply_tp
from ..state_dict import unwrapped_name
from .llama import Transformer
from .lora import apply_lora


def dp_options(cfg: JobConfig) -> dict:
    """``data_parallel``'s keyword arguments from ``[training]`` and ``[parallel]`` (the
    per-module fp32 overrides apart): one owner, for the model and for the experts
    sharded on their own mesh first (``moe_family``)."""
    t, p = cfg.training, cfg.parallel
    mp = simplefsdp.MixedPrecisionPolicy(
        param_dtype=DTYPES[t.mixed_precision_param],
        reduce_dtype=DTYPES[t.mixed_precision_reduce])
    offload = simplefsdp.CPUOffloadPolicy(pin_memory=True) if t.cpu_offload else None
    return {"mode": p.dp_mode, "mp_policy": mp, "reshard_after_forward": p.reshard,
            "reduce_op": "sum", "offload_policy": offload}


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
    state (``optim.OPTIMIZER``), which lives outside the compiled graphs."""
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
    comm_model = pinned_comm_model(c.comm_model) if c.bucketing in ("auto", "greedy") \
        else None
    return simplefsdp.compile_backend(backend=c.backend, bucketing=c.bucketing,
                                      reordering=c.reordering, module_plan=None,
                                      memory_limit_gb=c.memory_limit_gb, group=group,
                                      state_bytes_outside_graphs=outside, mesh=dp_mesh,
                                      comm_model=comm_model)


def pinned_comm_model(source: str) -> cost.CommModel | None:
    """``compile.comm_model`` as the backend takes it: None to calibrate (the backend
    does, on the process groups it plans for); the fabric table's figures for the default
    group ("fabric": nothing timed or cached, every rank alike); or a calibration file's,
    which must have been calibrated on this job's world size (the default group's)."""
    if source == "calibrate":
        return None
    if source == "fabric":
        return cost.get_comm_model(calibrate_on_miss=False, cache=False)
    model = cost.comm.read_comm_model(source)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if model.world_size != world:
        raise ConfigError(f"compile.comm_model = {source!r} was calibrated on "
                          f"{model.world_size} ranks, this job runs {world}: pick a file "
                          f"calibrated on {world} ranks (a run with compile.comm_model = "
                          f"'calibrate' caches one; python -m simplefsdp.calibrate --no-probe "
                          f"lists them) or set compile.comm_model = 'calibrate'")
    return model


def apply_compile(model: nn.Module, mesh: DeviceMesh, cfg: JobConfig,
                  fullgraph: bool = True) -> nn.Module:
    """``fullgraph = False`` lets the model leave the graph where it must (an MoE's
    routed blocks under selective AC, whose dispatch keeps its exchanges eagerly); our
    passes then run on each graph."""
    backend = compile_backend_for(mesh, cfg, model)
    if not fullgraph:
        # Traced module by module, each block's frames compile once per block (Dynamo
        # guards a block's own modules): the limit must cover every block, or the rest
        # would run eagerly.
        raise_recompile_limits(len(getattr(model, "layers", {})) + 8)
        compile_checkpointed_blocks(model, backend)
    return compile_model(model, backend, fullgraph)


def compile_model(model: nn.Module, backend, fullgraph: bool = True) -> nn.Module:
    """``torch.compile(model)`` with ``backend``; a model that routes tokens to experts
    (fused experts, ours or Hugging Face's: ``parallel.expert.holds_experts``) is traced
    with data-dependent shapes (``_torch_compat.data_dependent_shapes``) on, and its routed
    blocks' forward
    writes (load counters, balance loss) done once under a checkpoint
    (``_torch_compat.forward_side_effects_once``: selective AC traces the block whole)."""
    compiled = torch.compile(model, fullgraph=fullgraph, backend=backend)
    if any(holds_experts(m) for m in model.modules()):
        # The exact expert dispatch reads its split sizes on the host: traced as unbacked
        # sizes. Set only while this model's frames are traced (its forward), not globally.
        compiled.forward = _traced_with(_moe_tracing, compiled.forward)
    return compiled


@contextlib.contextmanager
def _moe_tracing():
    with data_dependent_shapes(), forward_side_effects_once():
        yield


def _traced_with(context, forward):
    """``forward`` run inside ``context()`` (a Dynamo config patch: tracing happens in the
    first calls, and in any recompilation)."""
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with context():
            return forward(*args, **kwargs)
    return run


def apply_float8(model: nn.Module, cfg: JobConfig) -> None:
    """``[float8]``: the model's linear layers (less ``float8.exclude``) compute in
    float8, and with ``float8.all_gather`` gather their weights in float8."""
    f = cfg.float8
    if not f.enable:
        return
    simplefsdp.convert_to_float8(model, recipe=f.recipe, all_gather=f.all_gather,
                                 exclude=f.exclude)
    if not model.float8_modules:
        raise ConfigError(f"float8.enable = true but float8.exclude = {f.exclude} leaves no "
                          f"nn.Linear to convert; narrow float8.exclude")


def parallelize(model: Transformer, mesh: DeviceMesh, dims: ParallelDims, cfg: JobConfig,
                before_dp=None, fullgraph: bool = True) -> nn.Module:
    """LoRA, float8, CP, TP, activation checkpointing, data parallel, compile: in that order,
    in place (the returned module is the compiled wrapper when compile is on). ``dims``: the run's
    ``ParallelDims``, ``mesh`` built from it. ``before_dp(model, mesh, cfg)`` runs just
    before data parallel (MoE: expert parallelism); ``fullgraph`` is ``apply_compile``'s."""
    check_composition(cfg.activation_checkpoint.mode, cfg.compile.enable, cfg.compile.backend)
    apply_lora(model, cfg)  # [lora]: adapters in, the rest frozen; before anything wraps
    apply_float8(model, cfg)  # [float8]: before data parallel, which gathers in float8
    if dims.cp > 1:
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
