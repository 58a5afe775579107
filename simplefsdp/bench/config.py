"""Benchmark settings: the trainer's TOML schema and override syntax, plus ``[bench]``.

A benchmark config is read by the package's reader (``config.reader``): the same
file format and the same ``--section.key value`` overrides. Keys that mean the same
thing as in a training job keep the trainer's section and name (``[model]``,
``[training] batch_size``, ``[compile] backend``, ``[job] device``); settings only a
benchmark has are in ``[bench]``. ``python -m simplefsdp.bench --help`` lists every key.
Example (``configs/bench_debug.toml``)::

    [model]
    name = "debug"
    [training]
    batch_size = 4
    [bench]
    world_size = 2
    variants = ["simplefsdp-eager", "fsdp2-eager"]
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass, field

from ..config.compile import CompileBackend
from ..config.job import Device, DType, ModelConfig
from ..config.reader import config_help, read_config, split_argv
from ..config.shapes import check_seq_len
from ..errors import ConfigError, require
from ..models.llama import ModelArgs
from ..models.moe import MOE_PRESETS


@dataclass
class BenchTraining:
    """``[training]``: the trainer's keys the benchmark uses, with the same meaning."""

    batch_size: int = 4  # sequences per rank and step
    seq_len: int = 128  # tokens per sequence
    lr: float = 1e-3  # AdamW learning rate, constant
    seed: int = 0  # initialization and data
    # Mixed precision of the sharded variants, as the trainer's keys (FSDP2's
    # MixedPrecisionPolicy on the fsdp2 variants, simplefsdp's on ours). The weights the
    # optimizer updates stay float32.
    mixed_precision_param: DType = "float32"  # dtype weights are gathered and computed in
    mixed_precision_reduce: DType = "float32"  # dtype gradients are reduced in


@dataclass
class BenchCompile:
    """``[compile]``: backend of our compiled variants and of FSDP2's per-block compile."""

    backend: CompileBackend = "inductor"  # inductor (kernels) or aot_eager (no codegen)


@dataclass
class BenchJob:
    """``[job]``: cpu (gloo) or cuda (NCCL, one GPU per rank)."""

    device: Device = "cpu"  # cpu (gloo) or cuda (NCCL, one GPU per rank)


@dataclass
class BenchSection:
    """``[bench]``: settings only a benchmark has."""

    world_size: int | None = None  # ranks; none: torchrun's world size, or 2
    # Unmeasured steps per variant: the first compiles (FSDP2 and DDP initialize lazily),
    # the second settles (DDP rebuilds its buckets), the rest run under the profiler
    # (memory: the least of them, see ``measure.PROFILED_STEPS``).
    warmup: int = 5  # 2 + measure.PROFILED_STEPS
    steps: int = 20  # measured steps per variant
    variants: list[str] = field(default_factory=list)  # empty: all of them (see --list)
    fake_pg: bool = False  # one process pretends to be world_size ranks (compile/memory only)
    compile_cache: bool = False  # False: Inductor/AOT caches off, so compile time is cold
    threads: int = 0  # torch threads per rank; 0: CPU cores / local ranks
    loss_tolerance: float = 1e-4  # max |loss - reference loss| over all steps
    timeout_s: float = 900.0  # one collective; a stuck rank raises instead of hanging
    output_dir: str = "bench_results"  # results go to <output_dir>/<timestamp>/


