"""``python -m simplefsdp.train --config configs/debug.toml [--section.key value ...]``

One process (no torchrun):   python -m simplefsdp.train --config configs/debug.toml
Check a config for N processes, launching nothing (exit 0, or 78 and the error):
                             python -m simplefsdp.train --check --world-size N --config ...
One node, N processes:       torchrun --standalone --nproc_per_node=N \\
                                 -m simplefsdp.train --config configs/debug.toml
Checkpoints: ``--checkpoint.enable true``; add ``--resume`` to continue from the newest
checkpoint in ``checkpoint.folder`` that verifies (without it, a folder that already
holds one is refused; see ``checkpoint.py``). SIGTERM/SIGINT: the current step
finishes, a checkpoint is saved (when enabled) and the run exits with 128 + the signal
number, saying where to resume from; a second signal stops at once.

Multi-node (NCCL), e.g. 2 nodes x 8 GPUs, the same command on every node:

    torchrun --nnodes=2 --nproc_per_node=8 \\
        --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE_IP:29500 --rdzv_id=$JOB_ID \\
        -m simplefsdp.train --config configs/llama3_70b.toml --job.device cuda

  --rdzv_endpoint   host:port of one node that every node can reach (the c10d store)
  --rdzv_id         any string shared by the nodes of one job (e.g. the scheduler's job id)
  --nnodes=MIN:MAX  elastic range; add --max_restarts=K to restart failed workers
  (or the static form: --nnodes=2 --node_rank=R --master_addr=HEAD --master_port=29500)

Useful environment for NCCL: NCCL_SOCKET_IFNAME=<iface> (e.g. eth0 / ib0) when the
default interface is wrong, NCCL_IB_HCA / NCCL_IB_DISABLE=1 for InfiniBand selection,
NCCL_DEBUG=INFO to see the chosen transports, TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (the
default) so a hung collective aborts after the process-group timeout
(SIMPLEFSDP_PG_TIMEOUT_S, default 600 s) instead of waiting forever.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

from ..config.job import ALIASES, JobConfig, config_help, parse_args
from ..config.reader import explicit_keys, split_argv
from ..corpus.text import Tokenizer
from ..errors import ConfigError
from . import preflight
from .checkpoint import CheckpointError, checkpoint_dir, resume_point
from .guard import NonFiniteError, Preempted
from .run import TrainResult
from .trainer import BatchTransform, fingerprint, resolved, train

# Exit statuses of a known failure (README, "Training"): a configuration error is 78,
# sysexits.h's EX_CONFIG, which no other failure here (Python's 1, a usage error's 2,
# a signal's 128 + N) shares.
CONFIG_ERROR = 78
NON_FINITE = 3
CHECKPOINT_ERROR = 4
# Under torchrun, how long the ranks that do not print a configuration error wait before
# exiting, so that the one that prints it is not stopped first.
PRINTER_HEAD_START_S = 2.0


def main(argv: list[str] | None = None,
         batch_transform: BatchTransform | None = None,
         tokenizer: Tokenizer | None = None) -> TrainResult | None:
    """``python -m simplefsdp.train [--config FILE] [--section.key value ...]``; with
    ``--check [--world-size N]``, validate the config for N processes and return None."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(config_help())
        return None
    check, world_size, argv = _check_flags(argv)
    if check:
        check_config(argv, world_size)
        return None
    cfg = parse_args(argv, _launched_world())
    return train(cfg, batch_transform, tokenizer, explicit_keys(*split_argv(argv, ALIASES)))


def _launched_world() -> int:
    """The number of processes this run has: the process group's, torchrun's, or 1."""
    if dist.is_initialized():
        return dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


