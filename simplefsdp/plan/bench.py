"""The planner's side of the benchmark's "predicted MiB" column: the trainer job a
simplefsdp bench variant amounts to, and its predicted peak bytes per rank.

Bench variants are ``data_parallel`` fully_shard in float32, without activation
checkpointing unless named (``-selective-ac``, ``-full-ac``); the compiled ones use our
backend with the variant's passes. Variants
the planner does not model (auto wrapping, upstream passes, FSDP2, DDP, compute-only)
get None.
"""

from __future__ import annotations

import copy

from ..config.job import JobConfig, ModelConfig

# variant -> (compiled, bucketing, reordering, activation checkpointing)
VARIANTS = {
    "simplefsdp-eager": (False, "none", False, "none"),
    "simplefsdp-compiled": (True, "none", False, "none"),
    "simplefsdp-bucketing": (True, "manual", False, "none"),
    "simplefsdp-reordering": (True, "manual", True, "none"),
    "simplefsdp-reordering-selective-ac": (True, "manual", True, "selective"),
    "simplefsdp-reordering-full-ac": (True, "manual", True, "full"),
}


def bench_job(variant: str, model: ModelConfig, batch_size: int, seq_len: int
              ) -> JobConfig | None:
    """The trainer config equivalent to one bench variant's step, or None."""
    if variant not in VARIANTS:
        return None
    compiled, bucketing, reordering, ac = VARIANTS[variant]
    cfg = JobConfig()
    cfg.model = copy.deepcopy(model)
    cfg.training.batch_size, cfg.training.seq_len = batch_size, seq_len
    cfg.compile.enable, cfg.compile.bucketing = compiled, bucketing
    cfg.compile.reordering = reordering
    cfg.activation_checkpoint.mode = ac
    cfg.validate()
    return cfg


def predicted_peak_bytes(variant: str, model: ModelConfig, batch_size: int, seq_len: int,
                         world_size: int) -> int | None:
    """Predicted active peak bytes per rank of a bench variant (None: not modelled).
    Runs the planner in a fresh process (the benchmark has its own process group)."""
    return predicted_peaks([variant], model, batch_size, seq_len, world_size)[variant]


def _peaks(jobs: dict, world_size: int) -> dict[str, int | None]:
    from ..parallel.activation_checkpoint import quiet_our_checkpoint_warning
    from .predict import predict

    # This runs in a fresh pool process, which has none of the caller's log filters:
    # without it torch warns about our checkpointed gather on the benchmark's console.
    quiet_our_checkpoint_warning()

    return {name: None if cfg is None else int(predict(cfg, world_size).peak_memory_gib
                                               * 2**30) for name, cfg in jobs.items()}


def predicted_peaks(variants: list[str], model: ModelConfig, batch_size: int, seq_len: int,
                    world_size: int) -> dict[str, int | None]:
    """``predicted_peak_bytes`` of several variants, all in ONE fresh process (the
    traces they share are made once)."""
    import multiprocessing

    jobs = {v: bench_job(v, model, batch_size, seq_len) for v in variants}
    if all(cfg is None for cfg in jobs.values()):
        return dict.fromkeys(variants)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        peaks = pool.apply(_peaks, (jobs, world_size))
        # The worker exits on its own: the with block's terminate() would kill it before
        # its finalizers run, leaking the semaphore its tqdm lock holds (the resource
        # tracker's "leaked semaphore objects" warning at the benchmark's end).
        pool.close()
        pool.join()
    return peaks
