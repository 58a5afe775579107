"""Model families, looked up by name: what the trainer needs from each kind of model.

A family (our Llama, Hugging Face causal LMs, ...) is one module that builds a
:class:`ModelFamily` and calls :func:`register` when imported. :data:`FAMILIES` names
that module; :func:`get` imports it on first use. The registry imports no family
(family -> registry, never the reverse), so the trainer can ask for any family without
importing the others' packages (``import simplefsdp.train`` never imports
``simplefsdp.hf``).

Adding a family: its module, and one line in :data:`FAMILIES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# family name -> the module that registers it (imported on first lookup)
FAMILIES = {
    "llama": "simplefsdp.models.llama_family",
    "hf": "simplefsdp.hf.family",
    "moe": "simplefsdp.models.moe_family",
}

Config = Any  # a config.job.JobConfig; the registry imports no config


@dataclass(frozen=True)
class ModelFamily:
    """One family's entry. Every callable takes the job's config first (``parallelize``:
    the model). ``dims`` is the run's ``mesh.ParallelDims`` (the trainer's ``Setup.dims``;
    while validating, the config's sizes), ``mesh`` the mesh built from it: a family reads
    the layout from them and never rebuilds one from ``cfg.parallel``."""

    name: str
    # Config checks of this family, run when the config is loaded: cheap, no model built.
    # (cfg, dims)
    validate: Callable[[Config, Any], None]
    # (module the loop calls, the underlying model): built, parallelized (``parallelize``),
    # materialized on the device and initialized or loaded (``convert``):
    # (cfg, mesh, dims, device).
    build: Callable[[Config, Any, Any, Any], tuple[Any, Any]]
    # The parallelisms applied to a built model: (model, mesh, dims, cfg) -> module to call.
    parallelize: Callable[[Any, Any, Any, Config], Any]
    # The tokenizer ``data.tokenizer`` names ('auto': this family's default).
    tokenizer: Callable[[Config], Any]
    # Refuse a tokenizer whose ids the model's embedding cannot index.
    check_tokenizer: Callable[[Config, Any], None]
    # Names in a weights folder for the model's parameters: (parameter names, cfg) ->
    # {name: where to read it}; None when the folder uses the model's own names.
    convert: Callable[[list[str], Config], dict] | None
    # Training FLOPs per token: (cfg, built model, sequence length).
    flops_per_token: Callable[[Config, Any, int], float]
    # The model facts a checkpoint is written for (a resume checks them).
    fingerprint: Callable[[Config], dict]
    # Write the exports the config asks for; the written folder or None. A collective.
    export: Callable[[Config, Any, Any], Path | None]
    # Whether ``parallelize`` applies context parallelism (parallel.cp_ring/cp_ulysses).
    context_parallel: bool = False
    # Whether ``compile.enable`` makes one graph of the model (``fullgraph``); False: it
    # breaks where it must (an MoE's data-dependent expert dispatch), which decides the
    # activation checkpointing its compiled blocks get
    # (``parallel.activation_checkpoint.ac_mode_run``).
    fullgraph: bool = True
    # Mixture of experts (left out: a dense family). Whether ``parallel.ep > 1`` applies.
    expert_parallel: bool = False
    # The built model's auxiliary loss from its last forward (coefficient applied; a mean
    # over that forward's tokens), added to the loss; None when it has none.
    aux_loss: Callable[[Any], Any] | None = None
    # After each optimizer step: (Setup, this rank's share of the step's auxiliary loss)
    # -> the step's figures for the metrics (global over the ranks), e.g. the expert load;
    # also where the router's load-balancing bias moves. A collective.
    after_step: Callable[[Any, Any], dict[str, float]] | None = None
    # The names ``after_step`` returns, in order; or (cfg, built model) -> those names.
    metric_columns: tuple[str, ...] | Callable[[Config, Any], tuple[str, ...]] = ()


_REGISTERED: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Called by a family's module when it is imported."""
    if family.name not in FAMILIES:
        raise ValueError(f"model family {family.name!r} is not in models.registry.FAMILIES; "
                         f"add a line naming its module there")
    _REGISTERED[family.name] = family
    return family


def get(name: str) -> ModelFamily:
    """The family called ``name`` (its module imported on first use). A ValueError
    naming ``model.family`` for an unknown name."""
    if name not in FAMILIES:
        raise ValueError(f"model.family = {name!r} is not a model family; choose one of "
                         f"{', '.join(repr(n) for n in FAMILIES)}")
    if name not in _REGISTERED:
        importlib.import_module(FAMILIES[name])
    return _REGISTERED[name]
