"""What a newcomer sees (issue 32): usage lines, the end-of-run lines, configuration
errors (once, exit 78, the world size before the model's shapes, ``--check``), the
header before the progress bar, the note on the first compiled step, torch's warning
about our checkpointed regions, pip's root warning in the scripts, memory.png's axis.

Expectations are literal strings, the trainer's own files (metrics.csv, the checkpoint
folder), per-step losses the run returns, or hand counts (the debug model's parameter
tensors); no tolerance is needed anywhere: the lines print the very floats the files
hold, to 4 decimals, and the losses are compared after the same rounding.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rank_runner import run_ranks

from simplefsdp.config.job import parse_args
from simplefsdp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIG_ERROR_EXIT = 78  # sysexits.h EX_CONFIG, as the README documents

# A small Llama (as tests/test_trainer.py): 2 blocks of dim 32; n_kv_heads = 2.
SMALL = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--training.seq_len", "32", "--training.batch_size", "2",
         "--training.warmup_steps", "1"]


# ------------------------------------------------------------------------ usage lines
def _first_line(fn, argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        fn(argv)
    return out.getvalue().splitlines()[0]


def test_usage_lines_name_the_program():
    from simplefsdp.bench.__main__ import main as bench_main
    from simplefsdp.plan.__main__ import main as plan_main
    from simplefsdp.train.__main__ import main as train_main

    assert _first_line(train_main, ["--help"]).startswith(
        "usage: python -m simplefsdp.train [--config FILE.toml]")
    assert _first_line(bench_main, ["--help"]).startswith(
        "usage: python -m simplefsdp.bench [--config FILE.toml]")
    assert _first_line(plan_main, ["--help"]).startswith("usage: python -m simplefsdp.plan ")


# ---------------------------------------------------------- configuration errors, --check
def test_world_size_is_checked_before_the_head_count(monkeypatch):
    from simplefsdp.train.__main__ import main

    # tp 4 on 2 processes: the sizes cannot fill the world; that is said first ...
    with pytest.raises(ConfigError, match=r"^world size 2 is not divisible by .* = 4;"):
        parse_args(["--parallel.tp", "4"], world_size=2)
    # ... and by the command line under torchrun's environment (before any process group)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^world size 2 is not divisible"):
        main(["--parallel.tp", "4"])
    # on 4 processes the sizes fit, and the head count is the problem
    with pytest.raises(ConfigError, match=r"^parallel.tp = 4 does not divide "
                                          r"model.n_kv_heads = 2$"):
        parse_args(["--parallel.tp", "4"], world_size=4)
    with pytest.raises(ConfigError, match=r"^world size 3 is not divisible"):
        main(["--check", "--world-size", "3", "--parallel.tp", "2"])


def test_config_error_printed_once_with_its_own_exit_status(monkeypatch, tmp_path, capsys):
    from simplefsdp.train.__main__ import run

    bad = ["--config", str(ROOT / "configs" / "debug.toml"), "--parallel.tp", "4"]
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("LOCAL_RANK", "1")  # not the first local rank: silent
    assert run(["--check", "--world-size", "4", *bad]) == CONFIG_ERROR_EXIT
    assert capsys.readouterr().err == ""
    said = json.loads(error_file.read_text())["message"]
    assert said["message"] == ("configuration error: parallel.tp = 4 does not divide "
                               "model.n_kv_heads = 2")
    assert said["extraInfo"]["py_callstack"].startswith(said["message"] + "\n")

    monkeypatch.setenv("LOCAL_RANK", "0")
    assert run(["--check", "--world-size", "4", *bad]) == CONFIG_ERROR_EXIT
    assert capsys.readouterr().err == ("configuration error: parallel.tp = 4 does not divide "
                                       "model.n_kv_heads = 2\n(nothing was trained; exit "
                                       "status 78)\n")
    # a run (no --check; one process: no torchrun environment) also points at --check
    monkeypatch.delenv("RANK", raising=False)
    assert run(bad) == CONFIG_ERROR_EXIT
    assert capsys.readouterr().err == (
        "configuration error: world size 1 is not divisible by parallel.pp * "
        "parallel.dp_replicate * parallel.tp = 1 * 1 * 4 = 4; change those sizes or the "
        "number of processes\n(nothing was trained; exit status 78. Check a config without "
        "launching: python -m simplefsdp.train --check --world-size N --config ...)\n")

    # a good config: one line, status 0, nothing launched or written
    out_dir = tmp_path / "never-written"
    assert run(["--check", "--world-size", "4", "--parallel.tp", "2",
                "--metrics.output_dir", str(out_dir)]) == 0
    assert capsys.readouterr().out == (
        f"[simplefsdp] configuration ok for 4 processes: pp=1 dp_replicate=1 dp_shard=2 "
        f"tp=2 (fully_shard), ac=none, compile=False, steps 200, outputs in {out_dir}/\n")
    assert not out_dir.exists()
    # an earlier run's metrics.csv there: refused by --check as by the run
    out_dir.mkdir()
    (out_dir / "metrics.csv").write_text("step,loss\n1,5.0\n")
    assert run(["--check", "--metrics.output_dir", str(out_dir)]) == CONFIG_ERROR_EXIT
    assert "holds the metrics of an earlier run" in capsys.readouterr().err
    # --world-size alone is not a run's option
    assert run(["--world-size", "2"]) == CONFIG_ERROR_EXIT
    assert "--world-size goes with --check" in capsys.readouterr().err


def test_config_error_under_torchrun_is_said_once_and_last(tmp_path):
    """The one torchrun here: 2 processes, a config they cannot run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "simplefsdp.train", "--config", str(ROOT / "configs" / "debug.toml"),
         "--parallel.tp", "4", "--metrics.output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    said = job.stdout + job.stderr
    assert job.returncode != 0, said  # torchrun's own status is 1 whatever its workers say
    ours = "configuration error: world size 2 is not divisible by parallel.pp * "
    # printed once by the first local rank; torchrun's report repeats it from the error
    # files, for the root cause (and for a rank it stopped after the file was written)
    printed = [line for line in job.stderr.splitlines() if line.startswith(ours)]
    assert len(printed) == 1, said
    assert f"exitcode  : {CONFIG_ERROR_EXIT}" in said, said
    tail = [line for line in job.stderr.splitlines() if line.strip()][-6:]
    root = tail[tail.index("Root Cause (first observed failure):"):] if \
        "Root Cause (first observed failure):" in tail else tail
    assert any(ours in line for line in root), tail
    assert not (tmp_path / "out").exists()  # nothing was trained or written


