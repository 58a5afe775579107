"""Kill ranks of a torchrun job at random moments; every run must recover exactly.

    python scripts/fault_injection.py --runs 10 --kills 2     # 20 kills, ~30 min on 2 cores

Runs the debug config (``configs/debug.toml``, ``--training.steps 50``, a checkpoint
every 10 steps and a metrics row every 10 (a row is the mean since the previous one,
so rows must start where a resume can), ``--resume``) under ``torchrun --standalone
--nproc_per_node=2 --max-restarts=K``, with ``SIMPLEFSDP_FAULT``
(``simplefsdp/train/faults.py``) naming K kills: a random rank SIGKILLs itself in a
random phase (forward, backward, optimizer, a checkpoint's write, its manifest) of a
random step, one kill per restart round, each later than the one before. Even runs
save synchronously, odd ones with
``checkpoint.async_mode = "async"``. A run passes when torchrun exits 0 within
``--timeout`` (else: a hang), every round resumed from the newest verified checkpoint
at its kill (the largest multiple of 10 below the step; with async saves, one earlier
when the kill comes in the step right after a save, whose write is completed at that
step's end), and metrics.csv's step/loss/grad_norm/lr columns equal an uninterrupted
run's, as text (bitwise floats). Prints a table (also written to
``<out>/fault_table.md``) and exits 1 if any run failed. Not part of CI.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("forward", "backward", "optimizer", "save", "manifest")


def torchrun(out: Path, steps: int, every: int, restarts: int, faults: str, mode: str,
             timeout: float) -> tuple[int | None, str]:
    """(exit status or None after ``timeout``, everything the job printed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]),
               OMP_NUM_THREADS="1", SIMPLEFSDP_FAULT=faults)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", f"--max-restarts={restarts}", "-m", "simplefsdp.train",
           "--config", str(REPO / "configs" / "debug.toml"), "--training.steps", str(steps),
           "--checkpoint.enable", "true", "--checkpoint.every", str(every),
           "--checkpoint.async_mode", mode, "--metrics.log_every", str(every),
           "--metrics.output_dir", str(out), "--resume"]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        said, _ = job.communicate(timeout=timeout)
        return job.returncode, said
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, 9)
        return None, job.communicate()[0]


def rows(out: Path) -> list[tuple[str, ...]]:
    try:
        with open(out / "metrics.csv", newline="") as f:
            return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in csv.DictReader(f)]
    except OSError:
        return []


def plan(rng: random.Random, kills: int, steps: int, every: int) -> list[tuple[str, int, int]]:
    """``kills`` (phase, step, rank), steps strictly increasing."""
    faults, last = [], 1
    for _ in range(kills):
        phase = rng.choice(PHASES)
        if phase in ("save", "manifest"):
            options = [s for s in range(every, steps + 1, every) if s > last]
        else:
            options = list(range(last + 1, steps + 1))
        if not options:
            break
        step = rng.choice(options[: max(1, len(options) // (kills - len(faults)))])
        faults.append((phase, step, rng.randrange(2)))
        last = step
    return faults


def expected_resume(phase: str, step: int, every: int, mode: str) -> int:
    newest = (step - 1) // every * every  # saves strictly before this step
    if mode != "sync" and phase in ("forward", "backward", "optimizer") and \
            newest and step == newest + 1:
        newest -= every  # step ``newest``'s async write completes at this step's end
    return newest


def resumed_from(said: str) -> list[int]:
    points = []
    for line in said.splitlines():
        if "resumed from " in line:
            points.append(int(line.split("resumed from ")[1].split("(step ")[1].split(")")[0]))
        elif "no complete checkpoint in" in line and "starting from step 0" in line:
            points.append(0)
    return points[1:]  # round 0 starts afresh


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--kills", type=int, default=2, help="kills (restarts) per run")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds: a hang")
    parser.add_argument("--out", type=Path, default=Path("outputs/fault_injection"))
    a = parser.parse_args()
    rng = random.Random(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    ref = a.out / "reference"
    if not rows(ref):
        status, said = torchrun(ref, a.steps, a.every, 0, "", "sync", a.timeout)
        if status != 0:
            print(said[-3000:])
            print("the uninterrupted reference run failed")
            return 1
    want = rows(ref)
    table = ["| run | save mode | kill | rank | phase | step | resumed from (expected) | "
             "outcome |", "|---|---|---|---|---|---|---|---|"]
    failed = 0
    for run in range(a.runs):
        mode = "sync" if run % 2 == 0 else "async"
        faults = plan(rng, a.kills, a.steps, a.every)
        spec = ",".join(f"{p}:{s}:{r}" for p, s, r in faults)
        out = a.out / f"run{run:02d}"
        started = time.monotonic()
        status, said = torchrun(out, a.steps, a.every, len(faults), spec, mode, a.timeout)
        (a.out / f"run{run:02d}.log").write_text(said)
        got = resumed_from(said)
        expect = [expected_resume(p, s, a.every, mode) for p, s, _ in faults]
        fired = [f"at {p} of step {s} (restart round {i})" in said
                 for i, (p, s, _) in enumerate(faults)]
        outcome = ("HANG" if status is None else f"exit {status}" if status else
                   "not killed" if not all(fired) else
                   "wrong resume point" if got != expect else
                   "METRICS DIFFER" if rows(out) != want else "ok")
        failed += outcome != "ok"
        for i, (phase, step, rank) in enumerate(faults):
            point = got[i] if i < len(got) else "-"
            table.append(f"| {run} | {mode} | {i + 1} | {rank} | {phase} | {step} | "
                         f"{point} ({expect[i]}) | {outcome} |")
        print(f"run {run} ({mode}, {spec}): {outcome} in {time.monotonic() - started:.0f} s",
              flush=True)
    text = "\n".join(table)
    (a.out / "fault_table.md").write_text(text + "\n")
    print(text)
    kills = sum(1 for line in table[2:])
    print(f"{a.runs} runs, {kills} kills: {failed} runs failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
