"""Benchmark settings: one dataclass, read from a TOML file and overridden by CLI flags.

A config file holds the fields of :class:`BenchConfig` at top level and a ``[model]``
table: ``preset`` names one of ``LLAMA3_PRESETS``, any other key overrides a
``ModelArgs`` field of it. Example (``configs/bench_debug.toml``)::

    world_size = 2
    batch_size = 4
    seq_len = 128
    [model]
    preset = "debug"
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models.llama import LLAMA3_PRESETS, ModelArgs


class BenchConfigError(ValueError):
    """A benchmark setting is unknown or out of range."""


@dataclass
class BenchConfig:
    """Everything one benchmark invocation needs; every rank gets the same copy."""

    model: str = "debug"  # a preset of LLAMA3_PRESETS
    model_overrides: dict[str, Any] = field(default_factory=dict)  # ModelArgs fields
    world_size: int = 2
    batch_size: int = 4  # sequences per rank and step
    seq_len: int = 128
    # Unmeasured steps per variant: the first compiles (FSDP2 and DDP initialize lazily),
    # the second settles (DDP rebuilds its buckets), the last one runs under the profiler.
    warmup: int = 3
    steps: int = 10  # measured steps per variant
    variants: list[str] = field(default_factory=list)  # empty: all of them
    device: str = "cpu"  # cpu (gloo) or cuda (nccl)
    fake_pg: bool = False  # one process pretends to be world_size ranks (compile/memory only)
    compile_backend: str = "inductor"  # for our compiled variants and FSDP2 per-block
    compile_cache: bool = False  # False: Inductor/AOT caches off, so compile time is cold
    lr: float = 1e-3
    seed: int = 0
    threads: int = 0  # torch threads per rank; 0: CPU cores / local ranks
    loss_tolerance: float = 1e-4  # max |loss - reference loss| over all steps
    timeout_s: float = 900.0  # one collective; a stuck rank raises instead of hanging
    output_dir: str = "bench_results"

    def model_args(self) -> ModelArgs:
        """The preset with the overrides applied."""
        if self.model not in LLAMA3_PRESETS:
            raise BenchConfigError(f"unknown model preset {self.model!r}; choose one of "
                                   f"{', '.join(LLAMA3_PRESETS)}")
        names = {f.name for f in dataclasses.fields(ModelArgs)}
        unknown = sorted(set(self.model_overrides) - names)
        if unknown:
            raise BenchConfigError(f"unknown [model] keys {unknown}; ModelArgs has "
                                   f"{sorted(names)}")
        try:
            return dataclasses.replace(LLAMA3_PRESETS[self.model], **self.model_overrides)
        except ValueError as e:
            raise BenchConfigError(f"[model]: {e}") from e

    def validate(self) -> None:
        """Raise :class:`BenchConfigError` for settings the benchmark cannot run."""
        from .variants import VARIANTS

        for name in ("world_size", "batch_size", "seq_len", "steps"):
            if getattr(self, name) < 1:
                raise BenchConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 3:
            raise BenchConfigError(f"warmup must be >= 3 (step 1 compiles, step 2 settles, "
                                   f"the last warm-up step is profiled), got {self.warmup}")
        if self.device not in ("cpu", "cuda"):
            raise BenchConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.compile_backend not in ("inductor", "aot_eager"):
            raise BenchConfigError(f"compile_backend must be 'inductor' or 'aot_eager', "
                                   f"got {self.compile_backend!r}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise BenchConfigError(f"unknown variant(s) {unknown}; choose from "
                                   f"{', '.join(VARIANTS)}")
        if len(set(self.variants)) != len(self.variants):
            raise BenchConfigError(f"variants listed twice: {self.variants}")
        args = self.model_args()
        if args.vocab_size < 256:
            raise BenchConfigError(f"model vocab_size {args.vocab_size} < 256: the benchmark "
                                   f"feeds byte-level tokens")
        if self.seq_len > args.max_seq_len:
            raise BenchConfigError(f"seq_len {self.seq_len} > model max_seq_len "
                                   f"{args.max_seq_len}")

    def selected_variants(self) -> list[str]:
        from .variants import VARIANTS

        return list(self.variants) if self.variants else list(VARIANTS)


def load_config(path: str | Path | None) -> BenchConfig:
    """A :class:`BenchConfig` from a TOML file (or the defaults for ``None``)."""
    if path is None:
        return BenchConfig()
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    model = dict(raw.pop("model", {}))
    fields = {f.name for f in dataclasses.fields(BenchConfig)} - {"model", "model_overrides"}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise BenchConfigError(f"{path}: unknown keys {unknown}; known: {sorted(fields)} "
                               f"and a [model] table")
    cfg = BenchConfig(**raw)
    cfg.model = model.pop("preset", cfg.model)
    cfg.model_overrides = model
    return cfg