# --------------------------------------------------------------- the end-of-run lines
def _train_and_capture(rank: int, world: int, argv: list[str]) -> dict:
    from simplefsdp.train.__main__ import main

    said = io.StringIO()  # stdout and stderr (tqdm's bar) in the order they were written
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        result = main(argv)
    return {"said": said.getvalue(), "losses": result.losses}


def test_end_of_run_lines_say_which_loss_and_where_outputs_went(tmp_path):
    out = tmp_path / "out"
    argv = [*SMALL, "--training.steps", "5", "--metrics.log_every", "3",
            "--metrics.output_dir", str(out), "--checkpoint.enable", "true",
            "--checkpoint.every", "4", "--checkpoint.export_safetensors", "true"]
    ran = run_ranks(_train_and_capture, 2, argv)
    said, losses = ran[0]["said"], ran[0]["losses"]
    assert ran[1]["said"].count("[simplefsdp]") == 0  # rank 1 prints nothing of ours
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [3, 5]
    # the last row's loss is the mean of the global losses of steps 4 and 5 (since the
    # previous row; the step-4 checkpoint in between does not cut the window)
    assert f"{float(rows[-1]['loss']):.4f}" == f"{(losses[3] + losses[4]) / 2:.4f}"
    done, where = said.splitlines()[-2:]
    assert re.fullmatch(
        rf"\[simplefsdp\] done: steps 0->5 in [0-9.]+ s, loss {float(rows[-1]['loss']):.4f} "
        rf"\(mean of steps 4-5, as in metrics\.csv and the progress bar; step 5 alone: "
        rf"{losses[-1]:.4f}\), {float(rows[-1]['tokens_per_s']):.0f} tokens/s", done), done
    listed = where.removeprefix("[simplefsdp] outputs: ").split(", ")
    assert listed == [str(out / "metrics.csv"), str(out / "loss.png"), str(out / "memory.png"),
                      str(out / "model.safetensors"), str(out / "checkpoints" / "step-5")]
    assert all(Path(p).exists() for p in listed)
    # the header line is a line of its own, before the progress bar's first frame
    header = next(i for i, line in enumerate(said.splitlines())
                  if line.startswith("[simplefsdp] ") and "params, world 2" in line)
    assert said.index("train:") > said.index(said.splitlines()[header])


