"""``python -m simplefsdp.plan``: will it fit, how fast, which layout.

    python -m simplefsdp.plan --config configs/llama3_8b.toml --gpus 8 --gpu h100-sxm
    python -m simplefsdp.plan --config configs/llama3_405b.toml --gpus 1024 --search \\
        --json plan.json --png plan.png
    # any trainer key: --parallel.tp 2 --activation_checkpoint.mode full ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..config.job import config_help, load_config
from ..config.reader import explicit_keys
from ..errors import ConfigError
from ..hardware import GPU_PROFILES, GiB, gpu_profile
from ..parallel.activation_checkpoint import quiet_our_checkpoint_warning
from . import report
from .predict import ALLOC_OVERHEAD, predict
from .search import search

# The planner traces our compiled graphs, here and in its spawned search workers (which
# import this module again): torch's warning about our checkpointed regions is noise.
quiet_our_checkpoint_warning()


def _progress(started: float):
    def show(r) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] dp {r.dp_replicate}x{r.dp_shard} "
              f"tp {r.tp} pp {r.pp} ac {r.ac} batch {r.batch_size}: "
              f"{r.reserved_memory_gib:.1f} GiB, {r.tokens_per_s_per_gpu:.0f} tok/s/GPU",
              file=sys.stderr, flush=True)
    return show


def _auto(cfg, args, explicit: set[str]) -> int:
    """``--auto``: ``plan.auto_layout.choose`` for the config, its line and wall time."""
    from .auto_layout import choice_line, choose, fixed_layout_keys

    started = time.perf_counter()
    outcome = choose(cfg, args.gpus, args.gpu, args.gpus_per_node,
                     fixed_layout_keys(cfg, explicit))
    print(choice_line(outcome, args.gpus, args.gpu))
    note = "" if outcome["cached"] else f"; {report.search_note(outcome['stats'], 1, 1)}"
    print(f"{time.perf_counter() - started:.1f} s{note}")
    return 0


def _parser() -> argparse.ArgumentParser:
    """The planner's own flags (the trainer's keys come as overrides)."""
    parser = argparse.ArgumentParser(prog="python -m simplefsdp.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="the trainer's keys, as overrides:\n"
                                     + config_help().split("\n", 5)[-1])
    parser.add_argument("--config", help="the trainer's TOML config")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", default="h100-sxm", help=f"one of {', '.join(GPU_PROFILES)}")
    parser.add_argument("--search", action="store_true", help="rank every layout")
    parser.add_argument("--tradeoffs", action="store_true",
                        help="search: also each predicted layout with a knob turned "
                             "(parallel.reshard_after_forward = a node, training.gradient_sync "
                             "= last_microstep, training.cpu_offload where it does not fit)")
    parser.add_argument("--auto", action="store_true",
                        help="the layout the trainer's parallel.layout = 'auto' picks: the "
                             "search kept to the layout keys the config and the command "
                             "line set, under the --gpu profile's memory (NAME@<N>GB for "
                             "a limit); its answer is cached on disk")
    parser.add_argument("--free", default="",
                        help="--auto: sections or section.key names (comma-separated) the "
                             "search chooses although the config sets them, e.g. "
                             "parallel,activation_checkpoint")
    parser.add_argument("--json", help="write one object per configuration here")
    parser.add_argument("--png", help="write memory vs tokens/s here")
    parser.add_argument("--top", type=int, default=20, help="rows of the search table")
    parser.add_argument("--keep", type=int, default=3,
                        help="search: skip layouts whose speed bound cannot reach the "
                             "KEEP-th best found (the first KEEP rows are exact); 0: "
                             "predict every layout")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="search: processes tracing (each one tensor-parallel size, "
                             "with or without PP, at a time); default: 2 where there are "
                             "2 cores (on cores busy with another job, use 1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    try:
        dev = gpu_profile(args.gpu)
        # one layout: its sizes must fill the GPUs (checked before the model's shapes);
        # --search chooses the sizes itself
        # the planner plans GPU runs: job.device = "cuda" unless given (CUDA-only keys
        # such as training.cpu_offload then validate)
        cfg = load_config(args.config, ["--job.device", "cuda", *overrides],
                          world_size=None if args.search or args.auto else args.gpus)
        if args.auto:
            free = {x.strip() for x in args.free.split(",") if x.strip()}
            explicit = {k for k in explicit_keys(args.config, overrides)
                        if k not in free and k.partition(".")[0] not in free}
            return _auto(cfg, args, explicit)
        started = time.perf_counter()
        failures: list[str] = []
        stats: dict = {}
        if args.keep < 0 or args.workers < 1:
            raise ConfigError(f"--keep ({args.keep}) must be >= 0 and --workers "
                              f"({args.workers}) >= 1")
        if args.search:
            rows = search(cfg, args.gpus, args.gpu, args.gpus_per_node, failures=failures,
                          progress=_progress(started), keep=args.keep, stats=stats,
                          workers=args.workers, tradeoffs_rows=args.tradeoffs)
        else:
            rows = [predict(cfg, args.gpus, args.gpu, args.gpus_per_node)]
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{cfg.model.name} on {args.gpus} x {args.gpu} ({dev.note}), "
          f"{args.gpus_per_node} per node; {time.perf_counter() - started:.1f} s")
    print(report.table(rows, args.top if args.search else None))
    if args.search:
        print(report.search_note(stats, args.keep, args.workers))
    if cfg.compile.enable and cfg.compile.bucketing == "auto":
        print("note: compile.bucketing = 'auto' is planned as 'manual' (one bucket per block)")
    for failure in failures:
        print(f"could not trace: {failure}")
    print("memory: 16 B/param model states (fp32 shard, grad, AdamW) + activations of 1 and "
          "2 blocks scaled to the depth (compiled: liveness of the traced graphs + eager "
          f"loss; eager: the eager step replayed on fake tensors); reserved = active x "
          f"{1 + ALLOC_OVERHEAD:.2f}; fits = reserved + 1 GiB (CUDA context, NCCL) <= GPU "
          "memory")
    if args.json:
        report.write_json(rows, args.json)
        print(f"wrote {args.json}")
    if args.png:
        print(report.write_png(rows, args.png, dev.memory_bytes / GiB))
    return 0


if __name__ == "__main__":
    sys.exit(main())
