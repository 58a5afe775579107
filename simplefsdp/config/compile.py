"""``[compile]``: ``torch.compile`` with our backend (``models/parallelize.py`` builds it),
with the checks that need no model built."""

from __future__ import annotations

from dataclasses import dataclass

from ..compiler.backend import Backend, Bucketing
from ..compiler.cost.comm import read_comm_model
from ..errors import ConfigError, choices, require

CompileBackend = Backend
COMM_MODEL_SOURCES = ("calibrate", "fabric")  # compile.comm_model's words; else a path


@dataclass
class CompileConfig:
    enable: bool = False  # torch.compile the model with the simplefsdp backend
    backend: CompileBackend = "inductor"  # inductor (kernels) or aot_eager (no codegen)
    # How collectives are merged: none; manual: one bucket per block; auto / greedy:
    # planned from the cost model (under memory_limit_gb).
    bucketing: Bucketing = "manual"
    reordering: bool = True  # prefetch gathers and delay reductions to hide them
    memory_limit_gb: float | None = None  # for bucketing = "auto" or "greedy"; None: no limit
    # The collective costs auto / greedy bucketing plans with. calibrate: timed on this
    # machine's process group (cached per machine and layout, re-checked by a probe at
    # each start). fabric: the fabric table's figures, nothing timed (the same plan on
    # any machine). Or the path of a calibration file (python -m simplefsdp.calibrate
    # lists the cached ones) calibrated on this world size: every job plans on its figures.
    comm_model: str = "calibrate"


def check_compile(c: CompileConfig) -> None:
    """``[compile]``'s values; ``comm_model`` a word of ``COMM_MODEL_SOURCES`` or a
    readable calibration file (its world size is checked when the backend meets its
    process group)."""
    require(c.memory_limit_gb is None or c.memory_limit_gb > 0, "compile.memory_limit_gb",
            c.memory_limit_gb, "> 0")
    if c.comm_model in COMM_MODEL_SOURCES:
        return
    try:
        read_comm_model(c.comm_model)
    except (OSError, ValueError) as e:
        raise ConfigError(f"compile.comm_model = {c.comm_model!r}: {e}; choose "
                          f"{choices(COMM_MODEL_SOURCES)} or the path of a calibration "
                          f"file (python -m simplefsdp.calibrate --no-probe lists the "
                          f"cached ones)") from None
