"""Fault injection for restart tests: a rank SIGKILLs itself at a chosen place.

``SIMPLEFSDP_FAULT="phase:step:rank[,phase:step:rank...]"``: the i-th entry fires in
torchrun's restart round i (``TORCHELASTIC_RESTART_COUNT``), so a job run with
``--max-restarts=K`` and K entries is killed once per round and must recover each time.
Phases (where in step ``step`` rank ``rank`` dies):

* ``forward``: inside the model's forward (a pre-hook on its middle parameterized module);
* ``backward``: inside backward (that module's first gradient has just been accumulated);
* ``optimizer``: right after ``optimizer.step()`` updated the parameters, before the LR
  scheduler moved;
* ``save``: during the checkpoint of step ``step``: the DCP files are written into
  ``step-<N>.tmp`` (async modes: the write is still in flight), not yet renamed;
* ``manifest``: the checkpoint is renamed to ``step-<N>`` but its manifest not written.

Unset, nothing is hooked and :func:`point` costs a dictionary lookup. ``scripts/
fault_injection.py`` drives this; ``tests/test_restarts.py`` uses two fixed kills.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

from torch import nn

from ..errors import ConfigError
from .elastic import restart_round

ENV = "SIMPLEFSDP_FAULT"
PHASES = ("forward", "backward", "optimizer", "save", "manifest")


@dataclass(frozen=True)
class Fault:
    phase: str
    step: int
    rank: int


def parse(spec: str) -> list[Fault]:
    """The faults ``spec`` names, one per restart round; a ConfigError naming the
    variable for a malformed one."""
    faults = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.split(":")
        if len(parts) != 3 or parts[0] not in PHASES or not all(
                p.isdigit() for p in parts[1:]):
            raise ConfigError(f"{ENV} = {spec!r}: expected phase:step:rank entries separated "
                              f"by commas, phase one of {', '.join(PHASES)} "
                              f"(e.g. save:4:1,forward:7:0); unset it to run without faults")
        faults.append(Fault(parts[0], int(parts[1]), int(parts[2])))
    return faults


def planned(rank: int) -> Fault | None:
    """This rank's fault for this restart round, if any."""
    faults = parse(os.environ.get(ENV, ""))
    here = restart_round()
    if here < len(faults) and faults[here].rank == rank:
        return faults[here]
    return None


class Injector:
    """Kills this process at its planned fault; hooks the model and optimizer only for
    the phases that need them."""

    def __init__(self, rank: int):
        self.fault = planned(rank)
        self.rank = rank
        self.step = 0

    def arm(self, model: nn.Module, optimizer) -> None:
        if self.fault is None:
            return
        owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
        middle = owners[len(owners) // 2]
        if self.fault.phase == "forward":
            middle.register_forward_pre_hook(lambda *_: self.point("forward"))
        elif self.fault.phase == "backward":
            param = next(p for p in middle.parameters(recurse=False) if p.requires_grad)
            param.register_post_accumulate_grad_hook(lambda _: self.point("backward"))
        elif self.fault.phase == "optimizer":
            optimizer.register_step_post_hook(lambda *_: self.point("optimizer"))

    def point(self, phase: str, step: int | None = None) -> None:
        """SIGKILL this process if ``phase`` of ``step`` (default: the current step) is
        where its fault is planned."""
        f = self.fault
        if f is None or f.phase != phase or f.step != (self.step if step is None else step):
            return
        print(f"[simplefsdp] fault injection: SIGKILL rank {self.rank} at {phase} of step "
              f"{f.step} (restart round {restart_round()})", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

