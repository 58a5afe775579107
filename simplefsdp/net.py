"""Local networking helpers shared by the benchmark's launchers, the calibration CLI and
the tests: a rendezvous for ranks this process starts on this machine."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def host_store(world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """A store server on 127.0.0.1 for ``world_size`` local ranks, on a port the OS picks
    as it binds (a port found free and bound later could be taken meanwhile); ``.port``
    is for the ranks' :func:`join_local_group`. Keep the object alive until every rank
    has exited: dropping it stops the server."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timeout)


def join_local_group(backend: str, port: int, rank: int, world_size: int,
                     timeout: datetime.timedelta) -> None:
    """Join the default process group through the store :func:`host_store` serves on
    ``port``; sets ``MASTER_ADDR``/``MASTER_PORT`` too, for code that reads them."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
