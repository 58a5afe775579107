"""A hang explains itself (issue 31, gap 4): rank 1 stops inside step 3 on purpose
(its batch transform sleeps); within ``training.hang_watchdog_s`` every rank must write
its Python stacks to ``hang-rank<r>.txt``, headed by the step and the phase or
collective it was in, and the job must fail (exit status ``HANG_EXIT``) instead of
waiting for the process-group timeout (120 s in the rank runner). The limit, 15 s, is
ten times a step of this tiny model on the loaded 2-core host: a slow step is not a hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rank_runner import RankFailure, run_ranks

from simplefsdp.train.__main__ import main
from simplefsdp.train.watchdog import HANG_EXIT

_calls = 0


def _hang_on_rank1_in_step3(inputs, targets):
    """The batch transform: on rank 1, the third call (step 3) never returns."""
    import torch.distributed as dist

    global _calls
    _calls += 1
    if dist.get_rank() == 1 and _calls == 3:
        time.sleep(600)
    return inputs, targets


def _train(rank: int, world: int, argv: list[str]) -> None:
    main(argv, batch_transform=_hang_on_rank1_in_step3)


def test_a_hung_rank_makes_every_rank_dump_its_stacks(tmp_path):
    out = tmp_path / "out"
    argv = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
            "--model.n_kv_heads", "2", "--training.seq_len", "32",
            "--training.batch_size", "2", "--training.steps", "6",
            "--training.hang_watchdog_s", "15", "--metrics.output_dir", str(out)]
    with pytest.raises(RankFailure) as failure:
        run_ranks(_train, 2, argv, timeout_s=300)
    assert f"exit code {HANG_EXIT}" in str(failure.value)
    hung, waiting = (Path(out / f"hang-rank{r}.txt").read_text() for r in (1, 0))
    # The hung rank: in step 3's "next batch" phase, its stack inside the transform.
    assert hung.startswith("[simplefsdp] hang watchdog: rank 1 at step 3, in next batch for")
    assert "_hang_on_rank1_in_step3" in hung and 'File "' in hung
    # Its peer: waiting in step 3's first collective, the token count all-reduce.
    assert waiting.startswith("[simplefsdp] hang watchdog: rank 0 at step 3, in token-count "
                              "all-reduce for"), waiting[:300]
    assert "in global_tokens" in waiting


def _hang_on_rank1_in_step1(inputs, targets):
    """The batch transform: on rank 1, the first call (step 1) never returns."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    return inputs, targets


def _train_short_timeout(rank: int, world: int, argv: list[str]) -> None:
    import datetime

    from torch.distributed.distributed_c10d import _set_pg_timeout

    # the first step has no limit of its own (it compiles, absorbs start-up skew): the
    # group's timeout bounds it, 8 s here instead of the rank runner's 120 s
    _set_pg_timeout(datetime.timedelta(seconds=8))
    main(argv, batch_transform=_hang_on_rank1_in_step1)


def test_a_collective_timing_out_in_the_first_step_dumps_every_ranks_stacks(tmp_path):
    """The first step is watched by the group's timeout only: when its collective times
    out, the rank that got the error announces the hang before failing, so the hung rank
    writes its stacks too, and the job exits HANG_EXIT instead of a bare gloo error."""
    out = tmp_path / "out"
    argv = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "4",
            "--model.n_kv_heads", "2", "--training.seq_len", "32",
            "--training.batch_size", "2", "--training.steps", "2",
            "--metrics.output_dir", str(out)]
    with pytest.raises(RankFailure) as failure:
        run_ranks(_train_short_timeout, 2, argv, timeout_s=300)
    assert f"exit code {HANG_EXIT}" in str(failure.value)
    waiting, hung = (Path(out / f"hang-rank{r}.txt").read_text() for r in (0, 1))
    # rank 0 got the timeout in step 1's first collective: named, with the gloo error
    assert waiting.startswith("[simplefsdp] hang watchdog: rank 0 at step 1, in token-count "
                              "all-reduce for"), waiting[:300]
    assert "a collective timed out:" in waiting.splitlines()[0]
    assert "in global_tokens" in waiting
    # rank 1, asleep in its batch transform, learnt it from the announcement
    assert hung.startswith("[simplefsdp] hang watchdog: rank 1 at step 1, in next batch for")
    assert "first seen by rank 0, step 1, token-count all-reduce" in hung.splitlines()[0]
    assert "_hang_on_rank1_in_step1" in hung


# A process that leaves the watchdog while its thread is inside a store call, then exits.
# The call is made long (one large matmul first: torch releases the GIL in it, as the
# store's own C++ calls do) so the exit always lands inside it, as it can under load.
# Without the join on exit the interpreter finalizes under that daemon thread and the
# process aborts ("terminate called without an active exception", status -6).
_EXIT_WHILE_POLLING = """
import datetime, time, torch, torch.distributed as dist
from simplefsdp.train import watchdog
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
big = torch.randn(2000, 2000)
class SlowStore:
    def check(self, keys):
        torch.mm(big, big)  # 16 GFLOP: several times the 0.05 s below
        return store.check(keys)
watchdog._store = SlowStore
watchdog.POLL_S = 0.0
with watchdog.Watchdog(600.0, {folder!r}, 0):
    time.sleep(0.05)
print("left the watchdog")
"""


def test_a_finished_run_exits_cleanly_while_the_watchdog_polls(tmp_path):
    import subprocess
    import sys

    script = _EXIT_WHILE_POLLING.format(folder=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "left the watchdog" in run.stdout, \
        (run.returncode, run.stdout, run.stderr[-2000:])
