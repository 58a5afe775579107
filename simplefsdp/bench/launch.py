"""Starting the ranks: under torchrun, as spawned local processes, or one fake process.

* ``torchrun ... -m simplefsdp.bench``: the environment names rank and world size; the
  configured world size must match it.
* ``python -m simplefsdp.bench``: spawns ``world_size`` local processes itself (gloo on
  CPU, NCCL on CUDA with one GPU per rank) and waits for them; if one dies, the others
  are stopped and the command fails.
* ``--fake-pg``: one process joins a fake process group of ``world_size`` ranks (for a
  single GPU): collectives return immediately, so only compile time, memory and
  collective counts are meaningful. ``--device cuda`` with fewer GPUs than
  ``world_size`` (and no ``--fake-pg``) runs both: a real run on the GPUs there are,
  then the fake run (see ``__main__``).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .._torch_compat import fake_store
from ..errors import ConfigError
from ..net import host_store, join_local_group
from .config import BenchConfig


def main_for_rank(cfg: BenchConfig, rank: int, world: int, local_world: int,
                  backend: str) -> Path | None:
    """Run the benchmark on this rank; rank 0 prints the table and writes the outputs."""
    from ..parallel.activation_checkpoint import quiet_our_checkpoint_warning
    from .measure import quiet_profiler_log
    from .report import format_table, header_lines, legend, summarize, write_outputs
    from .runner import run_benchmark

    # In every rank however it was started: spawned ranks do not import __main__ again
    # (multiprocessing skips a package's __main__), so its filter is not theirs.
    quiet_our_checkpoint_warning()
    quiet_profiler_log()

    raw = run_benchmark(cfg, rank, world, fake=backend == "fake", local_world=local_world)
    if raw is None:
        return None
    results = summarize(cfg, raw, backend)
    out = write_outputs(results, cfg.bench.output_dir)
    late = [r["name"] for r in results["variants"] if r.get("compiles_in_measured_steps")]
    warning = [f"WARNING: compiled during measured steps: {', '.join(late)}"] if late else []
    print("\n".join(["", *header_lines(results), "", format_table(results), "",
                     *legend(results), *warning, "", f"results: {out}"]), flush=True)
    return out


def _init(cfg: BenchConfig, rank: int, world: int, local_rank: int,
          port: int | None = None) -> str:
    """Join the default group: from torchrun's environment, or (``port``) through the
    store :func:`run_spawned` hosts."""
    backend = "gloo"
    if cfg.job.device == "cuda":
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    timeout = datetime.timedelta(seconds=cfg.bench.timeout_s)
    if port is None:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    else:
        join_local_group(backend, port, rank, world, timeout)
    return backend


def run_torchrun(cfg: BenchConfig) -> Path | None:
    """This process is one rank that torchrun started."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world != cfg.bench.world_size:
        raise ConfigError(f"world size {cfg.bench.world_size} configured but torchrun started "
                               f"{world} processes; make them equal (or leave --world-size out "
                               f"of the command and the config)")
    backend = _init(cfg, rank, world, local_rank)
    try:
        return main_for_rank(cfg, rank, world, local_world, backend)
    finally:
        dist.destroy_process_group()


def run_fake(cfg: BenchConfig) -> Path | None:
    """One process in a fake process group of ``cfg.bench.world_size`` ranks."""
    try:
        store = fake_store()
    except ImportError as e:
        raise ConfigError(f"--fake-pg is unavailable on this torch: {e}") from e
    if cfg.job.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=store, rank=0, world_size=cfg.bench.world_size)
    try:
        return main_for_rank(cfg, 0, cfg.bench.world_size, 1, "fake")
    finally:
        dist.destroy_process_group()


def _spawned(cfg: BenchConfig, rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg.bench.world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(cfg.bench.world_size))
    backend = _init(cfg, rank, cfg.bench.world_size, rank, port)
    try:
        main_for_rank(cfg, rank, cfg.bench.world_size, cfg.bench.world_size, backend)
    finally:
        dist.destroy_process_group()


def run_spawned(cfg: BenchConfig, poll_s: float = 0.5) -> int:
    """Start ``world_size`` local ranks and wait; returns the exit status (0: all ok)."""
    if cfg.job.device == "cuda" and torch.cuda.device_count() < cfg.bench.world_size:
        raise ConfigError(
            f"world size {cfg.bench.world_size} needs {cfg.bench.world_size} GPUs, found "
            f"{torch.cuda.device_count()}: run --world-size {max(torch.cuda.device_count(), 1)} "
            f"for real timings, or --fake-pg for compile/memory figures at world size "
            f"{cfg.bench.world_size}")
    ctx = mp.get_context("spawn")
    # this process hosts the ranks' store for as long as they run
    store = host_store(cfg.bench.world_size, datetime.timedelta(seconds=cfg.bench.timeout_s))
    procs = [ctx.Process(target=_spawned, args=(cfg, r, store.port), name=f"bench-rank{r}")
             for r in range(cfg.bench.world_size)]
    for p in procs:
        p.start()
    status = 0
    try:
        while any(p.is_alive() for p in procs):
            bad = [p for p in procs if p.exitcode not in (None, 0)]
            if bad:
                print(f"[bench] {bad[0].name} exited with code {bad[0].exitcode}; stopping "
                      f"the other ranks", file=sys.stderr)
                status = 1
                break
            time.sleep(poll_s)
    finally:
        for p in procs:  # alive here only after a failure or an interrupt
            if p.is_alive():
                p.terminate()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if any(p.exitcode != 0 for p in procs):
        status = 1
    return status


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
