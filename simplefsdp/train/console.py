"""What the trainer tells a person on the console, kept out of the loop's code.

* the note before the first step compiles, and the one line after it on what our compile
  backend did (``CompileReports`` collects the backend's per-graph reports);
* the run's first line (``start_line``): size, layout, steps, the peak behind the MFU;
* the end-of-run lines (``done_line``): the loss as ``metrics.csv`` shows it, the last
  step's own loss, where every output went; a signalled run's error (``preempted``):
  where it saved and how to continue.

Only wording and log plumbing live here; the loop (``trainer.py``) decides when each is
printed, so a change of message never touches the training code.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .guard import Preempted

if TYPE_CHECKING:
    from ..config.job import JobConfig
    from .run import Setup, TrainResult


# ---------------------------------------------------------------------------------------
# The start of a run.
# ---------------------------------------------------------------------------------------
def start_line(s: Setup, world: int, tokens_per_step: int) -> str:
    """What the run is: its size, layout, steps and the peak its MFU is measured against."""
    p, cfg = s.cfg.parallel, s.cfg
    cp = "".join(f" {k}={getattr(p, k)}" for k in ("cp_ring", "cp_ulysses")
                 if getattr(p, k) > 1)  # context parallelism, when used
    return (f"[simplefsdp] {s.n_params / 1e6:.2f}M params, world {world}: pp={p.pp} "
            f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard}{cp} tp={p.tp} "
            f"{f'ep={p.ep} ' if p.ep > 1 else ''}"
            f"({p.dp_mode}), ac={cfg.activation_checkpoint.mode}, "
            f"compile={cfg.compile.enable}, {tokens_per_step} tokens/step, "
            f"steps {s.start_step}->{cfg.training.steps}; peak "
            f"{s.metrics.peak / 1e9:.1f} GFLOP/s ({s.metrics.peak_source})")


# ---------------------------------------------------------------------------------------
# The first step's compile.
# ---------------------------------------------------------------------------------------
def compile_start_note(cfg: JobConfig, step: int) -> str:
    """The line printed before ``step`` (the run's first) compiles the model."""
    return (f"[simplefsdp] step {step} compiles the model (torch.compile, "
            f"{cfg.compile.backend}, bucketing {cfg.compile.bucketing}): expect it to "
            f"take a while (a minute or more on CPU); later steps reuse the compiled "
            f"graphs")


class CompileReports(logging.Handler):
    """The reports our compile backend logs for each graph it compiles (one object per
    graph, at INFO on the ``simplefsdp.compiler`` logger; see ``compiler/backend.py``),
    collected while the first step compiles. Where that logger is not already shown at
    INFO, the records go to this handler alone: nobody sees them twice."""

    LOGGER = "simplefsdp.compiler"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reports: list[Any] = []
        self._saved: tuple[int, bool] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        for arg in args:
            if hasattr(arg, "graph") and hasattr(arg, "buckets"):
                self.reports.append(arg)

    def __enter__(self) -> CompileReports:
        logger = logging.getLogger(self.LOGGER)
        self._saved = (logger.level, logger.propagate)
        if not logger.isEnabledFor(logging.INFO):
            logger.setLevel(logging.INFO)
            logger.propagate = False
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._saved[0])
        logger.propagate = self._saved[1]


def compile_summary(reports: list, cfg: JobConfig, seconds: float, step: int) -> str:
    """One line on what the first step's compile did: per graph, its collectives and
    buckets; for planned bucketing (auto, greedy) the predicted exposed communication and
    whether the plan came from the plan cache."""
    head = f"[simplefsdp] step {step} compiled and ran in {seconds:.1f} s"
    planned = cfg.compile.bucketing in ("auto", "greedy")
    if not reports:
        warm = "; its plans came from the plan cache" if planned else ""
        return (f"{head}; our passes did not run: Inductor's cache held these graphs (a "
                f"warm compile{warm})")
    parts = []
    for r in reports:
        before = sum(getattr(r, "collectives_before", {}).values())
        n = len(r.buckets)
        part = f"{r.graph} {before} collectives -> {n} bucket{'' if n == 1 else 's'}"
        exposed = getattr(r, "estimated_exposed_s", None)
        if exposed is not None:
            part += f", predicted exposed communication {exposed * 1e3:.2f} ms"
        if planned:
            cached = any("plan cache" in note for note in getattr(r, "notes", ()))
            part += (", plan from the plan cache (hit)" if cached else
                     ", plan decided now and cached for the next run (miss)")
        parts.append(part)
    return (f"{head} (bucketing {cfg.compile.bucketing}): " + "; ".join(parts) +
            " (details: the simplefsdp.compiler logger at INFO)")


# ---------------------------------------------------------------------------------------
# The end of a run.
# ---------------------------------------------------------------------------------------
def done_line(start_step: int, steps: int, result: TrainResult, outputs: list) -> str:
    """The end-of-run lines: the loss as ``metrics.csv``'s last row and the progress bar
    show it (the mean over the last logging window), the last step's own loss, where
    every output went."""
    rows = result.metrics.get("rows") or []
    last = rows[-1] if rows and int(rows[-1]["step"]) == steps else None
    tps = f"{last['tokens_per_s']:.0f} tokens/s" if last else "no metrics row"
    if last is not None:
        first = int(rows[-2]["step"]) + 1 if len(rows) > 1 else start_step + 1
        first = max(first, start_step + 1)
        span = f"step {steps}" if first == steps else f"steps {first}-{steps}"
        loss = (f"loss {last['loss']:.4f} (mean of {span}, as in metrics.csv and the "
                f"progress bar; step {steps} alone: {result.losses[-1]:.4f})")
    else:
        loss = f"loss {result.losses[-1]:.4f} (step {steps})"
    where = ", ".join(str(p) for p in outputs)
    return (f"[simplefsdp] done: steps {start_step}->{steps} in {result.wall_time_s:.1f} s, "
            f"{loss}, {tps}\n[simplefsdp] outputs: {where}")


def preempted(s: Setup, step: int, signum: int | None) -> Preempted:
    """The error a signalled run stops with: where it saved, how to continue."""
    import signal

    name = signal.Signals(signum).name if signum else "a signal on another rank"
    where = (f"saved checkpoint step-{step} in {s.ckpt.folder}; repeat the command with "
             f"--resume to continue" if s.ckpt is not None else
             "checkpoints are off (checkpoint.enable = false), so nothing was saved")
    return Preempted(f"stopped by {name} after step {step}: {where}",
                     signum or signal.SIGTERM)
