"""Enumerate the layouts of N GPUs and predict each one that can fit.

Layouts: ``tp`` (a power-of-two divisor of N, at most one node), ``pp`` (divides what
is left, at most the number of blocks), ``dp_replicate x dp_shard`` for the rest
(``fully_shard`` when ``dp_replicate = 1``, ``hybrid_shard`` with shards of at least one
node otherwise), each AC mode, and local batch sizes 1 and 2 (under PP: as many
microbatches of one sequence as 1x and 2x the stages). Skipped untraced: layouts whose
model states (and the loss's logits) alone exceed the GPU; a batch whose smaller batch
did not fit with the same AC mode; AC modes recomputing more than one that already fits
(never faster).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

from ..hardware import gpu_profile
from ..train.config import ConfigError, JobConfig
from ..train.pipeline import stage_layers
from . import memory
from .predict import CONTEXT_BYTES, Prediction, predict

AC_MODES = ("none", "selective", "full")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _cause(e: Exception) -> str:
    """The line of an error that names its cause (dynamo wraps backend errors)."""
    lines = [x for x in str(e).splitlines() if "Error" in x and "TORCHDYNAMO" not in x]
    return (lines[-1] if lines else f"{type(e).__name__}: {e}")[:160]


def layouts(cfg: JobConfig, gpus: int, gpus_per_node: int) -> Iterator[JobConfig]:
    """Every candidate configuration (``cfg`` with parallel sizes, AC and batch set)."""
    n_layers = cfg.model.model_args().n_layers
    for tp in [d for d in _divisors(gpus) if d <= gpus_per_node and d & (d - 1) == 0]:
        for pp in [d for d in _divisors(gpus // tp) if d <= n_layers]:
            dp = gpus // (tp * pp)
            for rep in _divisors(dp):
                if rep > 1 and dp // rep < min(gpus_per_node, dp):
                    continue
                for batch in [1, 2] if pp == 1 else [pp, 2 * pp]:
                    for ac in AC_MODES:
                        c = copy.deepcopy(cfg)
                        c.parallel.tp, c.parallel.pp = tp, pp
                        c.parallel.dp_replicate, c.parallel.dp_shard = rep, dp // rep
                        c.parallel.dp_mode = "fully_shard" if rep == 1 else "hybrid_shard"
                        c.parallel.pp_microbatches = batch if pp > 1 else 1
                        c.training.batch_size = batch
                        c.activation_checkpoint.mode = ac
                        yield c


def _lower_bound(c: JobConfig) -> float:
    """Bytes a rank needs at least, known without tracing: its model states, and on the
    stage with the head the eager loss's logits (``memory.loss_peaks``), which every
    prediction adds on top (compiled) or replays (eager)."""
    args, p, t = c.model.model_args(), c.parallel, c.training
    roles = ["full"] if p.pp == 1 else ["first", "last"]
    mb = t.batch_size // (p.pp_microbatches if p.pp > 1 else 1)
    elem = 2 if t.mixed_precision_param == "bfloat16" else 4
    bound = 0.0
    for role in roles:
        layers = len(stage_layers(args.n_layers, p.pp, 0 if role == "first" else p.pp - 1))
        need = memory.states_bytes(memory.stage_params(args, role, layers, p.tp) / p.dp_shard)
        if role != "first":
            need += memory.loss_peaks(mb * t.seq_len, args.vocab_size, elem)[0]
        bound = max(bound, need)
    return bound


def search(cfg: JobConfig, gpus: int, gpu: str, gpus_per_node: int = 8,
           progress=None, failures: list[str] | None = None) -> list[Prediction]:
    """Predictions for every layout that was worth tracing, best tokens/s first among
    those that fit. A layout that fails to trace (the library cannot compile it) is
    described in ``failures``, and the other layouts with its ``tp`` are skipped."""
    failures = [] if failures is None else failures
    dev = gpu_profile(gpu)
    results: list[Prediction] = []
    too_big: set[tuple] = set()  # (layout, ac): this batch did not fit, larger won't
    fitted: set[tuple] = set()  # (layout, batch): fits with less recompute already
    broken_tp: set[int] = set()  # tensor-parallel sizes whose trace failed
    for c in layouts(cfg, gpus, gpus_per_node):
        p = c.parallel
        layout = (p.tp, p.pp, p.dp_replicate, p.dp_shard)
        shape = layout + (c.activation_checkpoint.mode,)
        if shape in too_big or layout + (c.training.batch_size,) in fitted or p.tp in broken_tp:
            continue
        try:
            c.validate()
        except ConfigError:
            continue  # e.g. tp does not divide the heads
        if _lower_bound(c) + CONTEXT_BYTES > dev.memory_bytes:
            continue
        try:
            r = predict(c, gpus, gpu, gpus_per_node)
        except Exception as e:  # noqa: BLE001 - a layout the library cannot compile
            failures.append(f"tp={p.tp} pp={p.pp} ac={c.activation_checkpoint.mode}: "
                            f"{_cause(e)}")
            broken_tp.add(p.tp)  # the failures seen are TP-wide: skip its other layouts
            continue
        results.append(r)
        if progress is not None:
            progress(r)
        if not r.fits:
            too_big.add(shape)
        else:  # more recomputation only costs time: never faster, not worth tracing
            fitted.add(layout + (c.training.batch_size,))
    return sorted(results, key=lambda r: (not r.fits, -r.tokens_per_s_per_gpu))
