"""Hugging Face causal LMs (``model.hf_path``) as a model family of ``models.registry``:
transformers' own class from a local folder, parallelized with ``data_parallel`` and
activation checkpointing, its weights loaded sharded under their own names, its
tokenizer the folder's own, exported back to a folder transformers opens."""

from __future__ import annotations

from pathlib import Path

from ..models import registry
from . import HFError, context_parallel, hooks


def _validate(cfg, dims) -> None:
    if cfg.model.hf_path is None:
        raise HFError(f"model.family = {cfg.model.family!r} trains a Hugging Face model: set "
                      f"model.hf_path to its local folder")
    hooks.validate_folder(cfg, cfg.model.hf_path)
    context_parallel.check_config(cfg, dims)  # parallel.cp_ring / cp_ulysses: does it fit


def _fingerprint(cfg) -> dict:
    """What a checkpoint is written for: the model's folder."""
    return {"hf_path": str(Path(cfg.model.hf_path).resolve())}


def _export(cfg, model, tokenizer) -> Path | None:
    return hooks.export_hf_model(cfg, model, tokenizer) if cfg.checkpoint.export_hf else None


registry.register(registry.ModelFamily(
    name="hf",
    validate=_validate,
    build=hooks.build_hf,
    parallelize=hooks.parallelize_hf,
    tokenizer=hooks.choose_tokenizer,
    check_tokenizer=hooks.check_vocab,
    convert=None,  # the folder's names, through transformers' own mapping (``hf.conversion``)
    flops_per_token=hooks.flops_per_token,
    fingerprint=_fingerprint,
    export=_export,
    context_parallel=True,  # Llama-family attention through hf.context_parallel
    expert_parallel=True,  # parallel.ep on a folder with fused MoE experts (hf.experts)
    aux_loss=hooks.aux_loss,  # transformers' balance loss, when the folder's config adds it
    after_step=hooks.after_step,
    metric_columns=hooks.metric_columns,  # an MoE's; none for a dense model
))
