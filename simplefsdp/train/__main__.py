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

from ..errors import ConfigError
from .checkpoint import CheckpointError
from .guard import NonFiniteError, Preempted
from .trainer import main

# Exit statuses of a known failure (README, "Training"): a configuration error is 78,
# sysexits.h's EX_CONFIG, which no other failure here (Python's 1, a usage error's 2,
# a signal's 128 + N) shares.
CONFIG_ERROR = 78
NON_FINITE = 3
CHECKPOINT_ERROR = 4


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