def _check_flags(argv: list[str]) -> tuple[bool, int, list[str]]:
    """``--check`` and ``--world-size N`` taken out of ``argv``."""
    check, world, rest, i = False, None, [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name == "--check":
            check = True
        elif name == "--world-size":
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError("--world-size needs a number of processes")
                value, i = argv[i + 1], i + 1
            world = _world_size(value)
        else:
            rest.append(argv[i])
        i += 1
    if world is not None and not check:
        raise ConfigError("--world-size goes with --check; a run's world size is its "
                          "number of processes (torchrun --nproc_per_node)")
    return check, world if world is not None else _launched_world(), rest


def _world_size(value: str) -> int:
    try:
        world = int(value)
    except ValueError:
        raise ConfigError(f"--world-size {value!r}: expected a number of "
                          f"processes") from None
    if world < 1:
        raise ConfigError(f"--world-size {world}: expected at least 1 process")
    return world


def check_config(argv: list[str], world_size: int) -> JobConfig:
    """``--check``: read and validate the config for ``world_size`` processes without
    launching anything: keys, types, ranges, the parallel sizes against the world, the
    model's shapes, the packages it needs, and an earlier run's metrics or checkpoints
    in the output folders. Prints one line and returns the config (sizes resolved);
    raises a ConfigError naming the first problem found."""
    cfg = resolved(parse_args(argv, world_size), world_size)
    p = cfg.parallel
    problems = preflight.missing_packages(cfg)
    problems += [q for q in [preflight.overwrites_metrics(cfg)] if q]
    if problems:
        raise ConfigError("; ".join(problems))
    if cfg.checkpoint.enable:
        folder = checkpoint_dir(cfg.checkpoint.folder, cfg.metrics.output_dir)
        resume_point(folder, cfg.checkpoint.resume, fingerprint(cfg))
    print(f"[simplefsdp] configuration ok for {world_size} process"
          f"{'es' if world_size > 1 else ''}: pp={p.pp} dp_replicate={p.dp_replicate} "
          f"dp_shard={p.dp_shard} tp={p.tp} {f'ep={p.ep} ' if p.ep > 1 else ''}"
          f"({p.dp_mode}), "
          f"ac={cfg.activation_checkpoint.mode}, compile={cfg.compile.enable}, "
          f"steps {cfg.training.steps}, outputs in {cfg.metrics.output_dir}/", flush=True)
    if p.layout == "auto":
        print("[simplefsdp] parallel.layout = 'auto': the layout keys you did not set are "
              "chosen when the run starts (python -m simplefsdp.plan --auto --gpus N "
              "--config ... shows the choice)", flush=True)
    return cfg


def run(argv: list[str]) -> int:
    """Train; a known failure prints one line on stderr and gives its exit status:
    78 configuration error (nothing was trained), 3 non-finite loss/gradients,
    4 checkpoint I/O, 128 + signal number after a SIGTERM/SIGINT stop (checkpoint saved
    if enabled). ``--check`` validates the config and exits (0 if it is good)."""
    try:
        main(argv)
    except ConfigError as e:
        return configuration_error(e, hint="--check" not in argv)
    except NonFiniteError as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return NON_FINITE
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return CHECKPOINT_ERROR
    except Preempted as e:
        print(f"[simplefsdp] {e}", file=sys.stderr)
        return 128 + e.signum
    return 0


def configuration_error(error: ConfigError, hint: bool = True) -> int:
    """Report a configuration error once and return its exit status.

    Every rank finds the same error (the config is read alike everywhere), so only the
    first local rank prints it. Under torchrun each rank also leaves it in its error file
    (``TORCHELASTIC_ERROR_FILE``), which torchrun shows as the failure's "traceback" at
    the end of its ``ChildFailedError`` report: its last lines say what went wrong."""
    check = (". Check a config without launching: python -m simplefsdp.train --check "
             "--world-size N --config ...") if hint else ""
    message = (f"configuration error: {error}\n(nothing was trained; exit status "
               f"{CONFIG_ERROR}{check})")
    _leave_for_torchrun(message)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)
    elif "TORCHELASTIC_ERROR_FILE" in os.environ:
        # torchrun stops the other workers once one exits: the printing rank gets a head
        # start (on a loaded host it was stopped before it printed)
        time.sleep(PRINTER_HEAD_START_S)
    return CONFIG_ERROR


def _leave_for_torchrun(message: str) -> None:
    """Write ``message`` where torchrun's elastic agent reads a worker's failure (the
    JSON layout of ``torch.distributed.elastic``'s error handler)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message.splitlines()[0],
                        "extraInfo": {"py_callstack": message,
                                      "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the message is on stderr all the same


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
