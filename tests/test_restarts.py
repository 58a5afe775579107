"""Elastic restarts and asynchronous checkpoints (issue 31, gaps 1 and 3).

* torchrun's agent store outlives a restart; each round must see only its own keys
  (``train/elastic.py``), or a restarted rank dials the previous round's addresses.
* A real ``torchrun --max-restarts=2`` job with two injected SIGKILLs (``train/faults.py``):
  one while an asynchronous checkpoint write is in flight, one after a checkpoint's
  rename but before its manifest. Each round must resume from the newest *verified*
  checkpoint, and the job's metrics.csv must equal an uninterrupted synchronous run's,
  bit for bit (loss, grad norm and LR columns, as the CSV writes them: ``repr`` floats).
* ``CheckpointManager`` in async mode writes a manifest only once the write finished.
"""

from __future__ import annotations

import csv
import datetime
import os
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
from rank_runner import run_ranks
from test_reliability import tiny_run

from simplefsdp.train import elastic
from simplefsdp.train.__main__ import main
from simplefsdp.train.checkpoint import MANIFEST, CheckpointManager, TrainerState

REPO = Path(__file__).resolve().parents[1]


def _argv(out: Path, *extra: str, steps: int = 8) -> list[str]:
    """test_reliability's tiny run with a checkpoint every 2 steps, all kept."""
    return [*tiny_run(out, steps), "--checkpoint.enable", "true", "--checkpoint.every", "2",
            "--checkpoint.keep_latest", "0", *extra]


def test_round_store_isolates_restart_rounds(monkeypatch):
    """A key set in restart round 0 (as gloo's address keys are) is invisible in round 1
    and visible again to round 0's prefix: the agent's store is the same server."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True,
                           timeout=datetime.timedelta(seconds=30))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    timeout = datetime.timedelta(seconds=30)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    elastic.round_store(timeout).set("default_pg/0//cpu//0//rank_0", "round 0's address")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not elastic.round_store(timeout).check(["default_pg/0//cpu//0//rank_0"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert elastic.round_store(timeout).get("default_pg/0//cpu//0//rank_0") == \
        b"round 0's address"
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # not torchrun's store: env:// as is
    assert elastic.round_store(timeout) is None


def _rows(out: Path) -> list[tuple[str, ...]]:
    with open(out / "metrics.csv", newline="") as f:
        return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in csv.DictReader(f)]


def _uninterrupted(rank: int, world: int, argv: list[str]) -> None:
    main(argv)


def test_two_kills_under_torchrun_resume_from_the_newest_verified_checkpoint(tmp_path):
    """Round 0: rank 1 dies while step 4's async write is in flight (step-4.tmp, no
    step-4) -> round 1 resumes from step-2. Round 1: rank 0 dies after step 6's rename,
    before its manifest -> round 2 skips step-6 and resumes from step-4. The job exits 0
    and its metrics equal a synchronous run without kills."""
    out = tmp_path / "job"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]),
               OMP_NUM_THREADS="1", SIMPLEFSDP_FAULT="save:4:1,manifest:6:0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", "--max-restarts=2", "-m", "simplefsdp.train",
           *_argv(out, "--checkpoint.async_mode", "async", "--resume")]
    job = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=400)
    said = job.stdout
    assert job.returncode == 0, said
    assert "SIGKILL rank 1 at save of step 4 (restart round 0)" in said, said
    assert "SIGKILL rank 0 at manifest of step 6 (restart round 1)" in said, said
    resumed = [line.split("resumed from ")[1] for line in said.splitlines()
               if "resumed from " in line]
    assert [Path(r.split()[0]).name for r in resumed] == ["step-2", "step-4"], said
    assert "skipping " + str(out / "checkpoints" / "step-6") + ": no manifest.json" in said

    run_ranks(_uninterrupted, 2, _argv(tmp_path / "ref"))
    assert _rows(out) == _rows(tmp_path / "ref")  # string equality: bitwise floats
    assert len(_rows(out)) == 8


class _Loader:
    def state_dict(self):
        return {"position": 0}

    def load_state_dict(self, state):
        pass


def test_async_manifest_only_after_the_write_finished(tmp_path, monkeypatch):
    """One process: the write is held back by hand; poll() must not complete the
    checkpoint while it is in flight, and the manifest appears only after it ended."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    manager = CheckpointManager(tmp_path, model, optimizer, TrainerState(scheduler, _Loader()),
                                every=1, keep_latest=0, async_mode="async")
    release = threading.Event()
    start = manager.writer.start

    def held(state, folder):  # the real async write, reported done only on release
        inner, outer = start(state, folder), Future()
        threading.Thread(target=lambda: (inner.result(), release.wait(60),
                                         outer.set_result(None))).start()
        return outer

    monkeypatch.setattr(manager.writer, "start", held)
    assert manager.save(1) is None
    assert manager.poll() is None and manager.poll() is None
    assert not (tmp_path / "step-1").exists()  # not renamed, no manifest: not a checkpoint
    release.set()
    path = manager.finish()
    assert path == tmp_path / "step-1" and (path / MANIFEST).is_file()
    manager.writer.close()


def test_an_unfinished_save_alone_means_starting_afresh(tmp_path, capsys):
    """Killed between the rename and the manifest before any other checkpoint existed
    (the fault script's run 1, kill at manifest:2): --resume skips it and starts from
    step 0 instead of refusing, as it would for a damaged checkpoint (test_reliability)."""
    from simplefsdp.train.checkpoint import resume_point

    unfinished = tmp_path / "step-2"
    unfinished.mkdir()
    (unfinished / ".complete").touch()  # renamed into place: complete, but no manifest
    assert resume_point(tmp_path, resume=True) is None
    said = capsys.readouterr().out
    assert "skipping" in said and "no manifest.json" in said and "starting from step 0" in said