# ------------------------------------------------------------ compiled runs: the note
def _compiled_twice(rank: int, world: int, argv: list[str], cache: str) -> list[str]:
    os.environ["SIMPLEFSDP_CACHE_DIR"] = cache  # no plans in it: the first run decides
    from simplefsdp.compiler.cost import drift
    from simplefsdp.train.__main__ import main

    # one calibration for both runs: the start-up probe's verdict pinned to "holds" (on a
    # loaded host it may legitimately recalibrate between the runs, which changes the plan
    # cache's key and turns the second run's hit into a miss; test_calibration_probe.py
    # tests the probe itself)
    drift.disagreements = lambda *args, **kwargs: []

    said = []
    for run in ("first", "second"):
        text = io.StringIO()
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            main([*argv, "--metrics.output_dir", f"{cache}/{run}"])
        said.append(text.getvalue())
    return said


def test_compiled_first_step_says_it_compiles_and_what_auto_wrapping_chose(tmp_path):
    from simplefsdp.compiler.cost.comm import cache_dir

    # Speed only: the link calibrations this machine already has (never its plans).
    for calibration in cache_dir().glob("comm_model_*.json"):
        shutil.copy(calibration, tmp_path)
    argv = [*SMALL, "--model.n_layers", "1", "--training.steps", "1",
            "--compile.enable", "true", "--compile.backend", "aot_eager",
            "--compile.bucketing", "auto"]
    first, second = run_ranks(_compiled_twice, 2, argv, str(tmp_path))[0]
    for said in (first, second):
        lines = said.splitlines()
        compiling = lines.index("[simplefsdp] step 1 compiles the model (torch.compile, "
                                "aot_eager, bucketing auto): expect it to take a while (a "
                                "minute or more on CPU); later steps reuse the compiled graphs")
        assert said.index("train:") > said.index(lines[compiling])  # before the bar
        assert "Detected that context_fn" not in said
    # The forward gathers each of the 12 parameter tensors once (embedding, 9 in the one
    # block, norm, output); the plan is decided by the first run, read by the second.
    note = r"\[simplefsdp\] step 1 compiled and ran in [0-9.]+ s \(bucketing auto\): "
    graph = (r"{} (\d+) collectives -> (\d+) buckets?, predicted exposed communication "
             r"[0-9.]+ ms, {}")
    miss = "plan decided now and cached for the next run \\(miss\\)"
    hit = "plan from the plan cache \\(hit\\)"
    for said, cache in ((first, miss), (second, hit)):
        found = re.search(note + graph.format("forward", cache) + "; " +
                          graph.format("backward", cache), said)
        assert found, said
        assert int(found[1]) == 12 and 1 <= int(found[2]) <= 12
        assert 1 <= int(found[4]) <= int(found[3])


