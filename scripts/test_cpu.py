"""Run pytest and print the CPU seconds of the whole process tree, rank processes included.

    python scripts/test_cpu.py tests/test_composition.py -q --durations=15
    python scripts/test_cpu.py -m quick -q -n 2 --dist loadgroup   # as scripts/test.sh

``/usr/bin/time pytest ...`` undercounts a multi-rank test: rank processes are forked
by multiprocessing's forkserver (tests/rank_runner.py), which reaps them, and Python 3.11
leaves the server running when pytest exits, so no one waits for it and its children's
CPU time is lost to the measurement. This runs pytest in-process; every pytest process
stops its server at the end of its session (tests/conftest.py, closing its "alive" pipe
and waiting for it), so that the ranks' time is counted (pytest-xdist workers are this
process's children, waited for), and it prints one line: wall seconds, and user +
system CPU seconds of this process and every descendant that was waited for. The exit
status is pytest's.
"""

from __future__ import annotations

import resource
import sys
import time


def _cpu_seconds() -> tuple[float, float]:
    """(user, system) seconds of this process plus its waited-for descendants."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + children.ru_utime, own.ru_stime + children.ru_stime


def main(argv: list[str]) -> int:
    import pytest

    start = time.monotonic()
    status = pytest.main(argv)
    user, system = _cpu_seconds()
    print(f"[test_cpu] {time.monotonic() - start:.1f} s wall, {user:.1f} s user, "
          f"{system:.1f} s sys, {user + system:.1f} CPU-s (process tree, ranks included)",
          flush=True)
    return int(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