@dataclass
class BenchConfig:
    """Everything one benchmark invocation needs; every rank gets the same copy."""

    model: ModelConfig = field(default_factory=ModelConfig)
    training: BenchTraining = field(default_factory=BenchTraining)
    compile: BenchCompile = field(default_factory=BenchCompile)
    job: BenchJob = field(default_factory=BenchJob)
    bench: BenchSection = field(default_factory=BenchSection)

    def model_args(self) -> ModelArgs:
        """The preset with the overrides applied."""
        return self.model.model_args()

    def validate(self) -> None:
        """Raise a ConfigError for settings the benchmark cannot run."""
        from .variants import VARIANTS

        t, b = self.training, self.bench
        require(b.world_size is None or b.world_size >= 1, "bench.world_size", b.world_size,
                ">= 1 (or none: torchrun's world size, or 2)")
        for key in ("batch_size", "seq_len"):
            require(getattr(t, key) >= 1, f"training.{key}", getattr(t, key), ">= 1")
        require(t.lr > 0, "training.lr", t.lr, "> 0")
        require(b.steps >= 1, "bench.steps", b.steps, ">= 1")
        require(b.warmup >= 3, "bench.warmup", b.warmup,
                ">= 3 (step 1 compiles, step 2 settles, the later warm-up steps are profiled)")
        require(b.threads >= 0, "bench.threads", b.threads, ">= 0 (0: cores / ranks)")
        require(b.loss_tolerance >= 0, "bench.loss_tolerance", b.loss_tolerance, ">= 0")
        require(b.timeout_s > 0, "bench.timeout_s", b.timeout_s, "> 0")
        unknown = [v for v in b.variants if v not in VARIANTS]
        if unknown:
            raise ConfigError(f"bench.variants: unknown variant(s) {unknown}; choose from "
                              f"{', '.join(VARIANTS)} (see --list)")
        if len(set(b.variants)) != len(b.variants):
            raise ConfigError(f"bench.variants lists a variant twice: {b.variants}")
        if "fsdp2-float8" in b.variants and importlib.util.find_spec("torchao") is None:
            from .variants import TORCHAO_MISSING

            raise ConfigError(f"bench.variants lists fsdp2-float8, which {TORCHAO_MISSING}; "
                              f"or leave it out of bench.variants")
        args = self.model_args()
        if args.vocab_size < 256:
            raise ConfigError(f"model.vocab_size = {args.vocab_size} is below 256: the "
                              f"benchmark feeds byte-level tokens")
        check_seq_len(t.seq_len, args)

    def selected_variants(self) -> list[str]:
        from .variants import VARIANTS

        if self.bench.variants:
            return list(self.bench.variants)
        moe = self.model.name in MOE_PRESETS  # the EP variants need an MoE preset
        return [v for v in VARIANTS if moe or not VARIANTS[v].moe]

    def at_world(self, world_size: int, fake_pg: bool | None = None) -> BenchConfig:
        """A copy for ``world_size`` ranks (and, if given, with ``bench.fake_pg`` set)."""
        cfg = copy.deepcopy(self)
        cfg.bench.world_size = world_size
        if fake_pg is not None:
            cfg.bench.fake_pg = fake_pg
        return cfg


# Short flags the README documents, kept as aliases of the keys.
ALIASES = {"--device": "--job.device", "--world-size": "--bench.world_size",
           "--fake-pg": "--bench.fake_pg=true", "--variants": "--bench.variants"}
USAGE = ("python -m simplefsdp.bench [--config FILE.toml] [--list] [--section.key value ...]\n"
         "  --list lists the variants and exits")


def load_config(path: str | None, overrides: list[str] | None = None,
                default_world_size: int = 2) -> BenchConfig:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides``; an unset
    ``bench.world_size`` becomes ``default_world_size``; validated."""
    cfg = read_config(BenchConfig(), path, overrides)
    if cfg.bench.world_size is None:
        cfg.bench.world_size = default_world_size
    cfg.validate()
    return cfg


def parse_args(argv: list[str], default_world_size: int = 2) -> BenchConfig:
    """Command line -> config: ``[--config FILE] [--section.key value ...]`` and the
    short flags of ``ALIASES``."""
    path, overrides = split_argv(argv, ALIASES)
    return load_config(path, overrides, default_world_size)


def bench_help() -> str:
    """Every key with its type and default, for ``--help``."""
    return config_help(BenchConfig(), USAGE, ALIASES)
