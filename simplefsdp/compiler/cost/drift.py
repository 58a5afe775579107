"""Is a cached calibration still true of this machine? A cheap probe and its verdict.

A calibration is cached per group layout (``comm.cache_path``) and reused by every later
run. One taken while another job loaded the host stores a ``compute_slowdown`` of ~2
where the idle host reads ~1, and every later run then mis-estimates its steps (issue
31: 48 ms estimated against 9.4 ms measured). So before a cached calibration is used,
:func:`read_probe` re-reads two figures in well under a second and :func:`disagreements`
compares them with what the cache stored; beyond ``MARGIN`` the caller recalibrates.

* ``compute_slowdown``: ``probes.measure_compute_slowdown`` with a shorter workload
  (the figure that was poisoned);
* ``matmul_s``: the fastest of a few 256x256 matmuls on this rank, the slowest rank's
  (the least time is the machine's speed: load from elsewhere only adds time); it
  tells a cache written with another thread count or on other hardware.
* ``collective_s``: the median time of a small all-reduce plus a medium all-gather,
  the slowest rank's. Neither figure above sees load from elsewhere (a ratio of two
  loaded timings, a fastest run), but a collective's median does: both ranks must be
  scheduled for it to finish. The reading taken right after a calibration is stored
  with it, so it records the load the calibration was taken under; a later reading
  faster by more than ``LOAD_MARGIN`` means the cached collective figures (the ones
  the auto-wrapping estimate rests on) were timed on a busier host, and a slower one
  that this host is busier now: either way the caller recalibrates.
* ``busy_s``: the median time of a fixed amount of matmuls (``PROBE_BUSY_S`` worth at
  ``matmul_s``'s pace) run by every rank at once, the slowest rank's. Long enough to
  span the scheduler's time slices, so processes from elsewhere take their share of
  the cores out of it; ``collective_s`` alone can miss that load, since the ranks
  sleep inside a collective and get the cores first when they wake. Same margin.

Collective on the group (every rank reads; the figures are agreed across ranks before
the verdict, so every rank takes the same decision). Eager code only, where calibration
itself runs (when the backend is built), never inside a compiler pass.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..._torch_compat import disable_current_modes
from ...agreement import agree_across_ranks
from .compute import time_callable
from .probes import measure_collective_samples, measure_compute_slowdown

__all__ = ["LOAD_FIGURES", "LOAD_MARGIN", "MARGIN", "disagreements", "read_probe"]

# Relative disagreement beyond which a cached compute figure is refused: wide enough for
# the spread of idle calibrations on a small shared host (docs/performance.md), narrow
# enough to refuse one taken under load; it is also the accuracy asked of the estimate.
MARGIN = 0.30
PROBE_MATMUL = 256
PROBE_SLOWDOWN_S = 0.02  # the calibration uses 0.05 s x 9 repeats; the probe 0.02 s x 5
PROBE_BUSY_S = 0.02  # idle-host seconds of the fixed work ``busy_s`` times
# Tighter than MARGIN: the collective figures feed the estimate directly, and the
# estimate must land within MARGIN of the measured step, noise of its own included.
LOAD_MARGIN = 0.20
# The figures that see load from elsewhere (the others tell the hardware and thread count)
LOAD_FIGURES = ("collective_s", "busy_s")
# (kind, full bytes): one latency-bound and one bandwidth-bound collective
PROBE_COLLECTIVES = (("all_reduce", 64 * 2 ** 10), ("all_gather", 2 * 2 ** 20))
PROBE_REPEATS = 9  # runs of each collective and of the fixed work: medians of 9 are steadier


def read_probe(group: dist.ProcessGroup, device: torch.device) -> dict[str, float]:
    """The probe's reading on ``group``, identical on every rank: ``compute_slowdown``,
    ``matmul_s``, ``busy_s``, ``collective_s`` and ``probe_s`` (how long the probe took,
    for the CLI). Collective."""
    start = time.perf_counter()
    slowdown = measure_compute_slowdown(group, device, repeats=5, seconds=PROBE_SLOWDOWN_S)
    with disable_current_modes():
        a = torch.randn(PROBE_MATMUL, PROBE_MATMUL, device=device)
        a @ a  # warm-up: lazy init, oneDNN primitive cache
        fastest = min(time_callable(lambda: a @ a, 1, 0, device) for _ in range(9))
        matmul_s = agree_across_ranks([fastest], group, op="max")[0]
        busy_s = _busy_seconds(group, device, lambda: a @ a, matmul_s)
    return {"compute_slowdown": slowdown, "matmul_s": matmul_s, "busy_s": busy_s,
            "collective_s": _collective_seconds(group, device),
            "probe_s": time.perf_counter() - start}


def _busy_seconds(group: dist.ProcessGroup, device: torch.device, matmul, matmul_s: float
                  ) -> float:
    """The median time of ``PROBE_BUSY_S / matmul_s`` runs of ``matmul`` (the same count
    on every rank: ``matmul_s`` is agreed), every rank at once, ``PROBE_REPEATS`` times;
    the slowest rank's. Collective."""
    count = max(1, round(PROBE_BUSY_S / max(matmul_s, 1e-9)))

    def work() -> None:
        for _ in range(count):
            matmul()
    times = []
    for _ in range(PROBE_REPEATS):
        dist.barrier(group)
        times.append(time_callable(work, 1, 0, device))
    return agree_across_ranks([statistics.median(times)], group, op="max")[0]


def _collective_seconds(group: dist.ProcessGroup, device: torch.device) -> float:
    """The summed medians of ``PROBE_COLLECTIVES`` (``PROBE_REPEATS`` runs each,
    interleaved), the slowest rank's. Collective."""
    samples = measure_collective_samples(PROBE_COLLECTIVES, group, device,
                                         repeats=PROBE_REPEATS, warmup=1)
    mine = sum(statistics.median(times) for times in samples)
    return agree_across_ranks([mine], group, op="max")[0]


def disagreements(cached: dict[str, float | None], reading: dict[str, float],
                  margin: float = MARGIN, load_margin: float = LOAD_MARGIN) -> list[str]:
    """Each figure of ``cached`` (``compute_slowdown``, ``matmul_s``, ``collective_s``,
    ``busy_s``; None: not stored) off ``reading`` by more than its margin either way
    (``margin``; ``load_margin`` for the two that see load), as a sentence; [] when the
    cache holds. Pure arithmetic on agreed figures: the same verdict on every rank."""
    out = []
    for name in ("compute_slowdown", "matmul_s", "collective_s", "busy_s"):
        was, now = cached.get(name), reading.get(name)
        if was is None or now is None:
            continue
        margin_here = load_margin if name in LOAD_FIGURES else margin
        ratio = max(was, 1e-12) / max(now, 1e-12)
        if ratio > 1 + margin_here or ratio < 1 / (1 + margin_here):
            out.append(f"{name} cached {was:.4g}, probe reads {now:.4g} "
                       f"({ratio:.2f}x, margin {margin_here:.0%})")
    return out
