"""LoRA fine-tuning (``[lora]``): peft's low-rank adapters injected into a model before
data parallel, so the frozen base stays sharded like any parameter while only the
adapters train.

- :func:`apply_lora` (model on meta, before ``data_parallel``): peft's
  ``inject_adapter_in_model`` wraps each target ``nn.Linear`` (its weight becomes
  ``<name>.base_layer.weight``, which ``state_dict.unwrapped_name`` maps back to the
  model's own name, so loading and export see the original names) and freezes every
  other parameter. ``data_parallel`` shards them all; a frozen parameter is gathered for
  compute and gets no gradient, hence no reduce-scatter, and the trainer's optimizer
  (``optim.build_optimizer``: trainable parameters only) holds no state for it.
- :func:`init_adapters` (after the base weights are loaded): the adapters' values as
  peft initializes them (A: ``kaiming_uniform_(a=sqrt(5))``, B: zeros) from the run's
  seed, the same for every parallel layout.
- :func:`save_adapter`: a peft adapter folder (``adapter_config.json`` +
  ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the
  base model; :func:`merging` folds the adapters into the base weights of an export.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config.lora import lora_targets
from ..errors import ConfigError
from ..mesh import copy_into_shard
from ..state_dict import unwrapped_name

ADAPTER = "default"  # peft's adapter name: one adapter per run
ADAPTER_FOLDER = "lora"  # under metrics.output_dir
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file name (its config writes its own)


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` belongs to a LoRA adapter (``...lora_A.default.weight``)."""
    return any(part.startswith("lora_") for part in name.split("."))


def _check_targets(model: nn.Module, targets: list[str]) -> None:
    """Every target names (or ends) some ``nn.Linear``'s name, as peft matches them;
    else a ConfigError listing the linear layers' names."""
    linears = [unwrapped_name(n) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
    for target in targets:
        if not any(n == target or n.endswith("." + target) for n in linears):
            raise ConfigError(f"lora.target_modules: {target!r} names no linear layer of the "
                              f"model; its linear layers are named {', '.join(leaves)}")


def apply_lora(model: nn.Module, cfg) -> nn.Module:
    """Inject ``[lora]``'s adapters into ``model`` in place (on meta: they are
    materialized with the model, then :func:`init_adapters`); everything else frozen.
    Nothing without ``lora.enable``."""
    if not cfg.lora.enable:
        return model
    import peft

    targets = lora_targets(cfg)
    _check_targets(model, targets)
    lo = cfg.lora
    config = peft.LoraConfig(r=lo.rank, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
                             target_modules=targets, bias="none")
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    return model


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(unwrapped name, layer) of every peft LoRA layer, in module order."""
    from peft.tuners.lora import LoraLayer

    return [(unwrapped_name(n), m) for n, m in model.named_modules()
            if isinstance(m, LoraLayer)]


def adapter_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(unwrapped name, parameter) of every adapter weight, in parameter order. Read
    within ``disable_active_parametrization`` for the sharded parameters themselves."""
    return [(unwrapped_name(n), p) for n, p in model.named_parameters() if is_adapter(n)]


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Each adapter as peft's ``reset_lora_parameters`` makes it, drawn in parameter order
    from ``seed`` on a full CPU tensor: A ``kaiming_uniform_(a=sqrt(5))``, B zeros (so
    the adapted model starts as the base). Each rank keeps its shard."""
    import simplefsdp

    torch.manual_seed(seed)
    with simplefsdp.disable_active_parametrization():
        for name, param in adapter_params(model):
            full = torch.zeros(param.shape, dtype=param.dtype)
            if ".lora_A." in f".{name}.":
                nn.init.kaiming_uniform_(full, a=math.sqrt(5))
            copy_into_shard(param, full)


def trainable_summary(model: nn.Module) -> str:
    """'N of M parameters trainable (LoRA adapters)' for the start-up line."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (f"[simplefsdp] lora: {trainable:,} of {total:,} parameters trainable "
            f"({100 * trainable / total:.2f}%), {len(lora_layers(model))} adapted layers")


@torch.no_grad()
def _full_adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter weight gathered to a full CPU tensor (a collective; on every rank)."""
    import simplefsdp

    out = {}
    with simplefsdp.disable_active_parametrization():
        for name, param in adapter_params(model):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[name] = full.detach().to("cpu", copy=True)
    return out


def peft_key(name: str) -> str:
    """The key peft saves adapter weight ``name`` under: below ``base_model.model``,
    without the adapter's name (``...q_proj.lora_A.default.weight`` ->
    ``base_model.model....q_proj.lora_A.weight``)."""
    parts = [p for p in name.split(".") if p != ADAPTER]
    return "base_model.model." + ".".join(parts)


def save_adapter(model: nn.Module, folder: str | Path, base_model: str | None = None) -> Path:
    """Write the adapters as a peft adapter folder (a collective: every rank calls it;
    rank 0 writes). ``PeftModel.from_pretrained(base model, folder)`` loads it.
    ``base_model``: the Hugging Face folder the adapters belong to (recorded as peft's
    ``base_model_name_or_path``, with the causal-LM task), None for our own models."""
    import copy

    from safetensors.torch import save_file

    folder = Path(folder)
    tensors = {peft_key(n): t.contiguous() for n, t in _full_adapters(model).items()}
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = copy.copy(model.peft_config[ADAPTER])
        config.inference_mode = True  # as peft saves it
        if base_model is not None:
            config.base_model_name_or_path = str(Path(base_model).resolve())
            config.task_type = "CAUSAL_LM"
        config.save_pretrained(str(folder))
    if dist.is_initialized():
        dist.barrier()
    return folder


FileTensors = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


def merging(model: nn.Module, to_files: FileTensors) -> FileTensors:
    """``to_files`` of an export (``hf.export.export_hf``) with the adapters folded in:
    an adapted layer's weight is written as ``W + scale * B @ A`` (peft's merge), the
    adapters themselves are not written. Gathers the adapters now (a collective)."""
    adapters = _full_adapters(model)
    deltas = {}
    for name, layer in lora_layers(model):
        a = adapters[f"{name}.lora_A.{ADAPTER}.weight"]
        b = adapters[f"{name}.lora_B.{ADAPTER}.weight"]
        deltas[f"{name}.weight"] = layer.scaling[ADAPTER] * (b @ a)

    def merged(name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
        if is_adapter(name):
            return {}
        if name in deltas:
            full = full + deltas[name].to(full.dtype)
        return to_files(name, full)

    return merged
