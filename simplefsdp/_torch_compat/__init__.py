"""Every private torch API simplefsdp uses, and every torch-version fallback, in one place.

simplefsdp supports torch 2.11-2.13. "checked: 2.13" means exercised by the test suite on
torch 2.13.0; "2.11 (CUDA)" means run on torch 2.11 on a GPU (``scripts/device_check.py``:
the attention kernels, grouped matmuls, fake process groups and a whole training step).
The package imports these names from here (``tests/test_architecture.py`` keeps it so);
public torch APIs stay where they are used. Heavy modules (Inductor, Dynamo, testing
helpers) are imported inside functions, so ``import simplefsdp`` does not load them.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Private names imported as they are; each: checked 2.13.
from torch._C._distributed_c10d import _register_work as register_work
from torch._C._distributed_c10d import _resolve_process_group
from torch._guards import detect_fake_mode
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from .attention import attention_with_lse, attention_with_lse_backward, cudnn_attention
from .redistribute import redistribute_strided_shards_as_2_13
from .sharding import around_sharding_propagation
from .teardown import destroy_library, release_mesh_groups
from .unbacked import all_to_all_single, check_size, check_that, data_dependent_shapes

# Installed on import, before any DTensor is redistributed: torch 2.11 neither plans nor
# runs redistributions of expert tensor parallelism's _StridedShard layouts, which torch
# 2.13 does (greedy plan, steps through Replicate); see redistribute.py.
redistribute_strided_shards_as_2_13()

__all__ = [
    "all_gather_autograd", "all_to_all_single", "all_to_all_single_autograd",
    "allgather_base", "aot_autograd", "around_sharding_propagation", "attention_with_lse",
    "attention_with_lse_backward",
    "backend_name", "c10d_functional", "check_size", "check_that", "checkpoint_wrapper",
    "compile_fx", "current_graph_task_id", "custom_graph_pass_base", "custom_partitioner_base",
    "data_dependent_shapes", "default_group", "default_store", "destroy_library",
    "detect_fake_mode", "disable_compile_caches", "compile_caches_off",
    "disable_current_modes", "dynamo_counters",
    "cudnn_attention", "cudnn_attention_runs", "dynamo_reset", "eager_backward_compile",
    "fake_store", "FakeTensor", "FakeTensorMode", "flatten_mesh", "grouped_mm",
    "grouped_mm_aligned", "missing_inductor_options", "nccl_flight_recorder", "op_schema",
    "OpOverload", "profiler_events", "raise_recompile_limits", "register_work",
    "release_mesh_groups", "replay_after_graph", "resolve_process_group", "root_mesh",
    "slice_flattened", "storage_key", "StridedShard", "symint_hint", "TorchDispatchMode",
    "tree_flatten", "tree_map",
]


# --- Fake tensors, dispatch modes, op overloads (compiler passes, cost model). ---
# The functional collectives' op namespace (what DTensor and compiled graphs call).
# checked: 2.13.
c10d_functional = torch.ops._c10d_functional


def disable_current_modes():
    """A context that leaves any active FakeTensorMode / proxy mode: compiler passes run
    inside one, and measurements and collectives must touch real tensors. checked: 2.13."""
    return _disable_current_modes()


def op_schema(target: Any) -> torch.FunctionSchema | None:
    """The schema of an ``OpOverload`` (None for other callables). checked: 2.13."""
    return getattr(target, "_schema", None)


def symint_hint(x: torch.SymInt) -> int | None:
    """The example value behind a symbolic size, without adding a guard where torch
    offers that; None when there is none (unbacked).

    Version fallback: the helper was renamed over time; checked: 2.13 has
    ``optimization_hint`` only, older releases ``hint_int`` / ``size_hint``.
    ``SymNode.hint`` / ``_hint`` are the last resort.
    """
    from torch.fx.experimental import symbolic_shapes

    for name in ("optimization_hint", "hint_int", "size_hint"):
        fn = getattr(symbolic_shapes, name, None)
        if fn is None:
            continue
        try:
            return int(fn(x))
        except Exception:  # noqa: BLE001 - try the next spelling
            continue
    hint = getattr(x.node, "hint", None)
    hint = getattr(x.node, "_hint", None) if hint is None else hint
    return None if hint is None else int(hint)


# --- Process groups and the CPU all-gather kernel (agreement.py, gloo_kernel.py). ---
# register_work(tensor, work): ``wait_tensor(tensor)`` then waits for ``work``.


def resolve_process_group(group: dist.ProcessGroup | str) -> dist.ProcessGroup:
    """The ProcessGroup a functional collective's ``group_name`` argument names.

    Version fallback: with ``torch.distributed.config.compile_on_one_rank`` (new in 2.13)
    the argument can be the ProcessGroup itself; before, it is always a name.
    checked: 2.13.
    """
    if isinstance(group, dist.ProcessGroup):
        return group
    return _resolve_process_group(group)


def default_group() -> dist.ProcessGroup:
    """The default (WORLD) process group. checked: 2.13."""
    return dist.distributed_c10d._get_default_group()


def default_store() -> dist.Store:
    """The default process group's rendezvous store. checked: 2.13."""
    return dist.distributed_c10d._get_default_store()


