"""Capture the forward and backward graphs one rank runs, on one CPU process.

A fake process group (``FakeStore`` + backend ``"fake"``) of the layout's data-parallel
and tensor-parallel size stands for the cluster: collectives there return local data
and are never timed. The model is built on ``meta`` with only ``k`` blocks (the blocks
repeat, so the planner scales by depth), split into the pipeline stage's pieces, then
parallelized exactly as the trainer does (``models.parallelize``: TP, activation
checkpointing, ``data_parallel``). Its parameters become fake CPU tensors under ONE
``FakeTensorMode`` (fake CUDA tensors abort autograd on a CPU-only torch build), and
``torch.compile(fullgraph=True)`` runs AOTAutograd with our passes (bucketing,
reordering) and a capture-only compiler: no code is generated, nothing runs.

The graphs keep their ``meta["val"]`` fake tensors: shapes, dtypes, and the module each
node came from, which is all memory and timing need.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx

from ..config.job import DTYPES, JobConfig
from ..models.llama import ModelArgs, Transformer
from ..models.mla import MultiHeadLatentAttention, fused_kernel_attention
from ..models.parallelize import parallelize
from ..parallel.pipeline import split_stage
from .moe import stand_in

# One fake world for the whole process, never torn down: DTensor caches sharding
# decisions by mesh *equality*, so a rebuilt equal mesh would get stale mesh objects
# back. Traced meshes are sub-meshes of it, built once per shape (``_mesh``): up to 2
# replicas x 2 shards x CP x TP (``predict``), so TP 8 with CP 8 fits.
FAKE_WORLD = 256


@dataclass(frozen=True)
class TraceKey:
    """Everything a rank's graphs depend on; equal keys share one trace.

    ``dp_replicate`` / ``dp_shard`` are the sizes *traced*, not the layout's: shard-sized
    tensors are rescaled to the layout's sizes afterwards (see ``memory.node_bytes``).
    """

    model: str
    args: tuple  # fields of args_type, n_layers = traced blocks
    role: str  # "full": the whole model (pp = 1); "first" / "last": a pipeline stage
    dp_mode: str
    dp_replicate: int
    dp_shard: int
    tp: int
    batch: int  # microbatch, sequences
    seq: int
    ac: str
    compile: bool
    bucketing: str
    reordering: bool
    param_dtype: str
    reduce_dtype: str
    reshard: bool  # an int (reshard to a group) traces as True: plan.tradeoffs adds it
    loss_parallel: bool  # parallel.loss_parallel: with tp > 1, vocabulary-sharded logits
    cp_ring: int  # context parallelism: each rank traces its part of the sequence
    cp_ulysses: int
    cp_rotate: str  # parallel.cp_rotate: the ring's K/V all-gathered or passed around
    args_type: type = ModelArgs  # the args' class (MLAArgs: the attention is a choice)
    # [float8]: (recipe, all_gather, exclude globs) when enabled, else None
    float8: tuple | None = None

    @property
    def dims(self):
        """The traced layout's ``ParallelDims`` (one pipeline stage)."""
        from ..mesh import ParallelDims

        return ParallelDims(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                            cp_ring=self.cp_ring, cp_ulysses=self.cp_ulysses, tp=self.tp)


@dataclass
class Trace:
    """The captured graphs (after our passes) and what they were traced with."""

    key: TraceKey
    forward: fx.GraphModule
    backward: fx.GraphModule
    n_forward_outputs: int  # user outputs of the forward graph; the rest are saved
    groups: dict[str, str]  # process group name -> mesh dim ("dp_shard", "tp", ...)
    shards: set  # (shape, dtype) of this rank's parameter shards
    # graphs compiled apart from the autograd pair, without gradients: the float8
    # scale agreement (``float8_gather.install_float8_scales``' pre-hook on the root is its own
    # frame to dynamo), run before the forward
    prologue: tuple[fx.GraphModule, ...] = ()


