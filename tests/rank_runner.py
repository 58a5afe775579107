"""The one helper every multi-rank test uses: spawn N gloo processes, fail fast, never hang.

Import it as ``from rank_runner import run_ranks`` (see conftest.py).

`run_ranks(fn, world_size, *args)` starts `world_size` processes, each joins a gloo
process group (with a timeout, so a collective mismatch raises instead of hanging),
calls `fn(rank, world_size, *args)` and sends back its return value. The first rank
that fails is re-raised in the test process with that rank's traceback.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any
from unittest import mock

from simplefsdp.net import host_store, join_local_group

# A deadlock turns into an error after these. Generous: with pytest-xdist workers
# (scripts/test.sh, SIMPLEFSDP_TEST_WORKERS) two test files share 2 cores, so a group of
# 4 ranks may get half the CPU a lone run gets, on a host up to twice as slow as ours.
COLLECTIVE_TIMEOUT_S = 300  # one collective
TEST_TIMEOUT_S = 1200  # the whole group of processes


# Rank processes are forked from one server process that has already imported these
# (multiprocessing's "forkserver"): a rank starts in a fraction of a second instead of
# re-importing torch (~4 CPU-seconds each, over a hundred rank processes per suite). The
# server only imports (no tensors; its only threads are BLAS pools, which OpenBLAS shuts
# down across a fork), so each rank still starts clean. Also
# what a rank would import on first use: Inductor's compiler (AOTAutograd with it; the
# first Inductor compile of a rank: 2.6 CPU-s cold, 0.6 with these imported) and the
# trainer's plots (rank 0 of every trainer run: 0.4 CPU-s), and transformers' model code
# (every rank of the test_hf* tests: ~1.6 CPU-s; it starts scipy's OpenBLAS pool, as
# torch's import starts numpy's). A module missing here (matplotlib is optional) is
# skipped by the server.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
           "simplefsdp", "simplefsdp.train.trainer", "torch._inductor.compile_fx",
           "matplotlib.pyplot", "transformers.modeling_utils"]


# Ranks never see a GPU: they are gloo ranks computing on CPU tensors, on any host. On a
# CUDA machine an import the server preloads (torch, triton or transformers built for
# CUDA) can initialize the CUDA driver in the server; a rank forked from it then fails
# its first CUDA call ("CUDA error: initialization error", e.g. in AdamW's graph-capture
# check, which asks CUDA whenever a GPU is visible). Hidden from the server and the ranks.
HIDDEN_GPUS = {"CUDA_VISIBLE_DEVICES": ""}
# (the test now running, the most ranks it may start at once), set by conftest.py before
# its fixtures; None: no limit (a ``many_ranks`` test, or outside pytest).
RANK_LIMIT: tuple[str, int] | None = None


# Python's cyclic garbage collector, as the suite's processes use it: compiling (Dynamo,
# AOTAutograd, our passes) makes millions of short-lived container objects, so with the
# defaults (a young collection every 700 allocations; full ones that walk every object
# the imports made) collecting took a large share of a compiling process's CPU
# (docs/performance.md, "The test suite"). Frozen: the objects alive now (torch's and
# our imports) are never garbage, and full collections no longer walk them. Young
# collections every 20,000 allocations: cycles are still freed within a step. A check
# that depends on a cycle being freed by a given point collects itself (gc.collect()).
GC_THRESHOLDS = (20_000, 20, 20)


# Inductor's C++ for CPU, as the suite's processes compile it: scalar loops, not
# vectorized (``cpp.simdlen = 1`` matches no vector ISA). What the tests check of an
# Inductor compile (our passes' FX graphs, the collectives, numerics within each test's
# stated tolerance, Inductor's buffer reuse in the memory tests) does not depend on the
# vector width. Choosing vector tilings (sympy) was about half of the Inductor composition
# cells' codegen; tests that run many compiled steps pay a little back in slower kernels
# (figures: docs/performance.md, "The test suite").
INDUCTOR_SIMDLEN = 1


def tune_process() -> None:
    """Freeze what is alive now and collect less often (``GC_THRESHOLDS``); Inductor's
    CPU code scalar (``INDUCTOR_SIMDLEN``): a rank process at its start (after the
    server's imports), pytest's own process and the planner's after collection
    (tests/conftest.py)."""
    import torch._inductor.config as inductor_config

    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    inductor_config.cpp.simdlen = INDUCTOR_SIMDLEN


def stop_forkserver() -> None:
    """Stop the forkserver the rank processes came from, if one runs, and wait for it.
    Python 3.11 leaves it running when the interpreter exits, so no one would wait for
    it: its ranks (which it reaped) would be lost to the CPU-time count of
    ``scripts/test_cpu.py``, and a pytest-xdist worker would leave it behind.
    ``conftest.pytest_sessionfinish`` calls it in every pytest process."""
    import multiprocessing.forkserver as forkserver

    server = forkserver._forkserver
    stop = getattr(server, "_stop", None)
    if stop is not None and getattr(server, "_forkserver_pid", None) is not None:
        stop()


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _CallersFd:
    """Pickles as a copy of the caller's file descriptor ``fd`` for the rank process, put
    in place as its ``fd`` when unpickled there: a forked rank would otherwise write to
    the server's stdout/stderr, not the caller's (pytest captures per test)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _adopt_fd, (DupFd(self.fd), self.fd)


def _adopt_fd(copy, fd: int) -> int:
    os.dup2(copy.detach(), fd)
    return fd


def _worker(fn, rank, world_size, port, env, _std_fds, args, queue):
    # _std_fds: the caller's stdout and stderr, already in place (``_CallersFd``).
    # The server's environment is the one it started with: take the caller's (the
    # folder and sys.path multiprocessing passes itself).
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # ranks share 2 cores; oversubscription only slows them
    tune_process()
    try:
        join_local_group("gloo", port, rank, world_size,
                         datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        result = fn(rank, world_size, *args)
        if dist.is_initialized():
            # meet before tearing down: a rank that exits while another still creates
            # groups or runs a collective with it breaks that rank's run
            dist.barrier()
        # plain pickle copies tensors' data; the queue's own pickler would send them as
        # shared memory that the parent reads through this process, which may have
        # exited by then (ConnectionResetError / refused, seen under load)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a server another process binds
    (torchrun's rendezvous endpoint, ranks started with ``env://``); it may be taken
    before then, so ranks this process starts use the store it hosts instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(RuntimeError):
    """A rank raised; the message holds its traceback."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = TEST_TIMEOUT_S) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank."""
    if RANK_LIMIT is not None and world_size > RANK_LIMIT[1]:
        raise RuntimeError(f"{RANK_LIMIT[0]} starts {world_size} ranks, more than "
                           f"{RANK_LIMIT[1]}: mark it many_ranks (tests/conftest.py)")
    ctx = _context()
    queue = ctx.Queue()
    # this process hosts the ranks' store (no port chosen free and bound later, which
    # another process could take meanwhile: EADDRINUSE under load); it outlives every rank
    store = host_store(world_size, datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    port = store.port
    env = dict(os.environ, **HIDDEN_GPUS)
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, env,
                                                    (_CallersFd(1), _CallersFd(2)), args, queue),
                         daemon=True)
             for r in range(world_size)]
    # the first start launches the server, which keeps the environment it started with
    with mock.patch.dict(os.environ, HIDDEN_GPUS):
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:
                crashed = [(i, p.exitcode) for i, p in enumerate(procs)
                           if p.exitcode not in (None, 0) and i not in results]
                if crashed:  # killed by a signal (e.g. SIGABRT) before it could report
                    raise RankFailure(f"rank {crashed[0][0]} died with exit code "
                                      f"{crashed[0][1]} without reporting") from None
                if time.monotonic() > deadline:
                    raise RankFailure(f"ranks did not finish within {timeout_s}s") from None
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    except BaseException:
        # a rank failed or time ran out: the others may wait for it (a collective, the
        # barrier before teardown), so they are stopped rather than waited for
        for p in procs:
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store  # stops its server: every rank has exited or been killed
    return [results[r] for r in range(world_size)]
