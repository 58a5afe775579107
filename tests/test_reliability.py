"""Reliability of the trainer and the library (issue 12): one test per failure found.

Each test reproduces a failure of a run as a user met it: NaN training, corrupt and
truncated checkpoints, missing optional packages, unwritable folders and full disks,
randomness across a resume, SIGTERM of a torchrun job, bad datasets (in test_data.py),
misuse of ``data_parallel``, overwritten metrics. Runs use a tiny Llama (dim 32,
2 layers) on 2 gloo ranks where the failure involves several ranks.

Resumed runs must reproduce the uninterrupted run's losses *exactly* (``==``): the same
ops on the same values in the same order, bit for bit (see test_trainer.py).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from rank_runner import run_ranks

from simplefsdp.parallel.tensor import IGNORE_INDEX
from simplefsdp.train.__main__ import main
from simplefsdp.train.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[1]


def _saved(folder) -> list[str]:
    """What a run left in its checkpoint folder besides the job config it records there
    for sampling (``train.checkpoint.RECORDED_CONFIG``): the saved steps and any leftovers."""
    from simplefsdp.train.checkpoint import RECORDED_CONFIG

    return sorted(p.name for p in folder.iterdir() if p.name != RECORDED_CONFIG)


def tiny_run(out: Path, steps: int) -> list[str]:
    """A tiny Llama (dim 32, 2 layers) for `steps` steps, a CSV row per step in `out`
    (test_restarts uses it too)."""
    return ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
            "--model.n_kv_heads", "2", "--training.seq_len", "32",
            "--training.batch_size", "2", "--training.steps", str(steps),
            "--training.warmup_steps", "2", "--training.lr", "1e-2",
            "--metrics.log_every", "1", "--metrics.output_dir", str(out)]


def _argv(out: Path, *extra: str, steps: int = 8) -> list[str]:
    return [*tiny_run(out, steps), "--checkpoint.folder", str(out / "ckpt"), *extra]


def _random_mask(inputs: torch.Tensor, targets: torch.Tensor):
    """Leave out a random 30% of the targets, drawn from the global CPU generator: the
    run is only reproducible if that generator's state is restored exactly on resume."""
    drop = torch.rand(targets.shape) < 0.3
    return inputs, targets.masked_fill(drop, IGNORE_INDEX)


def _run(rank: int, world: int, argv: list[str], random: bool = False) -> dict:
    """Train; returns the losses and what rank 0 printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = main(argv, batch_transform=_random_mask if random else None)
    return {"losses": result.losses, "start_step": result.start_step,
            "stdout": printed.getvalue()}


def _error(rank: int, world: int, argv: list[str]) -> str:
    """The message of the error ``main(argv)`` raises (every known failure is one)."""
    try:
        main(argv)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return f"{type(e).__name__}: {e}"
    return "no error"


def _exit_status(argv: list[str]) -> tuple[int, str]:
    """(the exit status ``python -m simplefsdp.train`` would give, what it wrote on stderr)."""
    from simplefsdp.train.__main__ import run

    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        status = run(argv)
    return status, said.getvalue()


def _csv_steps(out: Path) -> list[int]:
    with open(out / "metrics.csv") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """2 ranks, 8 steps, random target masking, a checkpoint every 2 steps (all kept)."""
    out = tmp_path_factory.mktemp("reference")
    argv = _argv(out, "--checkpoint.enable", "true", "--checkpoint.every", "2",
                 "--checkpoint.keep_latest", "0")
    return out, run_ranks(_run, 2, argv, True)[0]


def _resume_twice(rank: int, world: int, fallback: list[str], exact: list[str]) -> dict:
    # ``exact`` first: the FLOP/s probe runs once per process, on the first run.
    exact_run = _run(rank, world, exact, True)
    return {"fallback": _run(rank, world, fallback, True), "exact": exact_run}


@pytest.fixture(scope="module")
def resumed(reference, tmp_path_factory) -> dict:
    """Two resumed runs from copies of the reference's checkpoints, in one spawn of
    2 ranks: ``fallback`` with steps 8, 6 and 4 corrupted (falls back to step-2),
    ``exact`` from step-4 with the stopped run's metrics.csv up to step 5."""
    out, _ = reference
    fallback_dir, exact_dir = tmp_path_factory.mktemp("fallback"), tmp_path_factory.mktemp("exact")
    shutil.copytree(out / "ckpt", fallback_dir / "ckpt")
    _corrupt(fallback_dir / "ckpt")
    shutil.copytree(out / "ckpt" / "step-4", exact_dir / "ckpt" / "step-4")
    with open(out / "metrics.csv") as f:
        lines = f.readlines()
    (exact_dir / "metrics.csv").write_text("".join(lines[:6]))  # header + steps 1..5
    resume = ["--checkpoint.enable", "true", "--checkpoint.every", "2", "--resume"]
    runs = run_ranks(_resume_twice, 2, _argv(fallback_dir, *resume, "--checkpoint.keep_latest",
                                             "0"), _argv(exact_dir, *resume))
    return {"fallback": [r["fallback"] for r in runs], "exact": [r["exact"] for r in runs],
            "exact_dir": exact_dir}


