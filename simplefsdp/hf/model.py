"""A local Hugging Face causal LM, built on the meta device, parallelized with
``data_parallel`` and loaded sharded.

Parameters are created on ``meta`` (each one is made on the CPU and moved, one at a
time, with the layers' own random init switched off), buffers stay real: non-persistent
buffers such as RoPE frequencies are computed by the model's ``__init__`` and are not
in the weight files. Then: activation checkpointing on the decoder layers, our
``data_parallel``, ``to_empty`` for the parameters only, and :func:`.weights.load_sharded`.

Supported: ``data_parallel`` in every mode, mixed precision, activation checkpointing
(full / selective), ``torch.compile`` (graph breaks allowed), context parallelism for the
Llama family (:mod:`.context_parallel`). Refused: tensor and pipeline
parallelism (``parallel.tp > 1``, ``parallel.pp > 1``): Hugging Face module names vary
by architecture and no plan is written for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from . import HFError, require


def check_folder(path: str | Path) -> Path:
    """``path`` is a folder with config.json, else an HFError saying what is missing."""
    folder = Path(path)
    if not folder.is_dir():
        raise HFError(f"model.hf_path = {str(path)!r} is not a folder; give a local Hugging "
                      f"Face model folder (config.json + *.safetensors)")
    if not (folder / "config.json").is_file():
        raise HFError(f"{folder}: no config.json; a Hugging Face model folder holds "
                      f"config.json and its safetensors weights (save_pretrained writes both)")
    return folder


def text_config(config):
    """The language model's part of a transformers config (itself for a text model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load_config(path: str | Path):
    """The folder's ``transformers`` config (local files only)."""
    require()
    from transformers import AutoConfig

    folder = check_folder(path)
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise HFError(f"{folder / 'config.json'}: transformers cannot read it: {e}") from None


def job_config(cfg):
    """``model.hf_path``'s config as the job trains it: ``model.router_aux_loss_coef``, if
    set, replaces the folder's balance loss (``output_router_logits`` on for a weight > 0,
    off for 0; ``router_aux_loss_coef`` that weight). An HFError naming the key if the
    folder's model has no such loss (no ``output_router_logits`` in its config)."""
    config = load_config(cfg.model.hf_path)
    coef = cfg.model.router_aux_loss_coef
    if coef is None:
        return config
    text = text_config(config)
    if not hasattr(text, "output_router_logits"):
        raise HFError(f"model.router_aux_loss_coef = {coef}: "
                      f"{Path(cfg.model.hf_path) / 'config.json'} ({type(text).__name__}) has "
                      f"no output_router_logits, so no MoE balance loss to set; leave "
                      f"model.router_aux_loss_coef out")
    text.output_router_logits, text.router_aux_loss_coef = coef > 0, coef
    return config


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Within this block, modules keep their parameters on ``meta`` (buffers stay real).

    The built-in layers' ``reset_parameters`` are switched off meanwhile: their random
    init would only be thrown away.
    """
    register = nn.Module.register_parameter
    layers = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv1d)
    resets = {cls: cls.__dict__.get("reset_parameters") for cls in layers}

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    for cls in layers:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        for cls, reset in resets.items():
            if reset is None:
                del cls.reset_parameters
            else:
                cls.reset_parameters = reset


def build_on_meta(config) -> nn.Module:
    """``AutoModelForCausalLM`` from ``config`` with parameters on meta, in float32."""
    from transformers import AutoModelForCausalLM

    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config)  # torch default: float32
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def decoder_layers(model: nn.Module, config) -> nn.ModuleList:
    """The ``nn.ModuleList`` of the model's ``num_hidden_layers`` decoder blocks (what
    activation checkpointing wraps: ``parallel.activation_checkpoint.apply_ac``'s
    ``layers``)."""
    text = text_config(config)
    n = getattr(text, "num_hidden_layers", None)
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise HFError(f"cannot find the {n} decoder layers of {type(model).__name__} for "
                  f"activation checkpointing; set activation_checkpoint.mode = 'none'")


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) parameters on ``device``; buffers keep their values."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def causal_lm_call(module: Callable, model: nn.Module
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``tokens -> logits`` for a Hugging Face causal LM (``module``: ``model`` or its
    compiled wrapper; no cache, no loss). Under context parallelism (:mod:`.context_parallel`)
    ``tokens`` are this rank's part of each sequence and ``position_ids`` their global
    positions (``model._sf_positions``). An MoE whose config asks for the router logits
    (``output_router_logits``) returns transformers' balance loss (its own
    ``load_balancing_loss_func`` over this call's tokens) as ``aux_loss``; times the
    config's ``router_aux_loss_coef`` it is kept as ``model._sf_aux_loss`` for the loss
    (:func:`.hooks.aux_loss`), as transformers adds it to its own loss."""
    coef = getattr(text_config(model.config), "router_aux_loss_coef", None)
    positions = getattr(model, "_sf_positions", None)  # context parallel: global positions

    def forward(tokens: torch.Tensor) -> torch.Tensor:
        extra = {} if positions is None else {"position_ids": positions.to(tokens.device)[None]}
        out = module(input_ids=tokens, use_cache=False, **extra)
        aux = getattr(out, "aux_loss", None)
        model._sf_aux_loss = None if aux is None or coef is None else coef * aux
        return out.logits

    return forward


def refuse_unsupported(tp: int, pp: int) -> None:
    if tp > 1 or pp > 1:
        raise HFError(f"model.hf_path: parallel.tp = {tp}, parallel.pp = {pp}; Hugging Face "
                      f"models run with data parallelism (any dp_mode), activation "
                      f"checkpointing and compile, not tensor or pipeline parallelism: set "
                      f"parallel.tp = 1 and parallel.pp = 1")
