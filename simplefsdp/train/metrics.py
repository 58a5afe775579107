"""Training metrics: loss, throughput, MFU, memory; CSV, TensorBoard, plots, progress bar.

Only rank 0 writes anything; every rank can call the methods (the others do nothing).

* A row every ``metrics.log_every`` steps: ``loss`` is the mean of the global per-step
  losses since the previous row, ``grad_norm`` and ``lr`` those of the row's step.
* tokens/s is global: tokens of all data-parallel ranks in a step / step time.
* MFU = ``flops_per_token * tokens/s / (peak FLOP/s per device * world size)``. The peak
  comes from a table for known GPUs (bf16 dense) and, on CPU, from a timed float32
  matmul measured once per process: a practical ceiling, not a datasheet number.
* Memory: ``torch.cuda.max_memory_allocated`` on GPU (``max_mem_gib``); on CPU the
  process's peak resident set size from ``getrusage`` (``max_rss_gib``), which also
  counts the Python interpreter and libraries.
"""

from __future__ import annotations

import csv
import functools
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..hardware import gpu_peak_flops, model_flops_utilization


@functools.cache
def measured_cpu_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a float32 ``n x n`` matmul on this process's threads (best of
    ``repeats``), measured once per process. Its inputs come from a private generator:
    the global RNG (restored on resume, used by batch transforms) is left untouched."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    a @ b  # warm up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_flops(device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s per device, where the number comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is not None:
            return peak, f"{name} bf16 dense (table)"
        a100 = gpu_peak_flops("A100")  # the hardware table's, as cost.compute assumes
        return a100, f"{name} not in table, assuming A100 bf16 ({a100 / 1e12:.0f} TFLOP/s)"
    return measured_cpu_peak_flops(), "measured fp32 matmul on this process's CPU threads"


def peak_memory(device: torch.device) -> tuple[str, float]:
    """(column name, peak memory in GiB)."""
    if device.type == "cuda":
        return "max_mem_gib", torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    if sys.platform == "darwin":  # bytes on macOS
        kib /= 1024
    return "max_rss_gib", kib / 2**20