# Start-up failures and short runs, every case in one spawn of 2 ranks (spawning is the
# slow part of these tests), each case in its own folder under ``root``.
def _startup_cases(rank: int, world: int, root: str, reference_out: str) -> dict:
    root_path, found = Path(root), {}
    # 1. lr = 1e30 is finite (accepted): step 1 applies and blows up the weights. Run
    # through `python -m simplefsdp.train`'s entry point: its exit status and message.
    found["nonfinite"] = _exit_status(_argv(
        root_path / "nan", "--training.lr", "1e30", "--training.warmup_steps", "0",
        "--checkpoint.enable", "true", "--checkpoint.every", "1",
        "--checkpoint.keep_latest", "1", steps=6))
    # 3. Packages made unimportable, as in an install without them.
    for module, extra in (("safetensors", ["--checkpoint.export_safetensors", "true"]),
                          ("numpy", ["--checkpoint.enable", "true"]),
                          ("matplotlib", [])):
        found[module] = _without(rank, world, _argv(root_path / module, *extra, steps=2),
                                 module)
    # 7. A corpus of 2 windows of 32 (+1) tokens; one global batch (2 ranks x 2) needs 4.
    corpus = root_path / "small.txt"
    if rank == 0:
        corpus.write_text("x" * 100)
    torch.distributed.barrier()
    found["dataset"] = _error(rank, world, _argv(root_path / "data", "--data.dataset",
                                                 str(corpus)))
    found.update(_write_problems(rank, world, root_path))
    found.update(_library_misuse(rank, world))
    # 9. The reference's folder again, checkpoints elsewhere (only metrics.csv in the way);
    # then --resume with fewer steps than its newest checkpoint.
    out = Path(reference_out)
    found["overwrite"] = _error(rank, world, _argv(out, "--checkpoint.enable", "true",
                                                   "--checkpoint.folder", str(root_path / "c9")))
    found["below"] = _error(rank, world, _argv(out, "--checkpoint.enable", "true", "--resume",
                                               steps=4))
    # 2. Its only checkpoint corrupt; or a checkpoint of another model.
    found["none_verifies"] = _error(rank, world, _argv(root_path / "bad", "--checkpoint.enable",
                                                       "true", "--resume"))
    found["other_model"] = _error(rank, world, _argv(out, "--checkpoint.enable", "true",
                                                     "--resume", "--model.dim", "64", steps=9))
    return found


