"""Multi-node training as docs/multi_node.md launches it, on one machine: two torchrun
agents (two "nodes") of 2 processes each meet through a c10d rendezvous on localhost and
train HSDP with 2 replicas x 2 shards. torchrun numbers a node's workers consecutively
(global rank = node rank x 2 + local rank) and the trainer's mesh puts dp_replicate
outside dp_shard, so each node holds one replica's 2 shards and the gradient all-reduce
between replicas crosses the nodes, as on a real cluster.

Reference: the same config on one node, 4 processes started by the suite's rank runner
(tests/rank_runner.py: forked from a server that has imported torch, not 4 fresh
interpreters as torchrun starts; the trainer joins the process group it finds). The two
runs build the same mesh over the same ranks and run the same collectives in the same
order, so their losses and gradient norms must be bitwise equal (no tolerance: nothing
differs but how the processes were started). The layout line is checked too: HSDP 2 x 2
could be silently replaced by FSDP 4 (the replica dim dropped) with the same mean
gradient, so equal losses alone would not show that the replica dim was there.

Also here: scripts/slurm/train.sbatch parses (``bash -n``) and its torchrun line, with
Slurm's variables filled in, passes the trainer's ``--check`` at its node count.
"""

from __future__ import annotations

import csv
import os
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from rank_runner import free_port, run_ranks

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
TIMEOUT_S = 600  # a rank that never joins fails the test instead of hanging it

# HSDP 2 x 2 on configs/debug.toml, small and short: 3 steps, a row per step.
TRAIN = ["-m", "simplefsdp.train", "--config", "configs/debug.toml",
         "--parallel.dp_mode", "hybrid_shard", "--parallel.dp_replicate", "2",
         "--parallel.dp_shard", "2", "--training.steps", "3", "--metrics.log_every", "1",
         "--training.batch_size", "2", "--training.seq_len", "64",
         "--training.warmup_steps", "1"]
LAYOUT = "dp_replicate=2 dp_shard=2 tp=1 (hybrid_shard)"


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # never look like a worker of an outer torchrun
    return env


def _torchrun(*launch: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch]


def _losses(out_dir: Path) -> list[tuple[str, str, str]]:
    """(step, loss, grad_norm) as metrics.csv writes them."""
    with open(out_dir / "metrics.csv") as f:
        return [(row["step"], row["loss"], row["grad_norm"]) for row in csv.DictReader(f)]


def _train(rank: int, world: int, out_dir: str) -> None:
    """The trainer's command line (``TRAIN``, its config by absolute path) in a rank."""
    from simplefsdp.train.__main__ import main

    args = [str(ROOT / a) if a.startswith("configs/") else a for a in TRAIN[2:]]
    main(args + ["--metrics.output_dir", out_dir])


def test_two_nodes_train_as_one_node(tmp_path, capfd):
    env = _env()
    one_node = tmp_path / "one_node"
    run_ranks(_train, 4, str(one_node))
    single = capfd.readouterr()  # rank 0 prints the layout line to this test's stdout

    two_nodes = tmp_path / "two_nodes"
    port, job = free_port(), f"test-{uuid.uuid4().hex[:8]}"
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", job]
    agents = [subprocess.Popen(_torchrun(*rendezvous)
                               + [*TRAIN, "--metrics.output_dir", str(two_nodes)],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]  # launched together: the rendezvous waits for both
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.communicate()
    for agent, said in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, said[-3000:]

    said = "".join(outputs)  # rank 0's lines are in whichever agent holds it
    assert f"world 4: pp=1 {LAYOUT}" in said, said[-3000:]
    assert f"world 4: pp=1 {LAYOUT}" in single.out + single.err
    reference, got = _losses(one_node), _losses(two_nodes)
    assert [step for step, *_ in reference] == ["1", "2", "3"], reference
    assert got == reference  # bitwise: same mesh, same collectives (module docstring)


def _sbatch_torchrun_line() -> list[str]:
    """The template's torchrun command, continuation lines joined, as words."""
    text = SBATCH.read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if re.match(r"\s*srun\s.*torchrun\s", line)]
    assert len(lines) == 1, lines
    return shlex.split(lines[0][lines[0].index("torchrun"):])


def test_slurm_template_parses_and_its_command_checks():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    text = SBATCH.read_text()
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    per_node = int(re.search(r"^GPUS_PER_NODE=\$\{GPUS_PER_NODE:-(\d+)\}$", text, re.M).group(1))
    config = re.search(r'^CONFIG=\$\{CONFIG:-(\S+)\}$', text, re.M).group(1)
    words = _sbatch_torchrun_line()
    # the rendezvous flags a multi-node launch needs, from Slurm's variables
    for flag, value in [("--nnodes", "$SLURM_JOB_NUM_NODES"),
                        ("--nproc-per-node", "$GPUS_PER_NODE"), ("--rdzv-backend", "c10d"),
                        ("--rdzv-endpoint", "$HEAD_NODE:$PORT"), ("--rdzv-id", "$SLURM_JOB_ID")]:
        assert words[words.index(flag) + 1] == value, (flag, words)
    args = words[words.index("simplefsdp.train") + 1:]
    args = [config if a == "$CONFIG" else a for a in args if a != "$@"]
    assert not [a for a in args if a.startswith("$")], args  # every variable accounted for
    check = subprocess.run(
        [sys.executable, "-m", "simplefsdp.train", "--check", "--world-size",
         str(nodes * per_node), *args, "--metrics.output_dir", "/nonexistent/sbatch-check"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert f"configuration ok for {nodes * per_node} processes" in check.stdout
