"""The benchmark's variants: how each one turns the same initial weights into a model.

Every variant starts from one state dict (same seed on every rank, so the same values
everywhere) and gets its own AdamW optimizer. ``build`` raises
:class:`VariantUnavailable` when this torch lacks what the variant needs; the runner
then records the variant as failed instead of stopping. Each builder creates its
compile backend before building the model, so a backend that refuses its settings fails
on every rank alike (``bucketing="auto"`` calibrates there: a collective every rank runs).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import simplefsdp as sf

from .._torch_compat import compile_fx, missing_inductor_options, overlap_scheduler_missing
from ..models.llama import ModelArgs, Transformer
from ..models.moe import MoEArgs, MoETransformer


class VariantUnavailable(RuntimeError):
    """The variant cannot run on this torch or with these settings."""


@dataclass
class BuildContext:
    """What every builder may use; identical on every rank."""

    args: ModelArgs
    init_state: dict[str, torch.Tensor]
    fsdp_mesh: DeviceMesh  # 1-D, all ranks: fully_shard
    replicate_mesh: DeviceMesh  # the (pp, dp_replicate, dp_shard, tp) mesh for replicate
    device: torch.device
    compile_backend: str  # "inductor" or "aot_eager", for our compiled variants and FSDP2


@dataclass
class Built:
    """A built variant: call ``model`` on tokens; ``backend`` is ours when compiled with it."""

    model: nn.Module
    backend: object | None = None
    before_step: Callable[[], None] | None = None  # run before each optimizer step
    after_step: Callable[[], None] | None = None  # run after each optimizer step


@dataclass(frozen=True)
class VariantSpec:
    name: str
    description: str
    build: Callable[[BuildContext], Built]
    compiled: bool = False
    communicates: bool = True  # False: the compute-only reference
    rank0_only: bool = False  # True: only rank 0 trains (the others wait)
    moe: bool = False  # True: needs an MoE preset (expert parallelism)


def model_class(args: ModelArgs) -> type[Transformer]:
    """The decoder ``args`` describe: our MoE for an MoE preset (``debug_moe``), else Llama."""
    return MoETransformer if isinstance(args, MoEArgs) else Transformer


def plain_model(ctx: BuildContext) -> Transformer:
    """A fresh, unsharded model holding the shared initial weights."""
    model = model_class(ctx.args)(ctx.args)
    model.load_state_dict(ctx.init_state)
    return model.to(ctx.device)


# ---------------------------------------------------------------------------------------
# simplefsdp variants.
# ---------------------------------------------------------------------------------------
def _simplefsdp(bucketing: str | None, reordering: bool = False,
                ac: str = "none", float8: bool = False) -> Callable[[BuildContext], Built]:
    """Eager (``bucketing=None``) or compiled with our backend and these passes; ``ac``:
    each block checkpointed as the trainer does ("none", "selective", "full");
    ``float8``: linear layers in float8 (tensorwise) with the float8 all-gather."""

    def build(ctx: BuildContext) -> Built:
        from ..parallel.activation_checkpoint import apply_ac, check_composition

        check_composition(ac, bucketing is not None, ctx.compile_backend)
        backend = None
        if bucketing is not None:  # a refused setting raises on every rank alike
            backend = sf.compile_backend(backend=ctx.compile_backend, bucketing=bucketing,
                                         reordering=reordering)
        model = plain_model(ctx)
        if float8:  # before AC and sharding, as the trainer converts
            sf.convert_to_float8(model, recipe="tensorwise", all_gather=True)
        apply_ac(model, ac)
        model = sf.data_parallel(model, ctx.fsdp_mesh)
        if backend is not None:
            model = torch.compile(model, fullgraph=True, backend=backend)
        return Built(model, backend)

    return build


def _replicate(compiled: bool) -> Callable[[BuildContext], Built]:
    """Our DDP: eager, or compiled with all-reduce buckets (DDP's 25 MB) and reordering."""

    def build(ctx: BuildContext) -> Built:
        backend = sf.compile_backend(backend=ctx.compile_backend, bucketing="manual",
                                     reordering=True) if compiled else None
        model = sf.data_parallel(plain_model(ctx), ctx.replicate_mesh, mode="replicate")
        if backend is not None:
            model = torch.compile(model, fullgraph=True, backend=backend)
        return Built(model, backend)

    return build


def _hybrid_shard(ctx: BuildContext) -> Built:
    """HSDP on a 2 x (world / 2) mesh, compiled with manual bucketing and reordering:
    per block, a reduce-scatter over the shard group then an all-reduce of the shard."""
    world = ctx.fsdp_mesh.size()
    if world < 4 or world % 2:
        raise VariantUnavailable(f"hybrid_shard needs an even world size of at least 4 "
                                 f"(2 replicas x 2+ shards), got {world}")
    backend = sf.compile_backend(backend=ctx.compile_backend, bucketing="manual",
                                 reordering=True)
    mesh = sf.make_mesh(dp_replicate=2, dp_shard=world // 2, device_type=ctx.device.type)
    model = sf.data_parallel(plain_model(ctx), mesh, mode="hybrid_shard")
    return Built(torch.compile(model, fullgraph=True, backend=backend), backend)


def _expert_parallel(ep: int, compiled: bool) -> Callable[[BuildContext], Built]:
    """An MoE preset with expert parallelism over ``ep`` of the ranks (``parallel/expert.py``:
    experts split, then sharded over the rest; everything else fully sharded), eager or
    compiled with our backend (manual bucketing and reordering; the routed experts leave
    the graph, as in the trainer)."""

    def build(ctx: BuildContext) -> Built:
        from ..mesh import ParallelDims
        from ..parallel.expert import apply_ep, shard_experts

        world = _check_ep(ctx, ep)
        backend = sf.compile_backend(backend=ctx.compile_backend, bucketing="manual",
                                     reordering=True) if compiled else None
        mesh = sf.make_mesh(dp_shard=world, device_type=ctx.device.type)
        model = plain_model(ctx)
        apply_ep(model, ParallelDims.expert_mesh(mesh, ep))
        shard_experts(model, ParallelDims.expert_mesh(mesh, ep))
        model = sf.data_parallel(model, mesh)
        # The benchmark's loss is each rank's mean and gradients are averaged: an expert's
        # gradient already sums its EP group's ranks (the exchange's backward), then is
        # averaged over the world / ep ranks holding it; / ep makes it the mean over all
        # ranks, as every other parameter's (exact in float32 for a power of 2).
        for param in model.parameters():
            mesh_of = getattr(param, "device_mesh", None)
            if mesh_of is not None and "ep" in (mesh_of.mesh_dim_names or ()):
                param.register_post_accumulate_grad_hook(functools.partial(_divide_grad, ep))
        if backend is not None:
            model = torch.compile(model, fullgraph=False, backend=backend)
        return Built(model, backend)

    return build


def _fsdp2_expert_parallel(ep: int) -> Callable[[BuildContext], Built]:
    """FSDP2 with our expert parallelism, eager: the experts split as in
    :func:`_expert_parallel` (the same dispatch and all-to-alls), each rank's experts kept as
    plain tensors and ``fully_shard`` over the experts' ``dp_shard`` ranks (the ones holding
    the same experts), then each block and the root over all ranks."""

    def build(ctx: BuildContext) -> Built:
        from torch.distributed.fsdp import fully_shard

        from ..mesh import ParallelDims
        from ..models.moe import moe_layers
        from ..parallel.expert import apply_ep

        world = _check_ep(ctx, ep)
        experts_mesh = ParallelDims.expert_mesh(sf.make_mesh(dp_shard=world,
                                                             device_type=ctx.device.type), ep)
        model = plain_model(ctx)
        apply_ep(model, experts_mesh)
        for layer in moe_layers(model):
            experts = layer.experts
            for name in ("gate_up_proj", "down_proj"):  # this rank's experts, plain
                experts._parameters[name] = nn.Parameter(experts._parameters[name].to_local())
            fully_shard(experts, mesh=experts_mesh["dp_shard"])
        for block in model.layers.values():
            fully_shard(block, mesh=ctx.fsdp_mesh)
        fully_shard(model, mesh=ctx.fsdp_mesh)
        # FSDP2 averages the experts' gradients over the world / ep ranks holding them;
        # then / ep (see _expert_parallel): the mean over all ranks, as every other
        # gradient. Before the optimizer step: a gradient divide factor would make FSDP2
        # reduce with PREMUL_SUM, which gloo lacks.
        experts = [p for layer in moe_layers(model) for p in layer.experts.parameters()]
        return Built(model, before_step=functools.partial(_divide_grads, experts, ep))

    return build


def _check_ep(ctx: BuildContext, ep: int) -> int:
    """The world size, once ``ep`` is known to fit it and the model (else unavailable)."""
    if not isinstance(ctx.args, MoEArgs):
        raise VariantUnavailable("expert parallelism needs an MoE preset (model.name = "
                                 "'debug_moe')")
    from ..mesh import ParallelDims
    from ..parallel.expert import check_expert_split

    world = ctx.fsdp_mesh.size()
    try:  # the rules' owners: the ranks (all of them, dp_shard here), the experts
        ParallelDims(dp_shard=world, ep=ep)
        check_expert_split(ep, ctx.args.num_experts)
    except ValueError as e:
        raise VariantUnavailable(str(e)) from None
    return world


def _divide_grad(factor: int, param: torch.Tensor) -> None:
    param.grad.div_(factor)


def _divide_grads(params: list[torch.Tensor], factor: int) -> None:
    for param in params:
        if param.grad is not None:
            param.grad.div_(factor)


# ---------------------------------------------------------------------------------------
# Torch's own FSDP passes, on our frontend (plain Inductor with upstream options).
# ---------------------------------------------------------------------------------------
UPSTREAM_FX_BUCKETING = {
    "bucket_all_gathers_fx": "only_fsdp",
    "bucket_reduce_scatters_fx": "all",
    "reorder_for_compute_comm_overlap": True,
}
UPSTREAM_OVERLAP_SCHEDULER = {
    "aten_distributed_optimizations.enable_overlap_scheduling": True,
    "aten_distributed_optimizations.collective_bucketing": True,
}


def _check_inductor_options(patches: dict) -> None:
    missing = missing_inductor_options(patches)
    if missing:
        raise VariantUnavailable(f"unavailable on this torch ({torch.__version__}): Inductor "
                                 f"has no config {missing}")


def _upstream(patches: dict, missing: Callable[[], str | None] = lambda: None
              ) -> Callable[[BuildContext], Built]:
    """Plain Inductor with ``patches``; ``missing()``: why the passes cannot run here."""
    def build(ctx: BuildContext) -> Built:
        _check_inductor_options(patches)
        if why := missing():
            raise VariantUnavailable(f"unavailable on this torch ({torch.__version__}): the "
                                     f"overlap scheduler fails here: {why}")

        def backend(gm, example_inputs):
            return compile_fx(gm, example_inputs, config_patches=dict(patches))

        model = sf.data_parallel(plain_model(ctx), ctx.fsdp_mesh)
        return Built(torch.compile(model, fullgraph=True, backend=backend))

    return build


# ---------------------------------------------------------------------------------------
# FSDP2 and the compute-only reference.
# ---------------------------------------------------------------------------------------
def _fsdp2(compile_blocks: bool) -> Callable[[BuildContext], Built]:
    def build(ctx: BuildContext) -> Built:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError as e:
            raise VariantUnavailable(f"unavailable on this torch: {e}") from e
        model = plain_model(ctx)
        for block in model.layers.values():
            if compile_blocks:  # in place, so names and hooks stay on the block itself
                block.compile(backend=ctx.compile_backend, fullgraph=True)
            fully_shard(block, mesh=ctx.fsdp_mesh)
        fully_shard(model, mesh=ctx.fsdp_mesh)
        return Built(model)

    return build


TORCHAO_MISSING = ("needs torchao's float8 training (torchao 0.18): pip install "
                   "'simplefsdp[float8]'")


def torchao_float8():
    """torchao's ``float8`` module, or :class:`VariantUnavailable` saying how to get it
    (the optional ``float8`` extra)."""
    try:
        from torchao import float8
    except ImportError as e:
        raise VariantUnavailable(f"{TORCHAO_MISSING} ({e})") from None
    return float8


def _fsdp2_float8(ctx: BuildContext) -> Built:
    """FSDP2 (per block + root, eager) with torchao's float8 training: the linear layers
    that ``simplefsdp-float8`` converts (``float8.DEFAULT_EXCLUDE`` kept high precision),
    tensorwise, their weights gathered in float8 (``enable_fsdp_float8_all_gather``) with
    the scales precomputed after each optimizer step, torchao's recommended setting."""
    import fnmatch

    from torch.distributed.fsdp import fully_shard

    from ..float8 import DEFAULT_EXCLUDE

    ao = torchao_float8()
    model = plain_model(ctx)

    def converted(module: nn.Module, fqn: str) -> bool:
        return not any(fnmatch.fnmatchcase(fqn, g) for g in DEFAULT_EXCLUDE)

    ao.convert_to_float8_training(model, module_filter_fn=converted, config=ao.Float8LinearConfig(
        enable_fsdp_float8_all_gather=True))
    for block in model.layers.values():
        fully_shard(block, mesh=ctx.fsdp_mesh)
    fully_shard(model, mesh=ctx.fsdp_mesh)
    return Built(model, after_step=lambda: ao.precompute_float8_dynamic_scale_for_fsdp(model))


def _torch_ddp(ctx: BuildContext) -> Built:
    from torch.nn.parallel import DistributedDataParallel

    model = plain_model(ctx)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # The only buffer (the RoPE table) is derived from the config: nothing to sync per
    # forward. torch 2.13 renamed the option (the old name warns); 2.11 has only the old.
    params = inspect.signature(DistributedDataParallel).parameters
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params \
        else {"broadcast_buffers": False}
    return Built(DistributedDataParallel(model, device_ids=device_ids, **no_sync))


def _compute_only(compiled: bool) -> Callable[[BuildContext], Built]:
    """The unsharded model on one rank: eager, or compiled as our compiled variants are
    (``ctx.compile_backend``, one graph), so each is measured against the computation it
    really runs (Inductor's fused kernels are faster than eager's)."""
    def build(ctx: BuildContext) -> Built:
        model = plain_model(ctx)
        if compiled:
            model = torch.compile(model, fullgraph=True, backend=ctx.compile_backend)
        return Built(model)
    return build


_SPECS = [
    VariantSpec("simplefsdp-eager", "simplefsdp fully_shard, eager", _simplefsdp(None)),
    VariantSpec("simplefsdp-compiled", "simplefsdp + torch.compile, no passes",
                _simplefsdp("none"), compiled=True),
    VariantSpec("simplefsdp-bucketing", "+ manual bucketing (one bucket per block)",
                _simplefsdp("manual"), compiled=True),
    VariantSpec("simplefsdp-reordering", "+ manual bucketing + reordering",
                _simplefsdp("manual", True), compiled=True),
    VariantSpec("simplefsdp-reordering-selective-ac", "simplefsdp-reordering, selective "
                "activation checkpointing per block", _simplefsdp("manual", True, "selective"),
                compiled=True),
    VariantSpec("simplefsdp-reordering-full-ac", "simplefsdp-reordering, full activation "
                "checkpointing per block", _simplefsdp("manual", True, "full"), compiled=True),
    VariantSpec("simplefsdp-auto", "+ auto wrapping + reordering",
                _simplefsdp("auto", True), compiled=True),
    VariantSpec("simplefsdp-float8", "simplefsdp-reordering with float8 linear layers and "
                "the float8 all-gather (its losses differ from the reference by float8 "
                "rounding)", _simplefsdp("manual", True, float8=True), compiled=True),
    VariantSpec("upstream-fx-bucketing",
                "our frontend, plain Inductor + bucket_*_fx + reorder_for_compute_comm_overlap",
                _upstream(UPSTREAM_FX_BUCKETING), compiled=True),
    VariantSpec("upstream-overlap-scheduler",
                "our frontend, plain Inductor + aten_distributed_optimizations overlap "
                "scheduling + collective bucketing",
                _upstream(UPSTREAM_OVERLAP_SCHEDULER, overlap_scheduler_missing),
                compiled=True),
    VariantSpec("fsdp2-eager", "torch FSDP2 fully_shard per block + root, eager",
                _fsdp2(False)),
    VariantSpec("fsdp2-float8", "FSDP2 eager with torchao's float8 training and float8 "
                "all-gather (the optional float8 extra; losses differ from the reference by "
                "float8 rounding)", _fsdp2_float8),
    VariantSpec("fsdp2-compiled-blocks", "FSDP2, each block torch.compile'd before fully_shard",
                _fsdp2(True), compiled=True),
    VariantSpec("ddp-replicate", "simplefsdp mode='replicate' (DDP), eager", _replicate(False)),
    VariantSpec("ddp-compiled", "simplefsdp replicate + compile + all-reduce buckets + "
                "reordering", _replicate(True), compiled=True),
    VariantSpec("hsdp-compiled", "simplefsdp hybrid_shard (2 x world/2) + compile + manual "
                "bucketing + reordering (world >= 4)", _hybrid_shard, compiled=True),
    VariantSpec("torch-ddp", "torch DistributedDataParallel, eager", _torch_ddp),
    VariantSpec("moe-ep2-eager", "MoE preset: EP 2 x FSDP (world / 2), eager",
                _expert_parallel(2, False), moe=True),
    VariantSpec("moe-ep2-compiled", "MoE preset: EP 2 x FSDP, compiled (manual bucketing + "
                "reordering; routed experts eager between graphs)", _expert_parallel(2, True),
                compiled=True, moe=True),
    VariantSpec("fsdp2-ep2-eager", "MoE preset: torch FSDP2 (experts over world / 2, the "
                "rest per block + root) with our EP 2 dispatch, eager",
                _fsdp2_expert_parallel(2), moe=True),
    VariantSpec("compute-only", "one rank, same per-rank batch, no communication",
                _compute_only(False), communicates=False, rank0_only=True),
    VariantSpec("compute-only-compiled", "compute-only, torch.compile'd (the limit of the "
                "compiled variants)", _compute_only(True), compiled=True,
                communicates=False, rank0_only=True),
]
VARIANTS: dict[str, VariantSpec] = {s.name: s for s in _SPECS}
BASELINE = "fsdp2-eager"  # the ratio column divides by this one
LOSS_REFERENCE = "simplefsdp-eager"  # losses are compared against this one
COMPUTE_ONLY = {False: "compute-only", True: "compute-only-compiled"}  # by compiled