@pytest.fixture(scope="module")
def startup(reference, tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("startup")
    out, _ = reference
    before = (out / "metrics.csv").read_bytes()
    shutil.copytree(out / "ckpt" / "step-8", root / "bad" / "ckpt" / "step-8")
    (root / "bad" / "ckpt" / "step-8" / ".metadata").write_bytes(b"\x80\x04garbage")
    found = run_ranks(_startup_cases, 2, str(root), str(out))
    assert (out / "metrics.csv").read_bytes() == before  # case 9 changed nothing
    return root, found


# 1. NaN runs continue and destroy good checkpoints. -----------------------------------
def test_non_finite_stops_the_run_and_keeps_the_good_checkpoint(startup):
    """Before: the run went on to NaN, saved NaN checkpoints and rotation (keep_latest
    = 1) deleted step-1. Now every rank stops at step 2 with exit status 3 and a line
    naming the step (README), nothing is saved from it, and step-1 stays."""
    root, found = startup
    for rank_found in found:  # README: exit status 3, naming the step
        status, said = rank_found["nonfinite"]  # said: stderr, progress bar included
        assert status == 3 and any(line.startswith("training stopped: step 2: ")
                                   for line in said.splitlines()), rank_found
    assert _saved(root / "nan" / "ckpt") == ["step-1"]
    assert [s for s, _ in list_checkpoints(root / "nan" / "ckpt")] == [1]
    assert _csv_steps(root / "nan") == [1]


def test_config_rejects_non_finite_floats(tmp_path):
    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError

    toml = tmp_path / "lr.toml"
    toml.write_text("[training]\nlr = 1e400\n")  # TOML reads this as inf
    for path, overrides in ((toml, []), (None, ["--training.lr", "inf"]),
                            (None, ["--training.max_norm", "nan"]),
                            (None, ["--model.rope_theta=-inf"])):
        with pytest.raises(ConfigError, match="expected a finite number"):
            load_config(path, overrides)


# 2. A corrupt newest checkpoint blocks resume; a corrupt one loads silently. ------------
def _corrupt(ckpt: Path) -> None:
    shard = sorted((ckpt / "step-8").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:  # 4 KB overwritten in place: same size, other bytes
        f.seek(1024)
        f.write(os.urandom(4096))
    shard = sorted((ckpt / "step-6").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    (ckpt / "step-4" / ".metadata").write_bytes(b"\x80\x04garbage")


def test_resume_falls_back_past_corrupt_checkpoints(reference, resumed):
    _, ref = reference
    fallback = resumed["fallback"]
    assert [r["start_step"] for r in fallback] == [2, 2]
    assert fallback[0]["losses"] == ref["losses"][2:]
    said = fallback[0]["stdout"]
    assert "skipping" in said and "step-8" in said and "corrupted" in said, said
    assert "step-6" in said and "truncated" in said, said
    assert "step-4" in said and ".metadata" in said, said


def test_resume_refuses_when_nothing_verifies_or_the_model_differs(startup):
    _, found = startup
    for key in ("none_verifies", "other_model"):
        assert found[0][key] == found[1][key], found
    nothing, other = found[0]["none_verifies"], found[0]["other_model"]
    assert nothing.startswith("ConfigError: --resume: none of the 1 checkpoints"), nothing
    assert "step-8: .metadata" in nothing, nothing
    assert other.startswith("ConfigError:") and "step-8 was written for a different model" \
        in other, other


# 3. Optional packages are imported at the end. -----------------------------------------
def _without(rank: int, world: int, argv: list[str], module: str):
    """Run with ``module`` made unimportable; returns the losses or the error."""
    saved = {k: v for k, v in sys.modules.items() if k == module or k.startswith(module + ".")}
    sys.modules[module] = None  # `import module` now raises ImportError
    try:
        if module == "matplotlib":
            try:
                return main(argv).losses
            except Exception as e:  # noqa: BLE001 - the test shows it
                return f"{type(e).__name__}: {e}"
        return _error(rank, world, argv)
    finally:
        del sys.modules[module]
        sys.modules.update(saved)


def test_missing_packages_fail_at_start_or_are_skipped(startup):
    root, found = startup
    for module in ("safetensors", "numpy"):
        assert found[0][module] == found[1][module], found
        message = found[0][module]
        assert message.startswith("ConfigError:") and repr(module) in message, message
        assert not (root / module / "metrics.csv").exists()  # before step 1
    # Plots are optional: the run trains, writes metrics.csv, and skips the PNGs.
    assert isinstance(found[0]["matplotlib"], list), found[0]["matplotlib"]
    assert len(found[0]["matplotlib"]) == 2 and _csv_steps(root / "matplotlib") == [1, 2]
    assert not (root / "matplotlib" / "loss.png").exists()
    with open(REPO / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    assert any(d.startswith("numpy") for d in dependencies), dependencies


# 4. Write problems appear at the first save. -------------------------------------------
def _write_problems(rank: int, world: int, root: Path) -> dict[str, str]:
    import collections

    blocker = root / "a-file"  # a folder cannot be created under a regular file
    if rank == 0:
        blocker.write_text("x")
    torch.distributed.barrier()
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.every", "2"]
    found = {
        "checkpoint": _error(rank, world, _argv(root / "c", *ckpt, "--checkpoint.folder",
                                                str(blocker / "ckpt"))),
        "metrics": _error(rank, world, _argv(blocker / "out")),
    }
    Usage = collections.namedtuple("Usage", "total used free")
    real = shutil.disk_usage
    shutil.disk_usage = lambda path: Usage(10**6, 10**6 - 1000, 1000)
    try:  # a disk with 1000 bytes free (injected): the checkpoint needs ~0.5 MB
        found["space"] = _error(rank, world, _argv(root / "s", *ckpt))
    finally:
        shutil.disk_usage = real

    from torch.distributed.checkpoint import filesystem

    write = filesystem.FileSystemWriter.write_data

    def full_disk(self, plan, planner):  # the disk fills up during the step-2 save
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return write(self, plan, planner)

    filesystem.FileSystemWriter.write_data = full_disk
    try:
        found["full"] = _error(rank, world, _argv(root / "f", *ckpt, steps=4))
    finally:
        filesystem.FileSystemWriter.write_data = write
    return found


def test_write_problems_are_found_before_training_or_cleaned_up(startup):
    root, found = startup
    for key in ("checkpoint", "metrics", "space"):  # every rank stops with the same message
        assert found[0][key] == found[1][key], found
    first = found[0]
    assert first["checkpoint"].startswith("ConfigError: checkpoint.folder"), first
    assert "not writable" in first["checkpoint"]
    assert first["metrics"].startswith("ConfigError: metrics.output_dir"), first
    assert "GiB free" in first["space"] and "checkpoint.folder" in first["space"], first
    for rank_found in found:
        assert rank_found["full"].startswith("CheckpointError: saving checkpoint"), rank_found
        assert "step-2" in rank_found["full"] and "disk is full" in rank_found["full"]
    for name in ("c", "s"):  # refused before step 1
        assert not (root / name / "metrics.csv").exists()
    assert _csv_steps(root / "f") == [1, 2]
    assert _saved(root / "f" / "ckpt") == []  # no step-2.tmp left behind


# 5. Resume is not exact with randomness. -----------------------------------------------
def test_resume_is_exact_with_a_random_batch_transform(reference, resumed):
    """Nothing draws from the RNG between restoring its state and the first step (a
    peak-FLOP/s probe with torch.randn there would change the random masking after
    resume). The metrics.csv of the
    stopped run (rows up to step 5, checkpoint at step 4) is continued, not replaced."""
    _, ref = reference
    exact = resumed["exact"][0]
    assert exact["start_step"] == 4
    assert exact["losses"] == ref["losses"][4:]
    with open(resumed["exact_dir"] / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    assert [float(r["loss"]) for r in rows[4:]] == ref["losses"][4:]  # log_every = 1


# 6. SIGTERM loses every step since the last checkpoint; .tmp leftovers stay. -------------
def test_sigterm_to_torchrun_saves_and_resume_continues_exactly(tmp_path):
    """A real 2-rank torchrun job gets SIGTERM (as a cluster preempts it) a few steps in.
    It must finish the step, save step-K, exit non-zero saying --resume; the resumed run
    must match an uninterrupted one. The warmup outlasts the run, so the LR does not
    depend on training.steps and a short reference run is the same run."""
    out = tmp_path / "job"
    common = ["--training.warmup_steps", "100000", "--training.lr", "50",
              "--checkpoint.enable", "true", "--checkpoint.every", "100000"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", "-m", "simplefsdp.train",
           *_argv(out, *common, steps=100000)]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ((out / "metrics.csv").exists() and len(_csv_steps(out)) >= 3):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        sent = time.monotonic()
        job.send_signal(signal.SIGTERM)
        said, _ = job.communicate(timeout=120)
        stop_s = time.monotonic() - sent
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    print(f"SIGTERM -> torchrun exited in {stop_s:.2f}s")
    # torchrun's own status is torch's (1: it re-raises its SignalException); the
    # workers' 128 + 15 is checked without torchrun in test_signals_exit_statuses.
    assert job.returncode != 0, said
    saved = list_checkpoints(out / "ckpt")
    assert len(saved) == 1, (saved, said)
    step = saved[0][0]
    assert f"stopped by SIGTERM after step {step}" in said and "--resume" in said, said
    assert _csv_steps(out) == list(range(1, step + 1))
    (out / "ckpt" / "step-99999.tmp").mkdir()  # a save that never finished

    total = step + 2  # the resumed run and an uninterrupted one, in one spawn
    resumed, fresh = run_ranks(_two_runs, 2, _argv(out, *common, "--resume", steps=total),
                               _argv(tmp_path / "fresh", *common, steps=total))[0]
    assert not (out / "ckpt" / "step-99999.tmp").exists()
    assert resumed["start_step"] == step
    assert resumed["losses"] == fresh["losses"][step:]


def _two_runs(rank: int, world: int, first: list[str], second: list[str]) -> tuple[dict, dict]:
    return _run(rank, world, first), _run(rank, world, second)


# 7. Data: see test_data.py for empty, tiny and binary files. ---------------------------
def test_a_corpus_smaller_than_one_global_batch_is_refused(startup):
    root, found = startup
    assert found[0]["dataset"] == found[1]["dataset"], found
    message = found[0]["dataset"]
    assert message.startswith("ConfigError: data.dataset = "), message
    assert "needs 4 windows, about 129 tokens" in message, message  # 4 * 32 + 1
    assert not (root / "data" / "metrics.csv").exists()


# 8. Library misuse fails late inside gloo / DTensor. -----------------------------------
def _library_misuse(rank: int, world: int) -> dict[str, str]:
    import simplefsdp

    mesh = simplefsdp.make_mesh(dp_shard=world)["dp_shard"]
    found = {}
    for case, build in (
            ("shapes", lambda: torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                   torch.nn.Linear(4, 4 + rank))),
            ("fsdp2", lambda: _fsdp2(torch.nn.Linear(4, 4), mesh)),
            ("ddp", lambda: torch.nn.parallel.DistributedDataParallel(
                torch.nn.Sequential(torch.nn.Linear(4, 4))))):
        try:
            simplefsdp.data_parallel(build(), mesh)
            found[case] = "no error"
        except Exception as e:  # noqa: BLE001 - the test checks which one and its message
            found[case] = f"{type(e).__name__}: {e}"
    try:
        simplefsdp.make_mesh(device_type="cuda")
        found["cuda"] = "no error"
    except Exception as e:  # noqa: BLE001
        found["cuda"] = f"{type(e).__name__}: {e}"
    return found


def _fsdp2(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh)


def test_data_parallel_misuse_is_named(startup):
    _, found = startup
    for key in ("shapes", "fsdp2", "ddp", "cuda"):
        assert found[0][key] == found[1][key], found
    got = found[0]
    assert "'1.weight' is [4, 4] float32 on rank 0 but [5, 4] float32 on rank 1" in got[
        "shapes"], got
    assert got["shapes"].startswith("ValueError: data_parallel: the model differs"), got
    assert got["fsdp2"].startswith("TypeError:") and "FSDP2" in got["fsdp2"], got
    assert got["ddp"].startswith("TypeError:") and "DDP" in got["ddp"], got
    # the ranks never see a GPU (rank_runner.HIDDEN_GPUS), on a GPU machine too
    assert got["cuda"].startswith("RuntimeError: make_mesh(device_type='cuda'), but CUDA "
                                  "is not available"), got
    usage = (REPO / "README.md").read_text().split("## Usage", 1)[1].split("```", 2)[1]
    assert "init_process_group(" in usage and "timeout=" in usage, usage


# 9. metrics.csv silently overwritten; steps below the checkpoint do nothing. -----------
def test_metrics_are_not_overwritten_and_steps_below_checkpoint_refused(startup):
    _, found = startup
    for key in ("overwrite", "below"):
        assert found[0][key] == found[1][key], found
    overwrite, below = found[0]["overwrite"], found[0]["below"]
    assert "metrics.csv holds the metrics of an earlier run" in overwrite, overwrite
    assert "--resume" in overwrite and "--metrics.output_dir" in overwrite
    assert "training.steps = 4" in below and "already at step 8" in below, below


# 10. The README's signal promises, one process each (no torchrun: the exit status is the
# training process's own), the three runs side by side. ---------------------------------
# A save that takes long (a big model): the test sends a second signal while it sleeps.
_SLOW_SAVE = """
import sys, time
from pathlib import Path
from simplefsdp.train import checkpoint
from simplefsdp.train.__main__ import run

def slow_save(self, step, wait=False):  # CheckpointManager.save's signature
    Path(sys.argv[1]).touch()
    time.sleep(600)
    raise AssertionError("the second signal did not stop the run")

checkpoint.CheckpointManager.save = slow_save
sys.exit(run(sys.argv[2:]))
"""


def _start_one_process(out: Path, marker: Path | None = None) -> subprocess.Popen:
    argv = _argv(out, "--checkpoint.enable", "true", "--checkpoint.every", "100000",
                 steps=100000)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]),
               OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)  # a world of one, as `python -m simplefsdp.train` alone
    cmd = [sys.executable, "-m", "simplefsdp.train", *argv] if marker is None else \
        [sys.executable, "-c", _SLOW_SAVE, str(marker), *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _saved_once(out: Path, said: str, name: str) -> None:
    """The run said it stopped by ``name`` after step K, saved step-K (with its manifest,
    written last) and nothing else, and logged steps 1..K."""
    import re

    found = re.search(rf"stopped by {name} after step (\d+): saved checkpoint step-(\d+)", said)
    assert found and found[1] == found[2] and "--resume" in said, said
    step = int(found[1])
    assert _saved(out / "ckpt") == [f"step-{step}"], said
    assert (out / "ckpt" / f"step-{step}" / "manifest.json").is_file()
    assert _csv_steps(out) == list(range(1, step + 1))


def test_signals_exit_statuses(tmp_path):
    """README, "Stopping": SIGTERM or SIGINT finishes the step, saves a checkpoint and
    exits with 128 + the signal number (143, 130); a second signal 2 s or more after the
    first exits at once without saving (here: with 128 + its number, while the first
    signal's save is under way). A repeat within 2 s is an echo of the same event
    (Ctrl-C reaching torchrun and the workers) and is not counted."""
    outs = {name: tmp_path / name for name in ("term", "int", "twice")}
    marker = tmp_path / "saving"
    jobs = {name: _start_one_process(out, marker if name == "twice" else None)
            for name, out in outs.items()}
    said = {}
    try:
        deadline = time.monotonic() + 300
        for name, job in jobs.items():  # one step logged: inside the training loop
            while not ((outs[name] / "metrics.csv").exists() and _csv_steps(outs[name])):
                assert job.poll() is None and time.monotonic() < deadline, job.communicate()
                time.sleep(0.05)
        jobs["term"].send_signal(signal.SIGTERM)
        jobs["int"].send_signal(signal.SIGINT)
        jobs["int"].send_signal(signal.SIGTERM)  # an echo: within 2 s, not counted
        jobs["twice"].send_signal(signal.SIGINT)
        while not marker.exists():  # the first signal's save has begun (and sleeps)
            assert jobs["twice"].poll() is None and time.monotonic() < deadline, \
                jobs["twice"].communicate()
            time.sleep(0.05)
        # README: "2 s or more after the first" (by hand, not guard.REPEAT_S); the first
        # was handled before the marker was made
        time.sleep(2.1)
        jobs["twice"].send_signal(signal.SIGTERM)
        for name, job in jobs.items():
            said[name] = job.communicate(timeout=120)[0]
    finally:
        for job in jobs.values():
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    assert jobs["term"].returncode == 143, said["term"]  # 128 + 15
    _saved_once(outs["term"], said["term"], "SIGTERM")
    assert jobs["int"].returncode == 130, said["int"]  # 128 + 2
    _saved_once(outs["int"], said["int"], "SIGINT")
    twice = said["twice"]
    assert jobs["twice"].returncode == 143, twice
    assert "second SIGTERM: stopping now, without saving" in twice, twice
    assert "stopped by" not in twice and "AssertionError" not in twice, twice
    ckpt = outs["twice"] / "ckpt"
    assert not ckpt.exists() or _saved(ckpt) == [], twice
