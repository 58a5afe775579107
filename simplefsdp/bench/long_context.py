"""Long sequences: one sequence per step without context parallelism (1 process) and
with ring 2 or Ulysses 2 (2 processes), the trainer's own step on each; the ring's two
K/V exchanges (``parallel.cp_rotate``) side by side with ring 2 and 4 on request.

    python -m simplefsdp.bench.long_context [--seq-len 16384] [--steps 3] [--profiled 3]
        [--variants cp1,ring2,ulysses2 | ring2,ring2_pass,ring4,ring4_pass]

Per variant: the median step time (ms) and the peak memory per rank (MiB): the state a
rank holds (``measure.held_bytes``) plus the transient peak of a step over it
(``measure.least_transient``: torch's CPU allocations during the step, the least of
``--profiled`` profiled steps). Prints a table and writes
``bench_results/long_context-<time>.json``.
Figures depend on the machine and its load: ``docs/performance.md`` gives one run with
its load.

A command-line entry point that sits above the trainer: what it times is the trainer's
own setup and step (``train.trainer.setup``, ``train.step.train_step``: the family's
model, the loader, the optimizer, clipping), so it imports them inside the rank function
and importing ``simplefsdp.bench`` leaves the trainer unloaded. The side-by-side
benchmark (``bench.runner``) builds its models from the lower layers instead.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..net import host_store, join_local_group
from .report import save_json

# name: (processes, trainer flags); every variant trains one sequence per step
PASS = ["--parallel.cp_rotate", "ring"]  # K/V passed around the ring, not all-gathered
VARIANTS = {
    "cp1": (1, []),
    "ring2": (2, ["--parallel.cp_ring", "2"]),
    "ulysses2": (2, ["--parallel.cp_ulysses", "2"]),
    "ring2_pass": (2, ["--parallel.cp_ring", "2", *PASS]),
    "ring4": (4, ["--parallel.cp_ring", "4"]),
    "ring4_pass": (4, ["--parallel.cp_ring", "4", *PASS]),
}
DEFAULT = "cp1,ring2,ulysses2"  # the others: --variants ring2,ring2_pass,ring4,ring4_pass


def _flags(name: str, seq_len: int, steps: int) -> list[str]:
    return ["--training.seq_len", str(seq_len), "--model.max_seq_len", str(seq_len),
            "--training.batch_size", "1", "--training.steps", str(steps + 4),
            "--training.hang_watchdog_s", "0", "--metrics.output_dir",
            f"/tmp/simplefsdp-long-context-{os.getpid()}-{name}"]


def _rank(rank: int, world: int, port: int, argv: list[str], steps: int, profiled: int,
          queue) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    join_local_group("gloo", port, rank, world, datetime.timedelta(minutes=30))
    try:
        from ..config.job import parse_args
        from ..parallel.context import cp_batches
        from ..train.step import train_step
        from ..train.trainer import setup
        from .measure import held_bytes, least_transient

        s = setup(parse_args(argv, world), None)
        count = iter(range(1, 10**6))

        def step() -> float:
            batches = [next(s.loader)]
            if s.dims.cp > 1:
                batches = cp_batches(batches, s.mesh, s.cfg.training.seq_len)
            return float(train_step(s, next(count), batches, False)[0])

        step()  # the first step allocates the optimizer state
        held = held_bytes(s.model, s.optimizer)
        transient = least_transient(step, s.device, profiled)
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        queue.put((rank, held + transient, statistics.median(times)))
    finally:
        dist.destroy_process_group()


def run_variant(name: str, seq_len: int, steps: int, profiled: int = 3) -> dict:
    """Spawn the variant's processes; its step ms (rank 0) and peak MiB per rank."""
    world, extra = VARIANTS[name]
    ctx = mp.get_context("spawn")
    queue, store = ctx.Queue(), host_store(world, datetime.timedelta(minutes=30))
    argv = _flags(name, seq_len, steps) + extra
    procs = [ctx.Process(target=_rank, args=(r, world, store.port, argv, steps, profiled,
                                             queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return {"variant": name, "processes": world, "seq_len": seq_len,
            "step_ms": results[0][2] * 1e3,
            "peak_mib_per_rank": [round(peak / 2**20, 1) for _, peak, _ in results]}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--profiled", type=int, default=3,
                        help="profiled steps per variant, the least transient peak is kept")
    parser.add_argument("--variants", default=DEFAULT, help=f"of {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    rows = [run_variant(v, args.seq_len, args.steps, args.profiled)
            for v in args.variants.split(",")]
    load = os.getloadavg()[0]
    print(f"debug model, seq_len {args.seq_len}, one sequence per step, load {load:.2f}")
    print(f"{'variant':<10} {'procs':>5} {'step ms':>10} {'peak MiB/rank':>16}")
    for r in rows:
        peak = max(r["peak_mib_per_rank"])
        print(f"{r['variant']:<10} {r['processes']:>5} {r['step_ms']:>10.0f} {peak:>16.1f}")
    save_json("long_context", {"load": load, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
