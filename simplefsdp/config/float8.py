"""``[float8]``: float8 linear layers and the float8 all-gather (``simplefsdp/float8.py``
does the work; ``models/parallelize.py`` applies it), with the checks that need no model
built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from ..float8 import DEFAULT_EXCLUDE, check_scaled_mm

Float8Recipe = Literal["tensorwise", "rowwise"]


@dataclass
class Float8Config:
    # Compute the linear layers' forward and backward matmuls in float8 (torch._scaled_mm,
    # dynamic scaling: e4m3 weights and activations, e5m2 gradients). Weights, gradients,
    # optimizer and checkpoints stay high precision. Needs torch._scaled_mm on the device
    # (CPU, or a GPU of compute capability 8.9 or later).
    enable: bool = False
    # tensorwise: one scale per tensor; rowwise: one scale per row along each matmul's
    # contraction dim (finer, no float8 all-gather).
    recipe: Float8Recipe = "tensorwise"
    # Gather the converted weights in float8 (half the bf16 bytes, plus one scale each);
    # tensorwise, parallel.dp_mode = 'fully_shard', no tensor parallelism (with
    # parallel.tp > 1 set it false: the linears compute in float8 under TP, tensorwise).
    all_gather: bool = True
    # Module FQN globs (fnmatch) kept in high precision: the output head and routers.
    exclude: list[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDE))


def check_float8(cfg) -> None:
    """``[float8]`` against the rest of the job, before any model is built."""
    f, p = cfg.float8, cfg.parallel
    if not f.enable:
        return
    if f.all_gather and f.recipe != "tensorwise":
        raise ConfigError(f"float8.all_gather = true needs float8.recipe = 'tensorwise' (one "
                          f"scale per weight); float8.recipe = {f.recipe!r}: set "
                          f"float8.all_gather = false")
    if f.all_gather and p.dp_mode != "fully_shard":
        raise ConfigError(f"float8.all_gather = true gathers fully_shard weights; "
                          f"parallel.dp_mode = {p.dp_mode!r}: set float8.all_gather = false "
                          f"or parallel.dp_mode = 'fully_shard'")
    if f.all_gather and (not isinstance(p.reshard, bool) or cfg.training.cpu_offload):
        raise ConfigError(f"float8.all_gather = true is not built with an int "
                          f"parallel.reshard_after_forward ({p.reshard_after_forward!r}) or "
                          f"training.cpu_offload ({cfg.training.cpu_offload}): set "
                          f"float8.all_gather = false, or turn those off")
    if p.tp > 1 and f.recipe != "tensorwise":
        raise ConfigError(f"float8.recipe = {f.recipe!r} with parallel.tp = {p.tp}: tensor "
                          f"parallelism is built for tensorwise scaling (each scale agreed "
                          f"over the TP group); set float8.recipe = 'tensorwise'")
    if p.tp > 1 and f.all_gather:
        raise ConfigError(f"float8.all_gather = true with parallel.tp = {p.tp}: the float8 "
                          f"all-gather is not built with tensor parallelism; set "
                          f"float8.all_gather = false (the linears still compute in float8, "
                          f"their weights gathered in the parameter dtype)")
    if cfg.lora.enable:
        raise ConfigError("float8.enable = true with lora.enable = true is not supported; "
                          "turn one of them off")
    why = check_scaled_mm(cfg.job.device) if _device_present(cfg.job.device) else None
    if why is not None:
        raise ConfigError(f"float8.enable = true needs torch._scaled_mm: {why}; set "
                          f"float8.enable = false")


def _device_present(device: str) -> bool:
    import torch

    return device == "cpu" or torch.cuda.is_available()
