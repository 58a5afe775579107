"""A hang that explains itself: stack dumps on every rank, then a failure naming them.

The training thread marks where it is (:func:`phase`: the step and the phase or
collective it entered, e.g. ``step 7: grad-norm all-reduce``). A watchdog thread per
rank checks every ``POLL_S``: once one phase has lasted longer than
``training.hang_watchdog_s`` (default 180 s, well under the process-group timeout of
``SIMPLEFSDP_PG_TIMEOUT_S``, 600 s), it announces the hang through the rendezvous store
(a key every rank's watchdog polls: a collective would wait behind the hung one), and
every rank then writes its Python stacks (``faulthandler``, all threads) to stderr and
to ``<metrics.output_dir>/hang-rank<r>.txt``, headed by the step and the phase, and
exits with status ``HANG_EXIT`` and a message pointing at the files. On CUDA, NCCL's
flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``, e.g. 2000) adds the collectives each
rank issued, dumped to ``hang-rank<r>.nccl.pkl`` when it is on.

Start-up (building, loading, resuming), a run's first step (it absorbs the ranks'
start-up skew, and compiles: possibly minutes) and checkpoint writes have no limit of
their own (their length is not a hang): the process-group timeout bounds them. When a
collective times out there (or anywhere), the rank that got the error announces it the
same way before failing, so every rank's stacks are written then too.
"""

from __future__ import annotations

import faulthandler
import math
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .._torch_compat import collective_timed_out, default_store, nccl_flight_recorder

POLL_S = 0.5
JOIN_S = 30.0  # the store's own calls time out well before
HANG_EXIT = 5
_KEY = "simplefsdp/hang"

_active: Watchdog | None = None


def phase(name: str, step: int | None = None, limit_s: float | None = None) -> None:
    """Record that this rank entered ``name`` (of ``step``: default the current one);
    ``limit_s`` replaces the watchdog's limit from this phase to the step's end. A no-op
    without a watchdog."""
    if _active is not None:
        _active.enter(name, step, limit_s)


class Watchdog:
    """Context manager: the watchdog thread of this rank while the loop runs."""

    def __init__(self, limit_s: float, output_dir: str | Path, rank: int):
        self.limit_s, self.rank = limit_s, rank
        self.folder = Path(output_dir)
        # start-up has no limit of its own (see the module doc); step 1 sets its own
        self.step, self.name, self.phase_limit = 0, "start-up", math.inf
        self.since = time.monotonic()
        self._stop = threading.Event()
        self._dumping = threading.Lock()  # one dump per rank: the thread's or the loop's
        self._thread: threading.Thread | None = None
        self._store = _store()

    def enter(self, name: str, step: int | None, limit_s: float | None) -> None:
        """A longer ``limit_s`` holds for the rest of its step (e.g. the compiling step)."""
        if step is not None and step != self.step:
            self.step, self.phase_limit = step, None
        if limit_s is not None:
            self.phase_limit = limit_s
        self.name, self.since = name, time.monotonic()

    def __enter__(self) -> Watchdog:
        global _active
        if self.limit_s > 0:
            _active = self
            self._thread = threading.Thread(target=self._watch, name="simplefsdp-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _active
        if self._thread is not None and exc is not None and collective_timed_out(exc):
            self._dump(time.monotonic() - self.since, None, cause=exc)
        _active = None
        self._stop.set()
        if self._thread is not None:
            # Wait out a store call in flight: a daemon thread still inside C++ (the GIL
            # released) when the interpreter exits aborts the process ("terminate called
            # without an active exception"), i.e. a finished run exits with SIGABRT.
            self._thread.join(timeout=JOIN_S)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            waited = time.monotonic() - self.since
            limit = self.phase_limit or self.limit_s
            announced = self._announced()
            if waited > limit or announced:
                self._dump(waited, announced)

    def _announced(self) -> str | None:
        if self._store is None:
            return None
        try:
            return self._store.get(_KEY).decode() if self._store.check([_KEY]) else None
        except Exception:  # noqa: BLE001 - a store gone away: judge by our own clock
            return None

    def _dump(self, waited: float, announced: str | None,
              cause: BaseException | None = None) -> None:
        """Announce the hang (unless another rank did), write this rank's stacks (stderr
        and a file) and exit with ``HANG_EXIT``. ``cause``: the collective's timeout error
        the training thread got."""
        if self._stop.is_set() or not self._dumping.acquire(blocking=False):
            return
        if not announced and self._store is not None:
            self._store.set(_KEY, f"rank {self.rank}, step {self.step}, {self.name}")
        path = self.folder / f"hang-rank{self.rank}.txt"
        why = (f"a collective timed out: {str(cause).strip()[:300]}" if cause is not None
               else f"training.hang_watchdog_s = {self.limit_s:g}")
        head = (f"[simplefsdp] hang watchdog: rank {self.rank} at step {self.step}, in "
                f"{self.name} for {waited:.1f} s ({why}"
                f"{'; first seen by ' + announced if announced else ''})")
        error = "".join(traceback.format_exception(cause)) if cause is not None else ""
        print(head + "; its Python stacks follow\n" + error, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(head + "\n\n" + error)
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:
            print(f"[simplefsdp] hang watchdog: could not write {path}: {e}", file=sys.stderr)
        _flight_recorder(self.folder / f"hang-rank{self.rank}.nccl.pkl")
        print(f"[simplefsdp] the job hung: every rank's stacks are in "
              f"{self.folder}/hang-rank<r>.txt (and above); the step and phase each rank "
              f"was in head each file. On CUDA, set TORCH_NCCL_TRACE_BUFFER_SIZE=2000 to "
              f"also record NCCL's flight recorder (hang-rank<r>.nccl.pkl). Exiting with "
              f"status {HANG_EXIT}.", file=sys.stderr, flush=True)
        time.sleep(2 * POLL_S)  # the others see the announcement before our sockets close
        os._exit(HANG_EXIT)


def _store():
    """A store the watchdog thread may use while the training thread waits (None
    without a process group of several ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    store = default_store()
    try:
        return store.clone()  # its own connection: the training thread may hold the other
    except Exception:  # noqa: BLE001 - a store that cannot clone: share it
        return store


def _flight_recorder(path: Path) -> None:
    """NCCL's flight recorder, when CUDA is in use and TORCH_NCCL_TRACE_BUFFER_SIZE is on."""
    if not torch.cuda.is_available() or not int(os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE",
                                                               "0") or 0):
        return
    try:
        path.write_bytes(nccl_flight_recorder())
    except Exception as e:  # noqa: BLE001 - best effort: the stacks are written already
        print(f"[simplefsdp] hang watchdog: no flight recorder dump ({e!r:.200})",
              file=sys.stderr)
