"""Shared test set-up.

pytest puts this folder on ``sys.path`` (rootdir-relative, no package), so every test
imports its helpers one way: ``from rank_runner import run_ranks`` and ``from toy import ...``.
Spawned rank processes inherit that path, so they import the same modules.
"""

import os

import pytest

# Tests never reach the network: Hugging Face libraries, if a test uses them, stay offline.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")

# Inductor compiles in the test's own process: its default pool of compile workers is
# a set of fresh interpreters per rank process (4 ranks: 8 more torch imports) on 2 cores.
# Measured on the debug model's first Inductor step, one process, load 8-13: 92-97 s
# in-process against 118-210 s with the pool.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


# Two test processes share 2 cores (``scripts/test.sh``: two pytest-xdist workers,
# ``--dist loadgroup``): a test's ranks leave part of the cores idle (waiting in
# collectives, starting up), which a test in the other process uses. Two groups of 4
# ranks at once would oversubscribe the cores and waste more than they overlap, so the
# tests marked ``many_ranks`` (more than ``MOST_RANKS_UNMARKED`` processes at once) run
# one after another in one worker, and every other test file goes whole (its module
# fixtures once) to whichever worker is free.
MANY_RANKS = "many_ranks"
MOST_RANKS_UNMARKED = 2


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Each test joins its ``xdist_group`` (before pytest-xdist reads the marks): the
    ``many_ranks`` group, else its file's; without ``--dist loadgroup`` they change nothing."""
    for item in items:
        group = MANY_RANKS if item.get_closest_marker(MANY_RANKS) else item.path.stem
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test (its fixtures included) not marked ``many_ranks`` that starts more than
    ``MOST_RANKS_UNMARKED`` ranks fails (``rank_runner.run_ranks``): it would run beside
    the other worker's ranks."""
    import rank_runner

    rank_runner.RANK_LIMIT = (None if item.get_closest_marker(MANY_RANKS)
                              else (item.nodeid, MOST_RANKS_UNMARKED))


def pytest_collection_finish(session):
    """Every test module is imported: tune this process (and so a pytest-xdist worker)
    as the rank processes are (``rank_runner.tune_process``)."""
    from rank_runner import tune_process

    tune_process()


def _planner_call(fn, args):
    """``fn(*args)`` in the planner's process, its trace caches emptied first and the
    planner's disk cache off (``plan.disk_cache``; a call that tests it turns it on in a
    folder of its own): each call traces what it needs itself (as in a fresh process),
    so its counts of traces are its own; the fake process group, the meshes and Dynamo's
    warm imports are kept."""
    from simplefsdp.plan.eager import eager_memory
    from simplefsdp.plan.trace import trace

    trace.cache_clear()
    eager_memory.cache_clear()
    os.environ["SIMPLEFSDP_PLAN_CACHE"] = "0"
    return fn(*args)


def _warm_planner():
    """The planner process's imports, then the process tuned as a rank is."""
    from rank_runner import tune_process

    import simplefsdp.plan  # noqa: F401

    tune_process()


@pytest.fixture(scope="session")
def planner():
    """``planner(fn, *args)``: ``fn(*args)`` in one spawned process for the whole session,
    with the planner's own fake process group (it must never meet a test's gloo group).
    One process, not one per call: each spawn re-imports torch and warms Dynamo up
    (measured: ~4 CPU-seconds of imports alone, over 20 planner calls in the suite). Not
    a daemon: a search with ``workers`` starts its own processes from it. Killed at the
    end: its interpreter's orderly exit (tearing down every trace it holds) took minutes
    on a loaded machine, and nothing in it needs saving."""
    import multiprocessing
    import signal
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    worker = pool.submit(os.getpid).result()
    pool.submit(_warm_planner).result()
    try:
        yield lambda fn, *args: pool.submit(_planner_call, fn, args).result()
    finally:
        os.kill(worker, signal.SIGKILL)
        pool.shutdown(wait=True)


def pytest_sessionfinish(session, exitstatus):
    """Every pytest process that ran ranks (the main one, or a pytest-xdist worker) stops
    their forkserver before it exits (``rank_runner.stop_forkserver``); a process that
    never imported ``rank_runner`` started none."""
    import sys

    runner = sys.modules.get("rank_runner")
    if runner is not None:
        runner.stop_forkserver()
