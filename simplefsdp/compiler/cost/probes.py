"""Timing probes the calibration runs: the collectives themselves, how much of a
collective concurrent compute hides, how much slower compute runs with every rank
computing at once, and what a bucket's copy-in/copy-out costs per byte.

Each is collective on its group (except ``measure_copy``) and runs in eager code, when
the backend is built; ``comm.calibrate`` folds the results into a ``CommModel``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..._torch_compat import c10d_functional, disable_current_modes
from ...agreement import agree_across_ranks, group_device
from ..collectives import COLLECTIVE_KINDS, collective_kind
from .compute import time_callable


def _resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def _model_mix(group: dist.ProcessGroup, dev: torch.device, seconds: float,
               dtype: torch.dtype = torch.float32) -> Callable[[], None]:
    """Computation of about ``seconds`` mixed as a model's is: 3/4 of the time 256x256
    matmuls (compute-bound), 1/4 elementwise passes over 16 MiB (memory-bound, where
    ranks, and a rank's compute and its collectives, contend most). The counts are
    agreed across ``group``: every rank runs the same work. Collective."""
    a = torch.randn(256, 256, dtype=dtype, device=dev)
    big = torch.ones(16 * 2 ** 20 // a.element_size(), dtype=dtype, device=dev)
    t_mm = time_callable(lambda: a @ a, 5, 2, dev)
    t_pass = time_callable(lambda: big.mul_(1.0), 5, 2, dev)
    counts = agree_across_ranks([max(1.0, round(seconds * share / max(t, 1e-9)))
                                 for t, share in ((t_mm, 0.75), (t_pass, 0.25))], group)
    mms, passes = (int(c) for c in counts)

    def compute() -> None:
        for _ in range(mms):
            a @ a
        for _ in range(passes):
            big.mul_(1.0)
    return compute


def measure_hidden_fraction(group: dist.ProcessGroup | None = None,
                    device: torch.device | str | None = None, nbytes: int = 4 * 2 ** 20,
                    repeats: int = 5, dtype: torch.dtype = torch.float32,
                    rounds: int = 5) -> float:
    """The fraction of an all-gather's time that computation running meanwhile hides, on
    this rank: ``(t_compute + t_comm - t_both) / min(t_compute, t_comm)`` in [0, 1], the
    least of ``rounds`` rounds. Not their median: a round reads high whenever its
    separately timed all-gather or compute happened to run slow (both add to the
    numerator), and a calibration that stored such a figure promised more hiding than
    its training steps then got (the auto-wrapping estimate came out 2-3x under the
    measured exposed time; docs/performance.md); what every round achieved is what a
    step can count on.

    ``t_comm``: one all-gather of ``nbytes`` (full size); ``t_compute``: a model's mix of
    work (``_model_mix``) sized to take about as long; ``t_both``: the all-gather
    started, the work run, then its wait. (With matmuls alone, 2 gloo ranks on 2 cores
    read 0.0-0.55 while bench_medium's reordered steps hid nothing: blocked time
    exceeded the collectives' isolated time.)
    Prefetching (our reordering) only pays off as far as this fraction allows, so the
    auto-wrapping greedy scales its compute windows by it. Collective on ``group``.
    """
    group = _resolve_group(group)
    dev = group_device(group, device)
    ws = dist.get_world_size(group)
    c10d = c10d_functional
    with disable_current_modes():
        shard = torch.ones(max(nbytes // torch.empty((), dtype=dtype).element_size() // ws, 1),
                           dtype=dtype, device=dev)

        def comm() -> None:
            c10d.wait_tensor(c10d.all_gather_into_tensor(shard, ws, group.group_name))

        t_comm = time_callable(comm, repeats, 2, dev)
        compute = _model_mix(group, dev, t_comm, dtype)

        def both() -> None:
            work = c10d.all_gather_into_tensor(shard, ws, group.group_name)
            compute()
            c10d.wait_tensor(work)

        hidden = []
        for _ in range(max(rounds, 1)):  # a fraction per round, all timed in the round
            dist.barrier(group)
            t_comm = time_callable(comm, repeats, 1, dev)
            t_compute = time_callable(compute, repeats, 1, dev)
            dist.barrier(group)
            t_both = time_callable(both, repeats, 1, dev)
            hidden.append((t_compute + t_comm - t_both) / max(min(t_compute, t_comm), 1e-12))
    return min(max(min(hidden), 0.0), 1.0)


def measure_compute_slowdown(group: dist.ProcessGroup | None = None,
                             device: torch.device | str | None = None, repeats: int = 9,
                             seconds: float = 0.05) -> float:
    """How much slower a fixed amount of computation runs when every rank of ``group``
    runs it at once than when the group's first rank runs it alone (the others wait in
    a barrier): ``max over ranks of t_all / t_alone``, >= 1, identical on every rank.

    This is the difference between the benchmark's compute-only step (one rank on an
    otherwise idle host) and the compute inside a data-parallel step (every rank at
    once, sharing the host's cores, caches and memory bandwidth). The work is
    ``_model_mix`` (on 2 gloo ranks of a 2-core host a 128x128 matmul alone read
    1.00-1.08, a memory-bound pass alone 1.35-2.1, the compiled debug and bench_medium
    steps 1.03-1.14, the mix 1.03-1.33 from one calibration to the next). One CUDA
    device per rank shares nothing: 1.0 there, nothing is timed. Rounds alternate alone /
    together so load from elsewhere drifts into both; medians of ``repeats``. Collective.
    """
    group = _resolve_group(group)
    dev = group_device(group, device)
    if dev.type == "cuda" or dist.get_world_size(group) == 1:
        return 1.0
    first = dist.get_rank(group) == 0
    with disable_current_modes():
        compute = _model_mix(group, dev, seconds)
        alone, together = [], []
        for _ in range(max(repeats, 1)):
            dist.barrier(group)
            if first:
                alone.append(time_callable(compute, 1, 0, dev))
            dist.barrier(group)
            together.append(time_callable(compute, 1, 0, dev))
        dist.barrier(group)
    t_alone = agree_across_ranks([statistics.median(alone) if first else 0.0], group)[0]
    t_all = agree_across_ranks([statistics.median(together)], group)[0]
    return max(1.0, t_all / max(t_alone, 1e-12))


def measure_copy(device: torch.device | str | None = None, nbytes: int = 16 * 2 ** 20,
                 repeats: int = 5, dtype: torch.dtype = torch.float32, rounds: int = 3,
                 group: dist.ProcessGroup | None = None) -> float:
    """Seconds per byte a bucket's copy-in/copy-out costs on this rank: ``torch.cat`` of
    eight pieces into one buffer of ``nbytes`` (what bucketing does), the median of
    ``repeats`` in each of ``rounds`` rounds, the least round kept (load from elsewhere
    only adds time: one calibration read 8.1e-10 s/B where 2 ranks copying 16 MiB at
    once read 1.6-1.8e-10 in every later round). With ``group``, each round starts on
    every rank at once, as the step's copies do (they share memory bandwidth)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    with disable_current_modes():
        numel = max(nbytes // torch.empty((), dtype=dtype).element_size() // 8, 1)
        pieces = [torch.ones(numel, dtype=dtype, device=dev) for _ in range(8)]
        best = float("inf")
        for _ in range(max(rounds, 1)):
            if group is not None:
                dist.barrier(group)
            best = min(best, time_callable(lambda: torch.cat(pieces), repeats, 2, dev))
    return best / (8 * numel * pieces[0].element_size())


def _normalize_kind(kind: str) -> str:
    normal = collective_kind(kind)
    if normal is None:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of "
                         f"{COLLECTIVE_KINDS}")
    return normal


def _collective_fn(kind: str, nbytes: int, group: dist.ProcessGroup, device: torch.device,
                   dtype: torch.dtype) -> Callable[[], None]:
    """A closure that runs one synchronous functional collective (op + ``wait_tensor``)."""
    ws = dist.get_world_size(group)
    name = group.group_name
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = max(nbytes // itemsize // ws, 1) * ws  # full numel, divisible by world size
    c10d = c10d_functional
    if kind == "all_gather":
        x = torch.ones(numel // ws, dtype=dtype, device=device)
        return lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(x, ws, name))
    x = torch.ones(numel, dtype=dtype, device=device)
    if kind == "reduce_scatter":
        return lambda: c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", ws, name))
    return lambda: c10d.wait_tensor(c10d.all_reduce(x, "sum", name))


def measure_collectives(cases: Sequence[tuple[str, int]],
                        group: dist.ProcessGroup | None = None,
                        device: torch.device | str | None = None,
                        dtype: torch.dtype = torch.float32, repeats: int = 5,
                        warmup: int = 2) -> list[float]:
    """Median seconds, on this rank, of one synchronous collective per ``(kind, nbytes)``
    case (the medians of :func:`measure_collective_samples`)."""
    return [statistics.median(t) for t in measure_collective_samples(
        cases, group, device, dtype, repeats, warmup)]


def measure_collective_samples(cases: Sequence[tuple[str, int]],
                               group: dist.ProcessGroup | None = None,
                               device: torch.device | str | None = None,
                               dtype: torch.dtype = torch.float32, repeats: int = 5,
                               warmup: int = 2) -> list[list[float]]:
    """Seconds, on this rank, of each of ``repeats`` synchronous collectives per
    ``(kind, nbytes)`` case; ``nbytes`` is the full, unsharded size for all-gather and
    reduce-scatter.

    Times the functional collectives (``c10d_functional`` + ``wait_tensor``):
    that is what DTensor's redistribute runs in eager mode and what the compiled graphs
    hold, and it has a reduce-scatter on gloo (which lowers it to an all-reduce there).
    Whatever kernel is registered for those ops at the time is what gets timed (e.g. the
    gloo all-gather of ``simplefsdp.gloo_kernel`` once installed).
    Exactly one collective is in flight at a time (several concurrent functional
    all-gathers crash gloo). The cases are interleaved round-robin, ``warmup`` rounds
    then ``repeats`` timed rounds, so a burst of load from elsewhere on the host spreads
    over all cases instead of skewing one. Collective: every rank must pass the same cases.
    """
    group = _resolve_group(group)
    dev = group_device(group, device)
    with disable_current_modes():
        fns = [_collective_fn(_normalize_kind(k), int(n), group, dev, dtype) for k, n in cases]
        for _ in range(warmup):
            for fn in fns:
                fn()
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(max(repeats, 1)):
            for fn, times in zip(fns, samples, strict=True):
                times.append(time_callable(fn, 1, 0, dev))
    return samples
