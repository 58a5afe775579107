"""``python -m simplefsdp.bench``: the side-by-side benchmark from the command line.

    python -m simplefsdp.bench                                 # debug model, 2 gloo ranks
    python -m simplefsdp.bench --config configs/bench_debug.toml --variants \\
        simplefsdp-eager,simplefsdp-reordering,fsdp2-eager,compute-only
    torchrun --standalone --nproc_per_node=2 -m simplefsdp.bench
    python -m simplefsdp.bench --device cuda --world-size 8   # 1 GPU: real world 1 + fake 8
    python -m simplefsdp.bench --device cuda --world-size 8 --fake-pg  # the fake run only
    python -m simplefsdp.bench --list

Flags override the config file; the config file overrides the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tomllib

from .config import BenchConfig, BenchConfigError, load_config
from .launch import run_fake, run_spawned, run_torchrun, under_torchrun
from .variants import VARIANTS

# flag -> BenchConfig field
_OVERRIDES = {"model": "model", "world_size": "world_size", "batch_size": "batch_size",
              "seq_len": "seq_len", "steps": "steps", "warmup": "warmup", "device": "device",
              "compile_backend": "compile_backend", "lr": "lr", "seed": "seed",
              "threads": "threads", "loss_tolerance": "loss_tolerance",
              "timeout": "timeout_s", "output_dir": "output_dir"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m simplefsdp.bench",
                                description="simplefsdp vs FSDP2 vs DDP, interleaved, one table.")
    p.add_argument("--config", help="TOML file with BenchConfig fields and a [model] table")
    p.add_argument("--model", help="model preset (default debug)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="override a ModelArgs field, e.g. --model-arg n_layers=1 (repeatable)")
    p.add_argument("--world-size", type=int, help="ranks (default 2; torchrun's if under it)")
    p.add_argument("--batch-size", type=int, help="sequences per rank and step (default 4)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default 128)")
    p.add_argument("--steps", type=int, help="measured steps per variant (default 10)")
    p.add_argument("--warmup", type=int, help="warm-up steps per variant, >= 3 (default 3)")
    p.add_argument("--variants", help="comma-separated subset (see --list; default all)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="cpu (gloo) or cuda (nccl)")
    p.add_argument("--fake-pg", action="store_true", default=None,
                   help="one process, fake process group of --world-size ranks: compile "
                        "time, memory and collective counts only")
    p.add_argument("--compile-backend", choices=("inductor", "aot_eager"),
                   help="backend for our compiled variants and FSDP2 per-block compile")
    p.add_argument("--compile-cache", action="store_true", default=None,
                   help="keep Inductor's caches on (faster reruns; compile s then is warm)")
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--threads", type=int, help="torch threads per rank (0: cores / ranks)")
    p.add_argument("--loss-tolerance", type=float, help="max |loss diff| counted as equal")
    p.add_argument("--timeout", type=float, help="collective timeout in seconds")
    p.add_argument("--output-dir", help="results go to <output-dir>/<timestamp>/")
    p.add_argument("--list", action="store_true", help="list the variants and exit")
    return p.parse_args(argv)


def _value(text: str):
    """``KEY=VALUE`` value as TOML would read it (int, float, bool, quoted string), else
    the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def build_config(ns: argparse.Namespace) -> tuple[BenchConfig, bool]:
    """(config, whether the world size was given explicitly)."""
    cfg = load_config(ns.config)
    explicit_world = ns.world_size is not None
    if ns.config:
        with open(ns.config, "rb") as f:
            explicit_world |= "world_size" in tomllib.load(f)
    for flag, name in _OVERRIDES.items():
        value = getattr(ns, flag)
        if value is not None:
            setattr(cfg, name, value)
    if ns.fake_pg:
        cfg.fake_pg = True
    if ns.compile_cache:
        cfg.compile_cache = True
    if ns.variants:
        cfg.variants = [v.strip() for v in ns.variants.split(",") if v.strip()]
    for item in ns.model_arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise BenchConfigError(f"--model-arg expects KEY=VALUE, got {item!r}")
        cfg.model_overrides[key.strip()] = _value(value.strip())
    return cfg, explicit_world


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _real_then_fake(cfg: BenchConfig) -> int:
    """Fewer GPUs than ranks: a real run on the GPUs there are, then a fake-process-group
    run at the requested world size (compile time, memory, collective counts only)."""
    real = dataclasses.replace(cfg, world_size=_gpus())
    print(f"[bench] {cfg.world_size} ranks requested, {real.world_size} GPU(s) found: real "
          f"run at world size {real.world_size}, then a fake-process-group run at world size "
          f"{cfg.world_size} (its timings are not real)", flush=True)
    status = run_spawned(real)
    run_fake(dataclasses.replace(cfg, fake_pg=True))
    return status


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    if ns.list:
        for spec in VARIANTS.values():
            print(f"{spec.name:28s} {spec.description}")
        return 0
    try:
        cfg, explicit_world = build_config(ns)
        if under_torchrun() and not explicit_world:
            import os

            cfg.world_size = int(os.environ["WORLD_SIZE"])
        cfg.validate()
        if cfg.fake_pg:
            if under_torchrun():
                raise BenchConfigError("--fake-pg runs one process; start it without torchrun")
            run_fake(cfg)
            return 0
        if under_torchrun():
            run_torchrun(cfg)
            return 0
        if cfg.device == "cuda" and 0 < _gpus() < cfg.world_size:
            return _real_then_fake(cfg)
        return run_spawned(cfg)
    except BenchConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
