"""Per-step measurements: collectives from the profiler, memory held and transient.

Memory of one variant = bytes it *holds* between steps on this rank (local parameter
shards, buffers, optimizer state; computed from the tensors, so it shows what sharding
saves) + the *transient* peak during one step above what was allocated when it began:

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus
  ``memory_allocated`` at the start of the step (allocator stats; exact).
* CPU: the running sum of the profiler's CPU allocation events (``profile_memory``) over
  the step, its maximum. It counts tensors torch's allocator hands out during the step
  and excludes torch's fixed baseline (interpreter, libraries, other variants' state);
  allocations that bypass torch's allocator (gloo's internal buffers) are not seen, so
  it is an approximation. The profiler sometimes misses a free (done off the profiled
  thread) but never invents an allocation: one step now and then reads 5-15% high, so
  the smallest of a few profiled steps is the figure (``PROFILED_STEPS``). On the debug
  model, eager, full AC, that minimum equals a dispatcher-level count of the step's
  storages (5.18 MiB) while single steps read 5.18-6.09 MiB.

Process RSS is not used: variants run interleaved in one process, so freed pages of one
variant are reused by the next and RSS high-water marks cannot be attributed.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from .._torch_compat import profiler_events
from .._torch_compat.float8 import inner_tensors
from .._torch_compat.internals import C10D_FUNCTIONAL
from ..compiler.collectives import collective_kind
from ..mesh import local_shard

# Kineto (the profiler's C++ side) prints "USDT: ... profiler_start" and "profiler_stop"
# on stderr around every profiled step. Its log level is read from KINETO_LOG_LEVEL when
# the first profile starts; its levels run VERBOSE 0, INFO 1, WARNING 2, STAGE 3, ERROR 4,
# USDT 5, so only 6 leaves the USDT lines out (and kineto's own errors with them; the
# measurements check what they read). A level the user set is kept.
KINETO_QUIET_LEVEL = "6"


def quiet_profiler_log() -> None:
    """Keep kineto's per-step start/stop lines off the benchmark's console (this process
    only, before its first profile), unless ``KINETO_LOG_LEVEL`` is set already."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)


PROFILED_STEPS = 3  # CPU: the transient peak is the smallest of this many profiled steps
CPU_MEMORY_MEASURE = ("held state (params+buffers+optimizer, local shards) + peak of torch "
                      f"CPU allocations during a step (profiler memory events; the least of "
                      f"{PROFILED_STEPS} profiled steps); excludes the process baseline; "
                      "approximate")
CUDA_MEMORY_MEASURE = ("held state (params+buffers+optimizer, local shards) + CUDA allocator "
                       "peak above the step's starting allocation (max_memory_allocated)")


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, buffers, gradients and optimizer state (each
    storage once). Taken between steps, where gradients are None (zero_grad sets them
    so): their memory shows in the step's transient peak instead."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None or not isinstance(t, torch.Tensor):
            return
        t = local_shard(t)
        if t.device.type == "meta":
            return
        inner = inner_tensors(t)
        if inner is not None:  # e.g. torchao's float8 weight: count the tensors it holds
            for piece in inner:
                add(piece)
            return
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        total += storage.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return total


def _collective_kind(name: str) -> str | None:
    """``c10d::_allgather_base_`` -> ``all_gather``; None for non-collectives."""
    if not name.startswith("c10d::"):
        return None
    op = name[len("c10d::"):].lower().replace("_", "")
    if "barrier" in op or "wait" in op or "monitored" in op:
        return None
    kind = collective_kind(name)
    if kind is not None:
        return kind
    for key, other in (("broadcast", "broadcast"), ("alltoall", "all_to_all"),
                       ("send", "send"), ("recv", "recv")):
        if key in op:
            return other
    return op


def _blocks(name: str) -> bool:
    """Whether the caller is blocked in communication while this op runs: a c10d
    collective (eager or issued by a functional one) or a functional collective / its
    ``wait_tensor``."""
    return name.startswith(("c10d::", f"{C10D_FUNCTIONAL}::", "c10d_functional::")) \
        or name.endswith("::wait_tensor")


