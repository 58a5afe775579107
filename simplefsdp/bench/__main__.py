"""``python -m simplefsdp.bench``: the side-by-side benchmark from the command line.

    python -m simplefsdp.bench                                 # debug model, 2 gloo ranks
    python -m simplefsdp.bench --config configs/bench_debug.toml --variants \\
        simplefsdp-eager,simplefsdp-reordering,fsdp2-eager,compute-only --bench.steps 3
    torchrun --standalone --nproc_per_node=2 -m simplefsdp.bench
    python -m simplefsdp.bench --device cuda --world-size 8   # 1 GPU: real world 1 + fake 8
    python -m simplefsdp.bench --device cuda --world-size 8 --fake-pg  # the fake run only
    python -m simplefsdp.bench --list
    python -m simplefsdp.bench --help                          # every key, type, default

The trainer's config format and override syntax (``--section.key value`` overrides the
config file, which overrides the defaults); see ``config.py``.
"""

from __future__ import annotations

import os
import sys

from ..errors import ConfigError
from ..parallel.activation_checkpoint import quiet_our_checkpoint_warning
from .config import BenchConfig, bench_help, parse_args
from .launch import run_fake, run_spawned, run_torchrun, under_torchrun
from .variants import VARIANTS

# Our compiled variants checkpoint the gather: torch's warning about our checkpointed
# regions is noise, here and in the spawned ranks (which import this module again).
quiet_our_checkpoint_warning()


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _real_then_fake(cfg: BenchConfig) -> int:
    """Fewer GPUs than ranks: a real run on the GPUs there are, then a fake-process-group
    run at the requested world size (compile time, memory, collective counts only)."""
    world = cfg.bench.world_size
    real = cfg.at_world(_gpus())
    print(f"[bench] {world} ranks requested, {_gpus()} GPU(s) found: real run at world size "
          f"{_gpus()}, then a fake-process-group run at world size {world} (its timings "
          f"are not real)", flush=True)
    status = run_spawned(real)
    run_fake(cfg.at_world(world, fake_pg=True))
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(bench_help())
        return 0
    if "--list" in argv:
        for spec in VARIANTS.values():
            print(f"{spec.name:28s} {spec.description}")
        return 0
    try:
        # Under torchrun an unset bench.world_size is torchrun's; a set one must match it.
        default_world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else 2
        cfg = parse_args(argv, default_world)
        if cfg.bench.fake_pg:
            if under_torchrun():
                raise ConfigError("--fake-pg runs one process; start it without torchrun")
            run_fake(cfg)
            return 0
        if under_torchrun():
            run_torchrun(cfg)
            return 0
        if cfg.job.device == "cuda" and 0 < _gpus() < cfg.bench.world_size:
            return _real_then_fake(cfg)
        return run_spawned(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
