"""Side-by-side benchmark: simplefsdp (eager, compiled, + passes) vs FSDP2, DDP and a
compute-only reference, interleaved in one invocation on the same model, data and seed.

Run ``python -m simplefsdp.bench --help``. Layout: ``config.py`` (settings),
``variants.py`` (how each variant builds its model), ``runner.py`` (interleaved timing
loop), ``measure.py`` (profiler collectives and memory), ``report.py`` (table, JSON,
report.md, PNG), ``launch.py`` (torchrun, spawned ranks or a fake process group).
"""

from .config import BenchConfig, load_config
from .variants import VARIANTS

__all__ = ["VARIANTS", "BenchConfig", "load_config"]
