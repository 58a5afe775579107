"""Local networking helpers shared by the benchmark's launcher and the tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a local rendezvous (the benchmark's
    spawned ranks, the tests' rank runner)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