def nccl_flight_recorder() -> bytes:
    """NCCL's flight recorder (the collectives recorded while TORCH_NCCL_TRACE_BUFFER_SIZE
    is set), pickled. checked: 2.13."""
    return torch._C._distributed_c10d._dump_nccl_trace()


def backend_name(pg: dist.ProcessGroup, device: torch.device) -> str | None:
    """``pg``'s backend for ``device`` (e.g. "gloo"), None if none. checked: 2.13."""
    try:
        return pg._get_backend(device).name()
    except RuntimeError:  # no backend for that device type in this group
        return None


def allgather_base(pg: dist.ProcessGroup, out: torch.Tensor, inp: torch.Tensor):
    """``ProcessGroup._allgather_base``: the plain all-gather into one flat tensor (the
    path ``dist.all_gather_into_tensor`` takes); returns its Work. checked: 2.13."""
    return pg._allgather_base(out, inp)


# --- DTensor and DeviceMesh internals (data_parallel.py). ---
# StridedShard (imported above): a DP shard *within* a TP shard on the same dim.


def root_mesh(mesh: torch.distributed.device_mesh.DeviceMesh):
    """The mesh ``mesh`` was sliced from (itself if it was not sliced).

    Version fallback: ``DeviceMesh._get_root_mesh()`` (checked: 2.13); before 2.12 the
    ``_mesh_resources`` registry (2.13 still has it too).
    """
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is not None:
        return get_root()
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_root_mesh(mesh)


# --- Autograd (eager_reshard.py). ---
def current_graph_task_id() -> int:
    """-1 outside backward, else the running autograd graph task's id. checked: 2.13."""
    return torch._C._current_graph_task_id()


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage, shared by all its views: the storage's C++ address
    (not ``data_ptr``: fake and meta tensors have no data and all share pointer 0).
    checked: 2.13."""
    return t.untyped_storage()._cdata


# --- Compilers: Dynamo, AOTAutograd, Inductor (compiler/backend.py, bench/). Lazy imports. ---
def aot_autograd(**kwargs: Any):
    """Dynamo's AOTAutograd backend factory. checked: 2.13."""
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def compile_fx(gm: torch.fx.GraphModule, example_inputs, **kwargs: Any):
    """Inductor's entry point. checked: 2.13."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile

    return inductor_compile(gm, example_inputs, **kwargs)


def custom_graph_pass_base() -> type:
    """The base class of an Inductor ``post_grad_custom_post_pass``. checked: 2.13."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def custom_partitioner_base() -> type | None:
    """Inductor's base class for ``config.custom_partitioner_fn`` (the joint graph's
    partitioner, run after Inductor's joint passes), or None where this torch has none.
    checked: 2.13 (run). 2.11 / 2.12 from torch's history, not run (no wheel here): the
    ``custom_partitioner_fn`` config key and the ``CustomPartitionerFn`` class came with
    pytorch#157580 (July 2025, the 2.9 cycle), an ``ABC`` there and a ``CustomPassBase``
    in 2.13, both with the ``__call__`` / ``uuid`` we implement: present in 2.11-2.13, so
    the full-AC refusal (``activation_checkpoint.check_composition``) is for older torch."""
    try:
        from torch._inductor.custom_graph_pass import CustomPartitionerFn
    except ImportError:
        return None
    if missing_inductor_options(["custom_partitioner_fn"]):
        return None
    return CustomPartitionerFn


def missing_inductor_options(names) -> list[str]:
    """Which of ``names`` (Inductor config keys, dotted for sub-configs) this torch lacks:
    torch's own FSDP passes came in over several releases.
    checked: 2.13 has all the bench uses."""
    from torch._inductor import config

    known = config.get_config_copy()
    return [k for k in names if k not in known]


