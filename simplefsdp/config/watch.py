"""The job's sections that watch a run rather than shape it: ``[validation]`` (the
held-out loss, ``train/validation.py``) and ``[profiling]`` (``train/profiling.py``),
with their range checks (``JobConfig.validate`` calls them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, require


@dataclass
class ValidationConfig:
    # Evaluate the loss on the held-out tail of the corpus (each source's last 5%, never
    # trained on): gradients off, the model in eval mode, training itself untouched.
    enable: bool = False
    every: int = 100  # steps between evaluations (each also writes a metrics row)
    # Global batches (training.batch_size per data-parallel rank, training.seq_len) per
    # evaluation, always the same held-out windows; -1: every whole batch the split holds.
    steps: int = -1


@dataclass
class ProfilingConfig:
    # torch.profiler traces, one Chrome trace per rank:
    # <metrics.output_dir>/profile/step-<start_step>/rank<r>.json.gz (ui.perfetto.dev).
    enable: bool = False
    start_step: int = 3  # the first profiled step (later than the first: compile, warm-up)
    steps: int = 1  # profiled steps from start_step on
    # CUDA: also the caching allocator's history over those steps, rank<r>_memory.pickle
    # beside the trace (pytorch.org/memory_viz).
    memory_snapshot: bool = False


def check_profiling(p: ProfilingConfig, steps: int, device: str) -> None:
    """``[profiling]``: steps inside the run (``training.steps``); the memory snapshot is
    CUDA's (``job.device``)."""
    require(p.start_step >= 1, "profiling.start_step", p.start_step, ">= 1")
    require(p.steps >= 1, "profiling.steps", p.steps, ">= 1")
    if not p.enable:
        return
    if p.start_step + p.steps - 1 > steps:
        raise ConfigError(f"profiling.start_step = {p.start_step} with profiling.steps = "
                          f"{p.steps} reaches past the run's training.steps = {steps}; "
                          f"profile steps 1 to {steps}")
    if p.memory_snapshot and device != "cuda":
        raise ConfigError("profiling.memory_snapshot = true records the CUDA allocator, but "
                          f"job.device = {device!r}: run on cuda or turn it off")


def check_validation(v: ValidationConfig, streaming: bool) -> None:
    """``[validation]``: its ranges; a held-out split to evaluate (not with
    ``data.streaming``). Whether the split holds enough windows is known once the corpus
    is read (start-up)."""
    require(v.every >= 1, "validation.every", v.every, ">= 1")
    require(v.steps >= 1 or v.steps == -1, "validation.steps", v.steps,
            ">= 1, or -1 for the whole held-out split")
    if v.enable and streaming:
        raise ConfigError("validation.enable = true needs the held-out split of the token "
                          "caches, but data.streaming = true has none: set data.streaming = "
                          "false or validation.enable = false")
