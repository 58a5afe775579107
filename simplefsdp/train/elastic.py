"""The process group's store under torchrun, isolated per restart round.

torchrun (``--standalone`` or the c10d rendezvous) hands its workers the agent's own
TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_ADDR``/``MASTER_PORT``), and
that store outlives a restart: torch's ``env://`` rendezvous puts every round's process
groups under the same keys (``default_pg/...``, one folder per group name, and group
names repeat from round to round). A restarted worker can therefore read the
*previous* round's gloo addresses before its peers overwrite them: it dials a dead
port (``Gloo connectFullMesh failed ... Connection refused``), or a port some other
process now holds and waits there. Measured with a bare script (init, all-reduce, one
rank SIGKILLs itself): round 1 saw the 3 keys round 0 left, and rank 0 dialled round 0's
address. :func:`round_store` puts each round under its own prefix
(``TORCHELASTIC_RESTART_COUNT``), so a round reads only its own keys;
:func:`init_distributed` starts the trainer's process group on it.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..errors import ConfigError


def restart_round() -> int:
    """torchrun's restart count for this worker group (0 for the first round, and
    outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def round_store(timeout: datetime.timedelta) -> dist.Store | None:
    """A client of torchrun's shared store, prefixed by this restart round; None when
    the store is not torchrun's agent store (``env://`` is then used as it is)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"simplefsdp/round{restart_round()}", store)


def init_distributed(device_type: str, timeout_s: float) -> bool:
    """Initialize the default process group from torchrun's environment, or a world of
    one without it; its collectives time out after ``timeout_s``. Returns True if this
    call created it (and so should destroy it)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("job.device = 'cuda' but CUDA is not available; use "
                              "--job.device cpu")
        torch.cuda.set_device(local_rank)
    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        store = round_store(timeout)  # under torchrun: this restart round's keys only
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, timeout=timeout, store=store,
                                 rank=rank if store else -1, world_size=world if store else -1)
    else:  # plain `python -m simplefsdp.train`: a world of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return True
