"""Compute model: seconds one FX node takes on this rank.

A node's ATen kernel is run on real tensors built from its FakeTensor metadata (timed,
memoised per shape); where that is not possible, a FLOP/byte roofline of
:class:`ComputeSpec` is the estimate. Not collective: nothing here talks to other ranks.
"""

from __future__ import annotations

import operator
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..._torch_compat import OpOverload, disable_current_modes, tree_flatten, tree_map
from ..._torch_compat.internals import C10D_FUNCTIONAL, DTENSOR_OPS
from ...hardware import gpu_spec
from .memory import METADATA_ONLY, Unmeasurable, concrete_int, op_name, value_bytes

__all__ = ["ComputeSpec", "default_compute_spec", "estimate_graph_compute",
           "estimate_node_time", "is_zero_cost", "roofline_seconds"]


@dataclass(frozen=True)
class ComputeSpec:
    """Roofline figures for the fallback estimate: dense peak FLOP/s per dtype and
    memory bandwidth in bytes/s."""

    peak_flops: dict[torch.dtype, float]
    mem_bandwidth_Bps: float
    name: str = ""

    def flops_per_s(self, dtype: torch.dtype | None) -> float:
        return self.peak_flops.get(dtype, self.peak_flops.get(torch.float32, 1e12))


def default_compute_spec(device: torch.device | str | None = None) -> ComputeSpec:
    """Datasheet figures (``simplefsdp.hardware``; an unknown GPU counts as an A100) for
    GPUs, a rough guess for CPUs."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev)
        gpu = gpu_spec(name) or gpu_spec("A100")
        return ComputeSpec({torch.bfloat16: gpu.bf16_flops, torch.float16: gpu.bf16_flops,
                            torch.float32: gpu.fp32_flops}, gpu.mem_bandwidth_Bps, name)
    # CPU: ~2 AVX2 FMA units x 8 fp32 lanes x 2 flop x ~2.5 GHz = 80 GFLOP/s per core at
    # best; half of that is what MKL/oneDNN reach on small GEMMs. ~10 GB/s per core of
    # streaming bandwidth. Only the fallback uses these; measurements come first.
    cores = max(torch.get_num_threads(), 1)
    fp32 = 40e9 * cores
    return ComputeSpec({torch.float32: fp32, torch.bfloat16: fp32 / 2,
                        torch.float16: fp32 / 4, torch.float64: fp32 / 2},
                       10e9 * cores, "cpu")


_COMM_NAMESPACES = frozenset({C10D_FUNCTIONAL, "c10d_functional", "c10d", DTENSOR_OPS})


def is_zero_cost(node: torch.fx.Node, planner: bool = False) -> bool:
    """The one "costs nothing" rule: placeholders/outputs, ``getitem`` and SymInt
    arithmetic, views, collectives and waits (their time is the communication model's)
    run no kernel of their own, nor (cost model) ops that only touch metadata
    (``METADATA_ONLY``: ``_unsafe_view``, ``detach``, ...).

    ``planner``: the planner's setting, which differs in two ways, both kept because its
    roofline's efficiencies and kernel floor were fitted to published runs this way:
    metadata-only ops are timed as kernels, and so is nothing that is not an op overload
    (higher-order ops cost nothing here; the cost model times or estimates them, and
    the planner's ``timing.node_seconds`` costs the op inside full AC's RNG-state
    wrappers itself)."""
    if node.op != "call_function":
        return True
    target = node.target
    if not isinstance(target, OpOverload):
        # operator.getitem, SymInt arithmetic (operator.mul, ...), builtins
        return planner or target is operator.getitem or getattr(
            target, "__module__", "") in ("_operator", "operator", "builtins", "math")
    if op_name(target).split("::", 1)[0] in _COMM_NAMESPACES:
        return True
    return bool(getattr(target, "is_view", False)) or (
        not planner and op_name(target) in METADATA_ONLY)


_MISSING = object()


def _node_inputs(node: torch.fx.Node) -> tuple[tuple, dict]:
    def meta_of(n: torch.fx.Node) -> Any:
        return n.meta.get("val", _MISSING)
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), meta_of)
    leaves, _ = tree_flatten((args, kwargs))
    if any(x is _MISSING for x in leaves):
        raise Unmeasurable(f"an input of {node.name} carries no meta['val']")
    return args, kwargs


def _describe(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(concrete_int(s) for s in x.shape),
                tuple(concrete_int(s) for s in x.stride()), x.dtype, x.device.type)
    if isinstance(x, torch.SymInt):
        return concrete_int(x)
    if isinstance(x, (torch.SymFloat, torch.SymBool)):
        return repr(x)
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


def _cache_key(target: Any, args: tuple, kwargs: dict) -> tuple:
    leaves, spec = tree_flatten((args, kwargs))
    return (target, str(spec), tuple(_describe(x) for x in leaves))


def _materialize(x: Any, budget: list[int]) -> Any:
    """A real tensor with the fake tensor's shape/stride/dtype/device (random floats,
    zero integers, so index tensors are always in range); SymInts become ints."""
    if isinstance(x, torch.Tensor):
        shape = [concrete_int(s) for s in x.shape]
        stride = [concrete_int(s) for s in x.stride()]
        offset = concrete_int(x.storage_offset())
        extent = offset + (1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
                           if all(n > 0 for n in shape) else 0)
        budget[0] -= extent * x.element_size()
        if budget[0] < 0:
            raise Unmeasurable("inputs larger than max_input_bytes")
        dev = x.device
        if dev.type == "meta" or (dev.type == "cuda" and not torch.cuda.is_available()):
            raise Unmeasurable(f"cannot allocate on {dev}")
        if x.dtype.is_floating_point or x.dtype.is_complex:
            try:
                base = torch.randn(extent, dtype=x.dtype, device=dev)
            except (RuntimeError, TypeError):  # e.g. float8: no randn kernel
                base = torch.zeros(extent, dtype=x.dtype, device=dev)
        else:
            base = torch.zeros(extent, dtype=x.dtype, device=dev)
        return base.as_strided(shape, stride, offset)
    if isinstance(x, torch.SymInt):
        return concrete_int(x)
    if isinstance(x, torch.SymFloat):
        raise Unmeasurable("symbolic float argument")
    return x


def _first_device(leaves: Iterable[Any]) -> torch.device | None:
    """The device of the first tensor among ``leaves``, else the first ``torch.device``
    (factory ops such as ``aten.empty`` only name theirs in a kwarg)."""
    leaves = list(leaves)
    for x in leaves:
        if isinstance(x, torch.Tensor):
            return x.device
    return next((x for x in leaves if isinstance(x, torch.device)), None)


def roofline_seconds(flops: float, nbytes: float, peak_flops: float, mem_bandwidth_Bps: float,
                     *, flop_efficiency: float = 1.0, mem_efficiency: float = 1.0,
                     overlap: bool = False, floor_s: float = 0.0) -> float:
    """The roofline, the one: ``flops`` at ``peak_flops * flop_efficiency`` and ``nbytes``
    at ``mem_bandwidth_Bps * mem_efficiency``, summed, or with ``overlap`` the larger of
    the two (a kernel streams its operands while it computes), plus ``floor_s``.

    Two callers, two settings: the cost model's fallback for a node it cannot time
    (datasheet peaks, no efficiencies, summed: a pessimistic guess that only stands in
    for a measurement) and the planner's per-op time on a device it never runs on
    (``hardware.Efficiency``, overlapped, a per-kernel floor: fitted to published runs).
    """
    compute = flops / (peak_flops * flop_efficiency)
    memory = nbytes / (mem_bandwidth_Bps * mem_efficiency)
    return (max(compute, memory) if overlap else compute + memory) + floor_s


def _datasheet_estimate(node: torch.fx.Node, args: tuple, kwargs: dict,
              spec: ComputeSpec | None) -> float:
    leaves, _ = tree_flatten((args, kwargs))
    out = node.meta.get("val")
    dev = _first_device(leaves) or _first_device(tree_flatten(out)[0])
    spec = spec or default_compute_spec(dev)
    nbytes = value_bytes(out) + sum(value_bytes(x) for x in leaves if isinstance(x, torch.Tensor))
    flops = 0
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        try:
            from torch.utils.flop_counter import flop_registry
            formula = flop_registry.get(packet)
            if formula is not None:
                flops = int(formula(*args, out_val=out, **kwargs))
        except Exception:  # noqa: BLE001 - no FLOP count is a fine answer here
            flops = 0
    dtype = next((x.dtype for x in leaves if isinstance(x, torch.Tensor)
                  and x.dtype.is_floating_point), torch.float32)
    return roofline_seconds(flops, nbytes, spec.flops_per_s(dtype), spec.mem_bandwidth_Bps)


def estimate_node_time(node: torch.fx.Node, measure: bool = True, repeats: int = 3,
                       cache: dict | None = None, spec: ComputeSpec | None = None,
                       max_input_bytes: int = 1 << 30) -> float:
    """Seconds one FX node's computation takes on this rank.

    Zero for placeholders, outputs, getitem, views and collectives/waits. Otherwise the
    node's ATen target is run on real tensors built from its inputs' ``meta["val"]``
    (median of ``repeats`` after one warm-up; CUDA events on GPU), memoised in ``cache``
    under (target, input shapes/strides/dtypes, other arguments) so repeated layers are
    timed once. When ``measure=False`` or running fails (no metadata, unbacked sizes,
    inputs over ``max_input_bytes``, a device that is not here) the roofline
    ``flops / peak_flops + bytes / mem_bandwidth`` of ``spec`` is used instead.
    Not collective.
    """
    if is_zero_cost(node):
        return 0.0
    try:
        args, kwargs = _node_inputs(node)
    except Unmeasurable:
        return 0.0 if node.meta.get("val") is None else _safe_datasheet_estimate(node, (), {}, spec)
    if not measure or not isinstance(node.target, OpOverload):
        return _safe_datasheet_estimate(node, args, kwargs, spec)
    try:
        key = _cache_key(node.target, args, kwargs)
    except Unmeasurable:
        return _safe_datasheet_estimate(node, args, kwargs, spec)
    if cache is not None and key in cache:
        return cache[key]
    try:
        with disable_current_modes(), torch.no_grad():
            budget = [max_input_bytes]
            real_args, real_kwargs = tree_map(lambda x: _materialize(x, budget),
                                              (args, kwargs))
            dev = (_first_device(tree_flatten((real_args, real_kwargs))[0])
                   or _first_device(tree_flatten(node.meta.get("val"))[0]))
            target = node.target
            # one warm-up run: lazy init, allocator, oneDNN primitive caches
            seconds = time_callable(lambda: target(*real_args, **real_kwargs), repeats, 1,
                                     dev)
    except Exception:  # noqa: BLE001 - any failure to run means: estimate instead
        seconds = _safe_datasheet_estimate(node, args, kwargs, spec)
    if cache is not None:
        cache[key] = seconds
    return seconds


def _safe_datasheet_estimate(node: torch.fx.Node, args: tuple, kwargs: dict,
                   spec: ComputeSpec | None) -> float:
    try:
        return _datasheet_estimate(node, args, kwargs, spec)
    except Unmeasurable:
        return 0.0


def estimate_graph_compute(gm: torch.fx.GraphModule | torch.fx.Graph, measure: bool = True,
                           cache: dict | None = None, **kwargs: Any) -> list[float]:
    """``estimate_node_time`` for every node of the graph, in graph order, on this rank.

    Not collective: the caller agrees on the numbers across ranks before deciding
    anything (inside a compiler pass through the store, see :mod:`simplefsdp.agreement`).
    ``cache`` is shared by all nodes (a fresh dict when None), so structurally repeated
    layers are timed once.
    """
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    cache = {} if cache is None else cache
    return [estimate_node_time(n, measure=measure, cache=cache, **kwargs) for n in graph.nodes]



def time_callable(fn: Callable[[], Any], repeats: int, warmup: int,
                   device: torch.device | None) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs; CUDA events
    (with a synchronize around each run) on a CUDA device, ``perf_counter`` otherwise."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = device is not None and device.type == "cuda"
    for _ in range(max(repeats, 1)):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