def overlap_scheduler_missing() -> str | None:
    """Why Inductor's overlap scheduler (``aten_distributed_optimizations``) cannot run
    here, or None: its roofline estimate of every compute node reads the GPU's DRAM
    bandwidth through ``triton.testing``, so a machine without triton (a CPU-only
    install) fails inside the pass. checked: 2.13 (no option avoids the call)."""
    try:
        from torch._inductor.utils import get_gpu_dram_gbps
    except ImportError:  # older torch: the scheduler does not ask
        return None
    try:
        get_gpu_dram_gbps()
    except ImportError as e:
        return f"its runtime estimates need triton ({e})"
    except Exception:  # noqa: BLE001 - triton is there; no GPU to measure is its business
        return None
    return None


def collective_timed_out(error: BaseException) -> bool:
    """Whether ``error`` is a collective outliving its process group's timeout: NCCL
    raises ``DistBackendError``; gloo a RuntimeError "Timed out waiting ...ms for recv
    operation to complete" (or "...for send"). checked: 2.13 gloo (the message)."""
    backend_error = getattr(torch.distributed, "DistBackendError", ())
    return isinstance(error, backend_error) or (
        isinstance(error, RuntimeError) and "timed out" in str(error).lower())


def compile_caches_off():
    """A context in which AOTAutograd's cache is off (Inductor's FX graph cache is one
    of ``compile_fx``'s config patches). Version fallback: a version without the option
    has no such cache. checked: 2.13 has ``enable_autograd_cache``."""
    import contextlib

    from torch._functorch import config as functorch

    if not hasattr(functorch, "enable_autograd_cache"):
        return contextlib.nullcontext()
    return functorch.patch(enable_autograd_cache=False)


def disable_compile_caches() -> None:
    """Turn off Inductor's FX graph caches (local, remote) and AOTAutograd's cache, so
    every compile is cold. Version fallback: options missing from a version are skipped.
    checked: 2.13 has all three."""
    from torch._functorch import config as functorch
    from torch._inductor import config as inductor

    for module, name in ((inductor, "fx_graph_cache"), (inductor, "fx_graph_remote_cache"),
                         (functorch, "enable_autograd_cache")):
        if hasattr(module, name):
            setattr(module, name, False)


def raise_recompile_limits(at_least: int) -> None:
    """Raise Dynamo's per-code-object recompile limits to ``at_least``.

    Version fallback: the limits were renamed (``cache_size_limit`` ->
    ``recompile_limit``); whichever spellings exist are set. checked: 2.13 has both
    spellings."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), at_least))


def dynamo_counters():
    """Dynamo's global counters (e.g. ``["stats"]["unique_graphs"]``). checked: 2.13."""
    from torch._dynamo.utils import counters

    return counters


def replay_after_graph(fn):
    """Register ``fn`` (constant arguments, no result) with Dynamo as a reorderable
    logging function: a traced call is not traced into (no guard on what it reads) but
    replayed after the graph that holds it. checked: 2.11, 2.13."""
    import torch._dynamo

    torch._dynamo.config.reorderable_logging_functions.add(fn)
    return fn