# ------------------------------------------- torch's warning about our checkpointed regions
def _checkpoint_warnings(rank: int, world: int) -> dict[str, int]:
    """How often torch's context_fn warning got through, per kind of region."""
    import torch
    from torch._logging._internal import warning_once
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    import simplefsdp as sf
    from simplefsdp.parallel.activation_checkpoint import quiet_our_checkpoint_warning

    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            if "Detected that context_fn is passed" in record.getMessage():
                seen.append(record.getMessage())

    logging.getLogger("torch._higher_order_ops.wrap").addHandler(Catch())
    quiet_our_checkpoint_warning()
    counts = {}

    def count(name: str, fn) -> None:
        warning_once.cache_clear()  # torch says it once per process; once per region here
        torch._dynamo.reset()
        before = len(seen)
        fn()
        counts[name] = len(seen) - before

    mesh = sf.make_mesh(dp_shard=world, device_type="cpu")
    model = torch.compile(sf.data_parallel(torch.nn.Linear(4, 4), mesh), backend="aot_eager",
                          fullgraph=True)
    count("our gather", lambda: model(torch.randn(2, 4)).sum().backward())

    gather_mod = sys.modules["simplefsdp.data_parallel"]

    def region(context_fn, in_place: bool):
        def body(x):
            y = x.sin()
            if in_place:
                y.relu_()
            return y * 2

        @torch.compile(backend="aot_eager", fullgraph=True)
        def run(x):
            return checkpoint(body, x, use_reentrant=False, context_fn=context_fn)

        return lambda: run(torch.randn(4, requires_grad=True)).sum().backward()

    def theirs():
        return create_selective_checkpoint_contexts(lambda *a, **k: None)

    count("ours, in place", region(gather_mod._gather_policy_contexts, True))
    count("theirs", region(theirs, False))
    return counts


def test_torch_warning_silenced_only_for_our_regions():
    counts = run_ranks(_checkpoint_warnings, 1)[0]
    assert counts == {"our gather": 0, "ours, in place": 1, "theirs": 1}, counts


# ------------------------------------------------------------------- scripts, plots
def test_scripts_filter_pips_root_warning_as_pip_says_it():
    """The scripts' filter drops the warning as this pip writes it (its own source)."""
    import inspect

    from pip._internal.cli import req_command

    source = inspect.getsource(req_command)
    start = source.index('"Running pip as the')
    text = "".join(re.findall(r'"([^"]*)"', source[start:source.index(")", start)]))
    warning = f"WARNING: {text}"
    assert warning.startswith("WARNING: Running pip as the 'root' user can result in")
    body = (ROOT / "scripts" / "pip.sh").read_text()  # quiet_pip, sourced by both scripts
    grep = [line for line in body.splitlines() if "grep -v" in line]
    assert len(grep) == 1
    words = shlex.split(grep[0][grep[0].index("grep -v"):].split("||")[0])
    kept = subprocess.run(words, input=f"{warning}\n\nreal output\n",
                          capture_output=True, text=True).stdout
    assert kept == "real output\n", kept
    assert "PIP_ROOT_USER_ACTION=ignore" in body
    for script in ("train.sh", "test.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert "source scripts/pip.sh" in text and "quiet_pip -e" in text, script


def test_memory_plot_starts_at_zero(tmp_path, monkeypatch):
    import matplotlib.figure
    import torch

    from simplefsdp.train.metrics import MetricsLogger

    limits = {}

    def keep_limits(fig, path, **kwargs):
        limits[Path(path).name] = fig.axes[0].get_ylim()

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep_limits)
    logger = MetricsLogger(tmp_path, rank=0, world=1, device=torch.device("cpu"),
                           flops_per_token=1.0, tokens_per_step=1, total_steps=2,
                           progress=False)
    logger.rows = [{"step": 1, "loss": 5.0, "max_rss_gib": 0.4285},
                   {"step": 2, "loss": 4.0, "max_rss_gib": 0.436}]
    logger.plot()
    bottom, top = limits["memory.png"]
    assert bottom == 0 and 0.436 < top <= 0.436 * 1.1
    assert limits["loss.png"][0] > 3.9  # the loss keeps its own range