class MetricsLogger:
    """Collects per-step losses and timings; every ``log_every`` steps reports a row."""

    COLUMNS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu_pct", "step_time_s")

    def __init__(self, output_dir: str | Path, *, rank: int, world: int, device: torch.device,
                 flops_per_token: float, tokens_per_step: int, total_steps: int,
                 start_step: int = 0, tensorboard: bool = False, progress: bool = True,
                 extra_columns: tuple[str, ...] = (), sparse_columns: tuple[str, ...] = (),
                 tracker=None):
        self.out = Path(output_dir)
        self.extra_columns = tuple(extra_columns)  # the model family's (MoE: expert load)
        # Filled only on some rows, empty on the others (validation's val_loss, val_ppl).
        self.sparse_columns = tuple(sparse_columns)
        self.tracker = tracker  # rank 0's experiment tracker (tracker.py), or None
        self.rank, self.world, self.device = rank, world, device
        self.flops_per_token, self.tokens_per_step = flops_per_token, tokens_per_step
        self.active = rank == 0
        self.mem_column = "max_rss_gib" if device.type != "cuda" else "max_mem_gib"
        self.peak, self.peak_source = peak_flops(device) if self.active else (0.0, "")
        self.rows: list[dict[str, float]] = []
        self.csv_path = self.out / "metrics.csv"
        self._tb = None
        self._bar = None
        self._progress = progress
        self._total_steps, self._start_step = total_steps, start_step
        self.plots = False
        self.written: list[Path] = []  # the plots, once ``close`` drew them
        self.tensorboard_dir: Path | None = None
        if not self.active:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self._prepare_csv(start_step)
        try:  # imported now, not at the end: a missing package is known before step 1
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot  # noqa: F401

            self.plots = True
        except ImportError:
            print("[simplefsdp] matplotlib is not installed: no loss.png / memory.png "
                  "(metrics.csv is written); pip install matplotlib", file=sys.stderr)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out / "tensorboard"))
                self.tensorboard_dir = self.out / "tensorboard"
            except ImportError:
                print("metrics.tensorboard = true but tensorboard is not installed; skipping",
                      file=sys.stderr)

    def start_progress(self) -> None:
        """Show the progress bar (rank 0, with tqdm): called once the run's header lines
        are printed, so that none of them lands on the bar's line."""
        if not (self.active and self._progress) or self._bar is not None:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=self._total_steps, initial=self._start_step, desc="train",
                         dynamic_ncols=True, mininterval=1.0)

    def note(self, line: str) -> None:
        """Print a line (rank 0) above the progress bar, if one is showing."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    @property
    def columns(self) -> tuple[str, ...]:
        return (*self.COLUMNS, *self.extra_columns, self.mem_column, *self.sparse_columns)

    def _prepare_csv(self, start_step: int) -> None:
        """Start a new CSV, or (resuming) keep the rows up to ``start_step``: rows after
        it came from a run that stopped before its next checkpoint."""
        kept: list[dict[str, str]] = []
        if start_step > 0 and self.csv_path.exists():
            with open(self.csv_path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(r["step"]) <= start_step]
        with open(self.csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)
        self.rows = [{k: float(v) for k, v in r.items() if v != ""} for r in kept]

    def log(self, step: int, loss: float, grad_norm: float, lr: float, window_steps: int,
            window_time_s: float, extra: dict[str, float] | None = None
            ) -> dict[str, float] | None:
        """Report step ``step`` (1-based); ``window_*``: steps and seconds since the last
        report, for throughput; ``extra``: the ``extra_columns`` of step ``step``, and the
        ``sparse_columns`` it has (validation's, on an evaluating step)."""
        if not self.active:
            return None
        tokens_per_s = self.tokens_per_step * window_steps / max(window_time_s, 1e-9)
        mfu = model_flops_utilization(self.flops_per_token, tokens_per_s,
                                      self.peak * self.world)
        _, mem = peak_memory(self.device)
        row = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
               "tokens_per_s": tokens_per_s, "mfu_pct": 100 * mfu,
               "step_time_s": window_time_s / max(window_steps, 1),
               **{k: (extra or {}).get(k, float("nan")) for k in self.extra_columns},
               self.mem_column: mem,
               **{k: (extra or {})[k] for k in self.sparse_columns if k in (extra or {})}}
        self.rows.append(row)
        with open(self.csv_path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(row)
        if self._tb is not None:
            for key, value in row.items():
                if key != "step":
                    self._tb.add_scalar(key, value, step)
        if self.tracker is not None:
            self.tracker.log(row)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}",
                                  mfu=f"{100 * mfu:.2f}%", refresh=False,
                                  **{k: f"{row[k]:.4g}" for k in self.extra_columns},
                                  **{k: f"{row[k]:.4f}" for k in self.sparse_columns
                                     if k in row})
        return row

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def close(self) -> None:
        """Close the bar and writers and draw ``loss.png`` and ``memory.png``."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self.tracker is not None:
            self.tracker.close()
        self.written = self.plot()

    def plot(self) -> list[Path]:
        """Draw the plots (if matplotlib imported at start); returns the files written."""
        if not self.rows or not self.plots:
            return []
        import matplotlib.pyplot as plt

        steps = [r["step"] for r in self.rows]
        written = []
        for key, name, ylabel in (
                ("loss", "loss.png", "loss (training: mean over the logging window)"),
                (self.mem_column, "memory.png",
                 "peak GPU memory allocated (GiB)" if self.mem_column == "max_mem_gib"
                 else "peak process RSS (GiB, CPU)")):
            values = [r.get(key, float("nan")) for r in self.rows]
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.plot(steps, values, marker="o", markersize=3, label="training")
            if key == "loss" and any("val_loss" in r for r in self.rows):
                held_out = [(r["step"], r["val_loss"]) for r in self.rows if "val_loss" in r]
                ax.plot(*zip(*held_out, strict=True), marker="s", markersize=4,
                        label="validation (held-out)")
                ax.legend()
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            if key == self.mem_column:  # from 0: a few MiB of drift is not a cliff
                finite = [v for v in values if math.isfinite(v)]
                ax.set_ylim(bottom=0, top=1.1 * max(finite) if finite and max(finite) > 0
                            else None)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(self.out / name, dpi=100)
            plt.close(fig)
            written.append(self.out / name)
        return written

    def summary(self) -> dict[str, Any]:
        return {"peak_flops": self.peak, "peak_source": self.peak_source,
                "rows": list(self.rows)}
