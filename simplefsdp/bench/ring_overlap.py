"""Does the ring pass's K/V shift overlap the attention on gloo? One attention layer of the
debug model's shapes (4 query heads, 2 KV heads, head_dim 32, one sequence, float32) with
``parallel.cp_rotate = "ring"``, forward and backward timed three ways on ``R`` gloo
processes:

* ``both``: the ring pass as it runs (each step's shift launched before its attention);
* ``compute``: the same kernels and merges, each shift replaced by a local copy;
* ``comm``: the same shifts, each kernel replaced by zeros of its output's shape.

The exchange's time hidden behind the attention is ``compute + comm - both`` (all of
``comm`` when fully overlapped, 0 when serialised). Per rank the least of ``--reps``
calls after one warm-up (the modes interleaved, each call barrier-aligned: the least is
the one other processes on the machine disturbed least); the slowest rank is reported.

    python -m simplefsdp.bench.ring_overlap [--seq-lens 2048,4096] [--rings 2,4] [--reps 5]

Prints a table and writes ``bench_results/ring_overlap-<time>.json``. Figures depend on
the machine and its load (README, "Long sequences: context parallelism").
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing as mp
import os
import time

import torch
import torch.distributed as dist

from ..net import host_store, join_local_group
from ..parallel import ring
from .report import save_json

MODES = ("both", "compute", "comm")


@contextlib.contextmanager
def _mode(mode: str):
    """The ring pass with its shifts (``compute``) or its kernels (``comm``) stubbed."""
    saved = ring._shift, ring._attend, ring._attend_backward
    if mode == "compute":
        ring._shift = lambda x, group, rank, size: x.clone()
    elif mode == "comm":
        ring._attend = lambda q, k, v, causal, allowed: (
            torch.zeros_like(q), torch.zeros(q.shape[:3], dtype=torch.float32))
        ring._attend_backward = lambda grad, q, k, v, *rest: (
            torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    try:
        yield
    finally:
        ring._shift, ring._attend, ring._attend_backward = saved


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rank(rank: int, size: int, port: int, seq_len: int, reps: int, queue) -> None:
    torch.set_num_threads(1)
    join_local_group("gloo", port, rank, size, datetime.timedelta(minutes=30))
    try:
        local = seq_len // size
        gen = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, local, heads, 32, generator=gen).requires_grad_()
                   for heads in (4, 2, 2))
        grad = torch.randn(1, local, 4, 32, generator=gen)
        out = None

        def forward():
            nonlocal out
            out = ring.ring_attention(q, k, v, dist.group.WORLD, rank, size, None, "ring")

        times = {m: ([], []) for m in MODES}
        for rep in range(reps + 1):  # the modes interleaved: load drift hits each alike
            for mode in MODES:
                with _mode(mode):
                    fwd, bwd = _timed(forward), _timed(lambda: out.backward(grad))
                if rep:  # the first round warms up
                    times[mode][0].append(fwd)
                    times[mode][1].append(bwd)
        queue.put((rank, {m: tuple(min(t) for t in times[m]) for m in MODES}))
    finally:
        dist.destroy_process_group()


def run(seq_len: int, size: int, reps: int) -> dict:
    """One ring size and sequence length: per mode and pass, the slowest rank's ms."""
    ctx = mp.get_context("spawn")
    queue, store = ctx.Queue(), host_store(size, datetime.timedelta(minutes=30))
    procs = [ctx.Process(target=_rank, args=(r, size, store.port, seq_len, reps, queue))
             for r in range(size)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=3600)[1] for _ in procs]
    for p in procs:
        p.join()
    row = {"seq_len": seq_len, "ring": size}
    for i, name in enumerate(("forward", "backward")):
        ms = {m: max(r[m][i] for r in results) * 1e3 for m in MODES}
        hidden = ms["compute"] + ms["comm"] - ms["both"]
        row[name] = dict(ms, hidden=hidden, hidden_of_comm=hidden / ms["comm"])
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="2048,4096")
    parser.add_argument("--rings", default="2,4")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per mode")
    args = parser.parse_args(argv)
    start_load = os.getloadavg()[0]
    rows = [run(int(s), int(r), args.reps) for s in args.seq_lens.split(",")
            for r in args.rings.split(",")]
    load = (start_load, os.getloadavg()[0])
    print(f"ring pass, one attention layer (4 q / 2 kv heads, head_dim 32, float32), "
          f"load {load[0]:.2f} -> {load[1]:.2f}")
    print(f"{'seq':>6} {'ring':>4} {'pass':<8} {'both ms':>9} {'compute':>9} {'comm':>8} "
          f"{'hidden':>8} {'of comm':>8}")
    for row in rows:
        for name in ("forward", "backward"):
            x = row[name]
            print(f"{row['seq_len']:>6} {row['ring']:>4} {name:<8} {x['both']:>9.1f} "
                  f"{x['compute']:>9.1f} {x['comm']:>8.1f} {x['hidden']:>8.1f} "
                  f"{x['hidden_of_comm']:>8.0%}")
    save_json("ring_overlap", {"load": load, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
