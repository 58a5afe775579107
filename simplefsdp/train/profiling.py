"""``[profiling]``: torch.profiler traces of chosen steps, one Chrome trace per rank.

Steps ``start_step`` to ``start_step + steps - 1`` run under ``torch.profiler`` (CPU
activity, and CUDA's on a GPU): operators, the data-parallel all-gathers and
reduce-scatters (``_c10d_functional::*`` and the backend's own ``gloo:``/``nccl:``
events) and the step's other collectives. Each rank writes
``<metrics.output_dir>/profile/step-<start_step>/rank<r>.json.gz``, which Perfetto
(ui.perfetto.dev) and chrome://tracing open. With ``memory_snapshot`` (CUDA) the caching
allocator records every allocation over the same steps, written beside the trace as
``rank<r>_memory.pickle`` for pytorch.org/memory_viz. A run that stops inside the
window writes what it recorded. Rank 0 names the files in one line at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .._torch_compat.internals import dump_memory_snapshot, record_memory_history

if TYPE_CHECKING:
    from ..config.job import JobConfig


class StepProfiler:
    """Call :meth:`before` ahead of each step and :meth:`after` once it is done; both do
    nothing outside the profiled steps (or with ``profiling.enable`` off)."""

    def __init__(self, cfg: JobConfig, rank: int, world: int, device: torch.device):
        p = cfg.profiling
        self.enabled, self.first, self.last = p.enable, p.start_step, p.start_step + p.steps - 1
        self.memory = p.enable and p.memory_snapshot and device.type == "cuda"
        self.rank, self.world, self.device = rank, world, device
        self.folder = Path(cfg.metrics.output_dir) / "profile" / f"step-{p.start_step}"
        self._profile: torch.profiler.profile | None = None
        self.written: list[Path] = []

    def before(self, step: int) -> None:
        if not self.enabled or step != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory:
            record_memory_history(True)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()

    def after(self, step: int) -> None:
        if self._profile is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write (also when the run ends inside the window)."""
        if self._profile is None:
            return
        profile, self._profile = self._profile, None
        profile.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank}.json.gz"
        profile.export_chrome_trace(str(trace))
        self.written.append(trace)
        if self.memory:
            snapshot = self.folder / f"rank{self.rank}_memory.pickle"
            dump_memory_snapshot(str(snapshot))
            record_memory_history(False)
            self.written.append(snapshot)

    def summary(self) -> str | None:
        """Rank 0's line naming every rank's files (None: nothing profiled)."""
        if not self.written:
            return None
        steps = f"step {self.first}" if self.first == self.last else \
            f"steps {self.first}-{self.last}"
        names = "rank<r>.json.gz" + (" and rank<r>_memory.pickle" if self.memory else "")
        return (f"[simplefsdp] profile of {steps}: {self.folder}/{names} for ranks 0-"
                f"{self.world - 1} (traces: ui.perfetto.dev"
                f"{'; memory: pytorch.org/memory_viz' if self.memory else ''})")