def trace_key(cfg: JobConfig, role: str, layers: int, batch: int,
              dp_replicate: int, dp_shard: int) -> TraceKey:
    """The key for ``cfg``'s layout traced with ``layers`` blocks at the given sizes."""
    # a mixture of experts is traced as its dense stand-in (``plan.moe``)
    args = dataclasses.replace(stand_in(cfg.model.model_args()), n_layers=layers)
    p, t, c = cfg.parallel, cfg.training, cfg.compile
    # Eager SimpleFSDP has no passes: one collective per parameter, waited on at once.
    # "auto" measures timings while compiling, which a fake group cannot give: it is
    # planned as "manual" (one bucket per block), the paper's Table 3 setting.
    bucketing = ("manual" if c.bucketing == "auto" else c.bucketing) if c.enable else "none"
    return TraceKey(cfg.model.name, dataclasses.astuple(args), role, p.dp_mode, dp_replicate,
                    dp_shard, p.tp, batch, t.seq_len, cfg.activation_checkpoint.mode,
                    c.enable, bucketing, c.reordering and c.enable, t.mixed_precision_param,
                    t.mixed_precision_reduce, p.reshard is not False, p.loss_parallel, p.cp_ring,
                    p.cp_ulysses, p.cp_rotate, type(args), _float8_key(cfg))


def _float8_key(cfg: JobConfig) -> tuple | None:
    f = cfg.float8
    return (f.recipe, f.all_gather, tuple(f.exclude)) if f.enable else None


@functools.lru_cache(maxsize=256)
def trace(key: TraceKey) -> Trace:
    """Capture ``key``'s forward and backward graphs (cached: identical per-rank shapes
    are traced once per process)."""
    from .._torch_compat import (
        FakeTensorMode,
        dtensor_sharding_cache_clear,
        dynamo_reset,
        eager_backward_compile,
    )

    ensure_fake_world()
    # Sub-meshes (``mesh["tp"]``) are new objects per trace. A sharding decision cached
    # by an earlier trace would hand this one a spec holding that trace's mesh object;
    # dynamo then lifts it as an extra graph input and AOTAutograd's partition fails
    # ("tangents_2 was invalid, but is output": tp 2 with loss_parallel's DTensor
    # output, traced after two other shapes).
    dtensor_sharding_cache_clear()
    try:
        with eager_backward_compile():
            return _trace(key, FakeTensorMode)
    finally:
        dynamo_reset()


def ensure_fake_world() -> None:
    """Join the planner's fake process group (once per process)."""
    from .._torch_compat import fake_store

    if not dist.is_initialized():
        dist.init_process_group("fake", store=fake_store(), rank=0, world_size=FAKE_WORLD)
    elif dist.get_backend() != "fake":
        raise RuntimeError("the planner traces under its own fake process group; call it "
                           "before init_process_group, or in a separate process")


def _job(key: TraceKey) -> JobConfig:
    cfg = JobConfig()
    cfg.parallel = dataclasses.replace(cfg.parallel, dp_replicate=key.dp_replicate,
                                       dp_shard=key.dp_shard, tp=key.tp, pp=1,
                                       dp_mode=key.dp_mode, reshard_after_forward=key.reshard,
                                       loss_parallel=key.loss_parallel, cp_ring=key.cp_ring,
                                       cp_ulysses=key.cp_ulysses, cp_rotate=key.cp_rotate)
    cfg.training = dataclasses.replace(cfg.training, mixed_precision_param=key.param_dtype,
                                       mixed_precision_reduce=key.reduce_dtype)
    cfg.training = dataclasses.replace(cfg.training, seq_len=key.seq)
    cfg.activation_checkpoint.mode = key.ac
    cfg.compile.enable = False  # we compile below, with the capture-only compiler
    if key.float8 is not None:
        recipe, all_gather, exclude = key.float8
        cfg.float8 = dataclasses.replace(cfg.float8, enable=True, recipe=recipe,
                                         all_gather=all_gather, exclude=list(exclude))
    return cfg


def key_mesh(key: TraceKey):
    """The fake mesh ``key`` is traced on (built once per layout: ``_mesh``)."""
    return _mesh(key.dims)


@functools.cache
def _mesh(dims):
    return dims.build_mesh("cpu", fake=True)