def _is_all_to_all(name: str) -> bool:
    """An all-to-all op: ``c10d::alltoall_base_`` (eager, and under the functional ones),
    ``_c10d_functional::all_to_all_single`` and its autograd form."""
    return "::" in name and "alltoall" in name.replace("_", "").lower()


def _all_to_all_spans(events: list[tuple[str, int, int]]) -> list[tuple[int, int]]:
    """Spans the host spent in all-to-alls: each all-to-all op, and the first
    ``wait_tensor`` after one (before any other collective starts), which completes it:
    the MoE dispatch reads the exchanged tokens at once, so that wait is exposed."""
    spans, pending = [], False
    for name, start, end in sorted(events, key=lambda e: e[1]):
        if _is_all_to_all(name):
            spans.append((start, end))
            pending = True
        elif pending and name.endswith("::wait_tensor"):
            spans.append((start, end))
            pending = False
        elif _collective_kind(name) is not None:
            pending = False
    return spans


def _union_s(spans: list[tuple[int, int]]) -> float:
    """Seconds covered by the union of ``(start_ns, end_ns)`` spans: nested and
    overlapping events (a ``c10d::`` op inside its functional collective) count once."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total / 1e9


def profiled_step(step: Callable[[], float], device: torch.device
                  ) -> tuple[float, dict[str, int], int, float, float]:
    """Run ``step`` under the profiler: (its loss, collectives by kind, transient bytes,
    seconds blocked in communication, of which in all-to-alls: the union of
    :func:`_all_to_all_spans`; the MoE dispatch runs eagerly and waits for each exchange
    before computing, so none of it overlaps compute).

    Collectives are the ``c10d::`` dispatcher ops (one per collective the process group
    runs, eager or compiled, FSDP2 included); waits and barriers are not counted.
    Blocked time is the union of the spans of every op ``_blocks`` names. An eager
    ``Work.wait()`` is no profiler event, so for eager c10d collectives (FSDP2, DDP) only
    the time inside the op counts: a lower bound there; exact for functional
    collectives (simplefsdp) on CPU, whose ``wait_tensor`` is an op. Host time only: on
    CUDA the ops return once queued, so there it is launch overhead, not GPU waiting.
    """
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start_alloc = torch.cuda.memory_allocated(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=not cuda) as prof:
        loss = step()
    counts: Counter[str] = Counter()
    memory: list[tuple[int, int]] = []
    blocked: list[tuple[int, int]] = []
    comm: list[tuple[str, int, int]] = []
    for event in profiler_events(prof):
        name = event.name()
        if name == "[memory]":
            if event.device_type() == torch.autograd.DeviceType.CPU:
                memory.append((event.start_ns(), event.nbytes()))
            continue
        if _blocks(name):
            blocked.append((event.start_ns(), event.start_ns() + event.duration_ns()))
            comm.append((name, *blocked[-1]))
        kind = _collective_kind(name)
        if kind is not None:
            counts[kind] += 1
    if cuda:
        transient = torch.cuda.max_memory_allocated(device) - start_alloc
    else:
        running = transient = 0
        for _, nbytes in sorted(memory):
            running += nbytes
            transient = max(transient, running)
    return (loss, dict(sorted(counts.items())), max(0, transient), _union_s(blocked),
            _union_s(_all_to_all_spans(comm)))


def least_transient(step: Callable[[], float], device: torch.device,
                    steps: int = PROFILED_STEPS) -> int:
    """The transient peak of ``step`` (see ``profiled_step``): on CPU the smallest over
    ``steps`` profiled runs of it, whose occasional missed frees only ever add bytes;
    on CUDA the allocator's figure of one run, which is exact."""
    runs = 1 if device.type == "cuda" else steps
    return min(profiled_step(step, device)[2] for _ in range(runs))
