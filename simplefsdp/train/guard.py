"""Stopping a run safely: non-finite values and SIGTERM/SIGINT.

* Non-finite guard: a step whose loss or gradient norm is NaN/inf on any rank is not
  applied, and the run stops with :class:`NonFiniteError` naming the step; a checkpoint
  is never written from non-finite parameters (:func:`all_finite`).
* Signals: :class:`StopOnSignal` turns the first SIGTERM (how clusters preempt jobs) or
  SIGINT into a request that the loop sees after the current step; the ranks agree on
  it through the step's flag all-reduce, save a checkpoint and stop with
  :class:`Preempted`. A second signal, at least ``REPEAT_S`` after the first, exits at
  once (echoes of the same event, e.g. Ctrl-C reaching torchrun and the workers and
  torchrun then forwarding SIGTERM, arrive within that window and are not counted).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from ..mesh import local_shard

REPEAT_S = 2.0


class NonFiniteError(RuntimeError):
    """The loss, gradient norm or parameters became NaN/inf."""


class Preempted(RuntimeError):
    """The run stopped on a signal after saving; ``signum`` is the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


@torch.no_grad()
def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every local piece of ``tensors`` is finite on every rank (a collective)."""
    device = tensors[0].device if tensors else torch.device("cpu")
    bad = torch.zeros((), device=device)
    for t in tensors:
        local = local_shard(t)
        bad = torch.maximum(bad, (~torch.isfinite(local)).any().to(bad.dtype))
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad)


@torch.no_grad()
def step_flags(loss: torch.Tensor, grad_norm: torch.Tensor,
               stop_requested: bool) -> tuple[bool, bool]:
    """(some rank saw a non-finite loss or gradient norm, some rank got a stop signal):
    one small all-reduce, so every rank takes the same decision for the step."""
    bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
    flags = torch.stack([bad.to(torch.float32),
                         torch.tensor(float(stop_requested), device=loss.device)])
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    nonfinite, stop = flags.tolist()
    return nonfinite > 0, stop > 0


class StopOnSignal:
    """Context manager: SIGTERM/SIGINT set ``requested`` instead of killing the process;
    a repeat at least ``REPEAT_S`` later exits at once. Handlers are only installed on
    the main thread (signals are delivered there) and are restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._first = 0.0
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first = signum, now
            print(f"[simplefsdp] {signal.Signals(signum).name}: finishing this step, then "
                  f"saving and stopping (send it again to stop at once)",
                  file=sys.stderr, flush=True)
        elif now - self._first >= REPEAT_S:
            print(f"[simplefsdp] second {signal.Signals(signum).name}: stopping now, without "
                  f"saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
