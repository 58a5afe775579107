"""``[lora]``: low-rank adapters (peft's LoRA) on a model whose own weights stay frozen
(``models/lora.py`` applies them), with the checks that need no model built."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from ..errors import ConfigError, require

# Families LoRA is wired into, and the modules it adapts when target_modules is empty:
# the attention's query and value projections.
DEFAULT_TARGETS = {"hf": ["q_proj", "v_proj"], "llama": ["wq", "wv"]}


@dataclass
class LoraConfig:
    # Fine-tune low-rank adapters (peft's LoRA) instead of the model: every other
    # parameter is frozen (sharded, gathered for compute, never reduced or optimized).
    # Needs the [lora] extra (peft). Writes <metrics.output_dir>/lora, a peft adapter folder.
    enable: bool = False
    rank: int = 8  # the adapters' rank r
    alpha: float = 16.0  # their output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on each adapter's input while training
    # Linear modules to adapt, by name or name suffix (peft's target_modules); empty: the
    # attention's query and value projections (q_proj, v_proj; our Llama: wq, wv).
    target_modules: list[str] = field(default_factory=list)


def check_lora(cfg) -> None:
    """``[lora]``: its ranges; with ``enable``, a family and layout it works with, and
    peft installed."""
    lo, p = cfg.lora, cfg.parallel
    require(lo.rank >= 1, "lora.rank", lo.rank, ">= 1")
    require(lo.alpha > 0, "lora.alpha", lo.alpha, "> 0")
    require(0 <= lo.dropout < 1, "lora.dropout", lo.dropout, "in [0, 1)")
    if not lo.enable:
        return
    family = cfg.model.family_entry().name
    if family not in DEFAULT_TARGETS:
        raise ConfigError(f"lora.enable = true: model.family = {family!r} has no LoRA support "
                          f"(Hugging Face models and our Llama have); set lora.enable = false")
    if p.tp > 1 or p.pp > 1:
        raise ConfigError(f"lora.enable = true runs with data and context parallelism; "
                          f"parallel.tp = {p.tp}, parallel.pp = {p.pp}: set both to 1")
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("lora.enable = true needs the peft package, which is not installed: "
                          "pip install 'simplefsdp[lora]' (or pip install peft)")


def lora_targets(cfg) -> list[str]:
    """``lora.target_modules``, or the family's default when empty."""
    return list(cfg.lora.target_modules) or DEFAULT_TARGETS[cfg.model.family_entry().name]