def data_parallel_groups(mesh, key: TraceKey) -> dict[str, str]:
    """Process group name -> "dp_replicate" / "dp_shard" of the groups ``data_parallel``
    runs on: with context parallelism, ``dp_shard`` flattened with the cp dims
    (``ParallelDims.data_parallel_mesh``; ``timing.MeshLinks`` sizes it ``dp_shard x
    cp``)."""
    from ..mesh import ParallelDims

    dp = ParallelDims.data_parallel_mesh(mesh, key.dp_mode)
    names = dp.mesh_dim_names or ()
    return {dp.get_group(i).group_name: "dp_replicate" if n == "dp_replicate" else "dp_shard"
            for i, n in enumerate(names)}


def build_model(key: TraceKey):
    """``key``'s model (or pipeline stage) on ``meta``, parallelized as the trainer does;
    with its ``ModelArgs`` and compute dtype."""
    args = key.args_type(*key.args)
    if key.role == "full":
        with torch.device("meta"):
            model = Transformer(args)
    else:  # one stage of two, cut as the trainer cuts: "first" keeps the embeddings
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(args, n_layers=2 * args.n_layers))
        split_stage(model, 2, 0 if key.role == "first" else 1)
    # SDPA on fake CPU tensors would take the math path for MLA's head sizes (scores
    # materialized) where a GPU runs cuDNN's fused kernel (models/mla.py): trace that kernel
    for module in model.modules():
        if isinstance(module, MultiHeadLatentAttention):
            module.core = fused_kernel_attention
    mesh = key_mesh(key)
    dtype = DTYPES[key.param_dtype]
    return parallelize(model, mesh, key.dims, _job(key)), args, dtype


def stage_input(key: TraceKey, args, dtype: torch.dtype) -> torch.Tensor:
    """What ``key``'s model (or stage) receives, created in the caller's fake mode: token
    ids, or for the last pipeline stage the previous stage's hidden states, which arrive
    sequence-sharded under TP + SP (the one owner of that shape; eager replays use it).
    With context parallelism a rank's ids are its part of each sequence."""
    if key.role == "last":
        return torch.empty(key.batch, key.dims.sequence_part(key.seq), args.dim, dtype=dtype,
                           requires_grad=True)
    return torch.zeros(key.batch, key.seq // key.dims.cp, dtype=torch.long)


def _trace(key: TraceKey, fake_mode_cls) -> Trace:
    from ..compiler.backend import SimpleFSDPBackend

    model, args, dtype = build_model(key)
    mesh = key_mesh(key)
    passes = SimpleFSDPBackend("aot_eager", bucketing=key.bucketing,
                               reordering=key.reordering)
    graphs: list[fx.GraphModule] = []
    counts: list[int] = []
    prologue: list[fx.GraphModule] = []

    def capture(gm, example_inputs):
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition

        from .._torch_compat import aot_autograd

        def compiler(graph_module, _inputs):
            passes.run_passes(graph_module.graph)
            graph_module.recompile()
            graphs.append(graph_module)
            return make_boxed_func(graph_module.forward)

        def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
            counts.append(num_fwd_outputs)
            # The min-cut partition our backend uses, also for eager runs (the default
            # partition breaks under full AC): eager activations are under-counted.
            return min_cut_rematerialization_partition(
                joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

        before, partitions = len(graphs), len(counts)
        compiled_fn = aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                                   partition_fn=partition)(gm, example_inputs)
        if len(counts) == partitions:  # no joint graph: an inference graph, a prologue
            prologue.extend(graphs[before:])
            del graphs[before:]
        return compiled_fn

    with fake_mode_cls(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        compiled = torch.compile(model, fullgraph=True, backend=capture)
        x = stage_input(key, args, dtype)
        try:
            compiled(x)  # compiles both graphs; running them is not needed
        except Exception:  # noqa: BLE001 - e.g. full AC saving a DeviceMesh fails to *run*
            if len(graphs) != 2:  # on fake tensors; a failure before capture is real
                raise
    if len(graphs) != 2:
        raise RuntimeError(f"expected one forward and one backward graph, captured "
                           f"{len(graphs)} (a graph break?) for {key}")
    groups = {mesh[d].get_group().group_name: d for d in ("dp_replicate", "dp_shard",
                                                          "cp_ring", "cp_ulysses", "tp")}
    groups.update(data_parallel_groups(mesh, key))
    shards = {(tuple(p.to_local().shape), p.dtype) for p in model.parameters()}
    return Trace(key, graphs[0], graphs[1], counts[0], groups, shards, tuple(prologue))
