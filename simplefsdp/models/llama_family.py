"""Our Llama as a model family of ``models.registry``: built on meta, split into pipeline
stages, parallelized (``models/parallelize.py``), then initialized from ``training.seed`` or
loaded from a Hugging Face Llama folder (``model.init_from_hf``, converted by
``hf.llama_layout``).

Initialization does not depend on the parallel layout: on CPU every rank initializes
the full model from ``training.seed`` and keeps its shards; on CUDA parameters are
initialized as DTensors, whose random ops use offsets into one stream.

The Hugging Face pieces (weights, tokenizer files, export) are imported only when a job
asks for them.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch
from torch import nn

import simplefsdp
from simplefsdp.state_dict import unwrapped_name

from ..config.job import JobConfig
from ..corpus.text import build_tokenizer
from ..errors import ConfigError
from ..mesh import ParallelDims, copy_into_shard
from ..models import registry
from ..models.llama import Transformer, flops_per_token
from ..models.lora import is_adapter
from ..models.moe import MOE_PRESETS
from ..parallel.pipeline import split_stage
from .parallelize import parallelize


@torch.no_grad()
def _copy_full_init(model: nn.Module, cfg: JobConfig, model_cls: type = Transformer) -> None:
    """Overwrite every (sharded) parameter with its piece of a full model initialized
    from the seed on this rank: the same weights for every parallel layout."""
    torch.manual_seed(cfg.training.seed)
    with torch.device("meta"):
        reference = model_cls(cfg.model.model_args())
    reference.to_empty(device="cpu")
    reference.init_weights()
    full = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if is_adapter(name):  # LoRA: models.lora.init_adapters sets them
            continue
        copy_into_shard(param, full[unwrapped_name(name)])


def build_model(cfg: JobConfig, mesh, dims: ParallelDims, device: torch.device,
                model_cls: type = Transformer,
                parallelize_fn=parallelize) -> tuple[nn.Module, nn.Module]:
    """(module to call, the underlying Transformer/stage): built on meta, split for PP,
    parallelized, then materialized on ``device`` and initialized (or, with
    ``model.init_from_hf``, loaded). A family built on this one passes its own
    ``model_cls`` (a ``Transformer`` subclass) and ``parallelize_fn``."""
    if cfg.model.init_from_hf is not None:
        from ..hf.hooks import build_llama_from_hf

        return build_llama_from_hf(cfg, mesh, dims, device, _convert)
    args = cfg.model.model_args()
    with torch.device("meta"):
        model = model_cls(args)
    split_stage(model, cfg.parallel.pp, ParallelDims.local_rank(mesh, "pp"))
    runnable = parallelize_fn(model, mesh, dims, cfg)
    model.to_empty(device=device)
    with simplefsdp.disable_active_parametrization():
        with warnings.catch_warnings():  # CPU DTensor random ops; overwritten just below
            warnings.filterwarnings("ignore", message="DTensor random operators")
            torch.manual_seed(cfg.training.seed)
            model.init_weights()  # also recomputes the non-persistent RoPE buffer
        if device.type == "cpu":
            _copy_full_init(model, cfg, model_cls)
    return runnable, model


def _validate(cfg: JobConfig, dims: ParallelDims) -> None:
    if cfg.model.name in MOE_PRESETS:
        raise ConfigError(f"model.name = {cfg.model.name!r} is a mixture-of-experts preset: "
                          f"set model.family = 'moe' (or leave model.family out)")
    if cfg.model.hf_path is not None:
        raise ConfigError(f"model.hf_path trains a Hugging Face model: set model.family = "
                          f"'hf' (or leave it out), not {cfg.model.family!r}")
    if cfg.model.init_from_hf is not None:
        from ..hf.hooks import validate_folder

        validate_folder(cfg, cfg.model.init_from_hf)


def _tokenizer(cfg: JobConfig):
    """'auto' and 'byte': bytes; a tokenizer file: read by ``hf.tokenizer``."""
    if cfg.data.tokenizer in ("auto", "byte"):
        return build_tokenizer("byte")
    from ..hf.hooks import choose_tokenizer

    return choose_tokenizer(cfg)


def _check_tokenizer(cfg: JobConfig, tokenizer) -> None:
    vocab_size = cfg.model.model_args().vocab_size
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"the tokenizer ({type(tokenizer).__name__}) has "
                          f"{tokenizer.vocab_size} tokens but model.vocab_size = "
                          f"{vocab_size}; raise model.vocab_size")


def _convert(names: list[str], cfg: JobConfig) -> dict:
    """Where each of our parameters lies in a Hugging Face Llama folder."""
    from ..hf.llama_layout import sources_from_hf

    return sources_from_hf(names, cfg.model.model_args())


def _export(cfg: JobConfig, model: nn.Module, tokenizer) -> Path | None:
    if not cfg.checkpoint.export_hf:
        return None
    from ..hf.hooks import export_llama

    return export_llama(cfg, model, tokenizer)


def _flops_per_token(cfg: JobConfig, model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of the config's model (an MoE: its activated parameters,
    ``MoEArgs.ffn_matmul_params``); the MoE family's entry too."""
    return flops_per_token(cfg.model.model_args(), seq_len)


def _fingerprint(cfg: JobConfig) -> dict:
    """The model's arguments, which a checkpoint is written for; the MoE family's too."""
    return dataclasses.asdict(cfg.model.model_args())


registry.register(registry.ModelFamily(
    name="llama",
    validate=_validate,
    build=build_model,
    parallelize=parallelize,
    tokenizer=_tokenizer,
    check_tokenizer=_check_tokenizer,
    convert=_convert,
    flops_per_token=_flops_per_token,
    fingerprint=_fingerprint,
    export=_export,
    context_parallel=True,
))