# --- Activation checkpointing, profiler, fake process groups (train/, bench/). ---
def checkpoint_wrapper(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """torch.distributed's activation-checkpoint wrapper (its prefix
    ``_checkpoint_wrapped_module`` never reaches state dicts). checked: 2.13."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper as wrap,
    )

    return wrap(module, **kwargs)


def profiler_events(prof: torch.profiler.profile) -> list:
    """The raw Kineto events of a finished profile (name, start/duration in ns, bytes of
    memory events). checked: 2.13."""
    return prof.profiler.kineto_results.events()


def fake_store() -> dist.Store:
    """A store for ``init_process_group("fake", ...)``: one process stands in for a world
    of ranks. ImportError where torch ships without its testing helpers. checked: 2.13."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def dynamo_reset() -> None:
    """Forget every compiled frame (the planner traces many models). checked: 2.13."""
    import torch._dynamo

    torch._dynamo.reset()


def dtensor_sharding_cache_clear() -> None:
    """Forget DTensor's cached sharding decisions, in Python and in its C++ dispatch
    fast path (absent in older releases: nothing to clear there). Both key by mesh
    *equality*, so a model built on a rebuilt but equal (sub-)mesh would otherwise get
    output specs that hold an earlier model's mesh object. checked: 2.13."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()


def eager_backward_compile():
    """A context in which AOTAutograd compiles the backward graph together with the
    forward instead of lazily at the first backward (the planner captures both graphs
    without running them). checked: 2.13."""
    from torch._functorch import config

    return config.patch(force_non_lazy_backward_lowering=True)


# --- Mixture of experts: grouped matmuls and the differentiable all-to-all. ---
_KERNEL_RUNS: dict[tuple, bool] = {}  # (kernel, device, dtype, ...) -> whether it ran here


def kernel_runs(key: tuple, probe: Callable[[], None]) -> bool:
    """Whether ``probe`` (a kernel's tiny forward and backward) runs here; run once per
    ``key``, in grad mode (it may first be asked under no_grad) under identity saved-tensor
    hooks (or inside a checkpointed forward, whose count of saved tensors it would skew)."""
    if key not in _KERNEL_RUNS:
        try:
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            with torch.enable_grad(), hooks:
                probe()
            _KERNEL_RUNS[key] = True
        except (RuntimeError, NotImplementedError):
            _KERNEL_RUNS[key] = False
    return _KERNEL_RUNS[key]


def grouped_mm(device: torch.device, dtype: torch.dtype):
    """``torch._grouped_mm`` where it runs for ``device``/``dtype`` (:func:`kernel_runs`),
    else None (callers loop); callers check its 16-byte strides (``grouped_mm_aligned``).
    checked: 2.13 (CPU float32), 2.11 (CUDA bf16, float32); older releases lack the op."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None

    def probe():
        x = torch.ones(4, 8, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([1, 4], device=device, dtype=torch.int32)
        fn(x, w, offs=offs).backward(torch.ones(4, 8, device=device, dtype=dtype))
    return fn if kernel_runs(("grouped_mm", torch.device(device).type, dtype), probe) else None


def grouped_mm_aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's strides are multiples of 16 bytes, as ``_grouped_mm``
    requires (a unit stride is exempt)."""
    return all(s == 1 or (s * t.element_size()) % 16 == 0
               for t in tensors for s in t.stride())


def all_to_all_single_autograd(inp: torch.Tensor, output_split_sizes: list[int],
                               input_split_sizes: list[int], group: dist.ProcessGroup,
                               wait: bool = False) -> torch.Tensor:
    """``all_to_all_single`` with uneven splits whose backward is the reverse exchange;
    ``wait``: waited for now, not at its first read. checked: 2.13
    (``_functional_collectives.all_to_all_single_autograd`` on gloo, ``wait_tensor``)."""
    from torch.distributed import _functional_collectives as funcol

    out = funcol.all_to_all_single_autograd(inp, output_split_sizes, input_split_sizes, group)
    return funcol.wait_tensor(out) if wait else out


# --- Context parallelism (parallel/context.py). ---
def flatten_mesh(mesh: torch.distributed.device_mesh.DeviceMesh, name: str):
    """``mesh``'s dims as one dim called ``name``, registered on the root mesh (slice it
    from there with other dims). checked: 2.13 (``DeviceMesh._flatten``)."""
    return mesh._flatten(name)


def slice_flattened(root: torch.distributed.device_mesh.DeviceMesh, names: tuple[str, ...]):
    """``root[names]`` where a name is a dim made by :func:`flatten_mesh` (checked: 2.13,
    which warns that slicing flattened dims from the root is to be deprecated: the
    warning is silenced here, where the one such slice lives)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return root[names]


def all_gather_autograd(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather along dim 0 whose backward reduce-scatters (sums) the gradient.
    checked: 2.13 (``_functional_collectives.all_gather_single_autograd``, on gloo);
    version fallback: ``all_gather_tensor_autograd`` (its older name, deprecated in 2.13)."""
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None)
    return (gather or funcol.all_gather_tensor_autograd)(x, 0, group)


def cudnn_attention_runs(device: torch.device, dtype: torch.dtype, qk_dim: int,
                         v_dim: int) -> bool:
    """Whether :func:`cudnn_attention` runs on ``device`` for these head sizes and ``dtype``
    (CUDA; :func:`kernel_runs`; while compiling only an earlier eager probe counts)."""
    device = torch.device(device)
    key = ("cudnn_attention", device.type, device.index, dtype, qk_dim, v_dim)
    if device.type != "cuda" or torch.compiler.is_compiling():
        return _KERNEL_RUNS.get(key, False)

    def probe():
        q, k, v = (torch.ones(1, 1, 16, d, device=device, dtype=dtype, requires_grad=True)
                   for d in (qk_dim, qk_dim, v_dim))
        cudnn_attention(q, k, v, True).sum().backward()
    return kernel_runs(key, probe)
