"""The Hugging Face pieces of the model families (``hf.family``: Hugging Face causal
LMs; ``models.llama_family``: our Llama, initialized from or exported to a Hugging Face
Llama folder): folder checks, tokenizer files, sharded loading, FLOPs, export.

Each is imported only when a job asks for it; nothing here imports transformers & co.
at import time.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import HFError, require
from .model import text_config


def validate_folder(cfg, folder: str) -> None:
    """Config checks of a Hugging Face folder (``model.hf_path`` or ``init_from_hf``)
    that need no Hugging Face import."""
    if cfg.model.hf_path is not None and cfg.model.init_from_hf is not None:
        raise HFError("model.hf_path and model.init_from_hf exclude each other: hf_path trains "
                      "transformers' own class, init_from_hf our Llama preset")
    from .model import check_folder, refuse_unsupported

    check_folder(folder)
    refuse_unsupported(cfg.parallel.tp, cfg.parallel.pp)
    if cfg.model.router_aux_loss_coef is not None:  # the folder must have a balance loss
        from .model import job_config

        job_config(cfg)


# ---------------------------------------------------------------------------------------
# Tokenizer and data.
# ---------------------------------------------------------------------------------------
def choose_tokenizer(cfg):
    """``data.tokenizer``: 'byte'; a path; 'auto' = the ``hf_path`` folder's own, or bytes."""
    from ..corpus.text import build_tokenizer
    from .tokenizer import load_tokenizer

    name = cfg.data.tokenizer
    folder = cfg.model.hf_path or cfg.model.init_from_hf
    if name == "auto":
        name = cfg.model.hf_path or "byte"
    if name == "byte":
        return build_tokenizer("byte")
    eos = None
    if folder is not None:
        from .model import load_config

        eos = getattr(text_config(load_config(folder)), "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) else eos
    return load_tokenizer(name, eos)


def check_vocab(cfg, tokenizer) -> None:
    """Every token id must index the Hugging Face model's embedding."""
    if cfg.model.hf_path is None:
        return
    from .model import load_config

    vocab = text_config(load_config(cfg.model.hf_path)).vocab_size
    if tokenizer.vocab_size > vocab:
        source = cfg.data.tokenizer if cfg.data.tokenizer != "auto" else cfg.model.hf_path
        raise HFError(f"the tokenizer ({source}) has {tokenizer.vocab_size} tokens but "
                      f"{Path(cfg.model.hf_path) / 'config.json'} has vocab_size = {vocab}; "
                      f"use the model's own tokenizer (data.tokenizer = 'auto')")


# ---------------------------------------------------------------------------------------
# Model.
# ---------------------------------------------------------------------------------------
def build_hf(cfg, mesh, dims, device):
    """(module to call, model): transformers' class for ``model.hf_path``, built on meta,
    parallelized (:func:`parallelize_hf`), its weights loaded sharded."""
    from . import conversion
    from .model import (
        build_on_meta,
        causal_lm_call,
        job_config,
        materialize,
        refuse_unsupported,
    )
    from .weights import WeightFiles, check_sources, load_sharded

    refuse_unsupported(cfg.parallel.tp, cfg.parallel.pp)
    folder = Path(cfg.model.hf_path)
    model = build_on_meta(job_config(cfg))  # the balance loss as model.router_aux_loss_coef
    files = WeightFiles(folder)
    sources = conversion.sources(model, files)  # file names -> in-memory, as transformers
    check_sources(model, files, sources)  # names and shapes, before anything is allocated
    if cfg.checkpoint.export_hf:
        conversion.check_export(model)
    runnable = parallelize_hf(model, mesh, dims, cfg, compile_=False)
    materialize(model, device)
    report = load_sharded(model, folder, cfg.model.load_weights, sources)
    _print_report(report, folder, cfg.model.load_weights)
    if cfg.compile.enable:
        runnable = _compile(model, mesh, cfg)
    return causal_lm_call(runnable, model), model


def parallelize_hf(model: nn.Module, mesh, dims, cfg, compile_: bool = True) -> nn.Module:
    """A Hugging Face causal LM's parallelisms, in place: LoRA adapters (``[lora]``,
    ``models/lora.py``), context parallelism
    (:mod:`.context_parallel`, ``parallel.cp_ring`` / ``cp_ulysses``), MoE experts adapted
    (:mod:`.experts`) and, with ``parallel.ep``, split over the experts' mesh, activation
    checkpointing per decoder layer, data parallel, then (``compile.enable``, and
    ``compile_``) compile. An MoE's routers (``mlp.gate``) stay float32 under mixed
    precision (added to ``training.mixed_precision_fp32_modules``), and transformers
    records their logits before data parallel casts them back to the model's dtype (its
    balance loss sees the float32 logits)."""
    from ..models.lora import apply_lora
    from ..models.parallelize import apply_dp, with_fp32_modules
    from ..parallel.activation_checkpoint import apply_ac
    from .experts import adapt_experts, expert_parallel, router_globs
    from .model import decoder_layers

    apply_lora(model, cfg)  # [lora]: adapters in, the rest frozen; before anything wraps
    if dims.cp > 1:  # ring / Ulysses attention, global positions
        from .context_parallel import apply_cp

        apply_cp(model, mesh, cfg.training.seq_len, cfg.parallel.cp_rotate)
    if adapt_experts(model):
        cfg = with_fp32_modules(cfg, router_globs(model))
        _record_router_logits_first(model)
    if cfg.activation_checkpoint.mode != "none":  # layers looked up only when wrapped
        apply_ac(model, cfg.activation_checkpoint.mode,
                 layers=decoder_layers(model, model.config))
    if cfg.parallel.ep > 1:
        expert_parallel(model, mesh, cfg)
    apply_dp(model, mesh, cfg)
    return _compile(model, mesh, cfg) if compile_ and cfg.compile.enable else model


def _record_router_logits_first(model: nn.Module) -> None:
    """transformers' output-recording hooks installed now (it installs them lazily, on the
    first call asking for router logits): forward hooks run in the order registered, so
    they record each router's output before a per-module mixed-precision cast."""
    if getattr(text_config(model.config), "output_router_logits", False):
        from transformers.utils.output_capturing import maybe_install_capturing_hooks

        maybe_install_capturing_hooks(model)


def aux_loss(model: nn.Module):
    """The balance loss of ``model``'s last forward, coefficient applied (None: not an
    MoE, or its config does not add one: ``output_router_logits`` false)."""
    return getattr(model, "_sf_aux_loss", None)


def metric_columns(cfg, model: nn.Module) -> tuple[str, ...]:
    """An MoE's figures (``parallel.expert.MOE_COLUMNS``); none for a dense model."""
    from ..parallel.expert import MOE_COLUMNS
    from .experts import experts_modules

    return MOE_COLUMNS if experts_modules(model) else ()


def after_step(s, step_aux) -> dict[str, float]:
    """An MoE's figures of the step (``parallel.expert.expert_figures``): every rank's
    routed slots per expert summed over all ranks (data parallel only: TP and PP are
    refused), the balance loss; nothing for a dense model. Collectives."""
    from ..parallel.expert import expert_figures
    from .experts import take_loads

    loads = take_loads(s.model)
    if not loads.numel():
        return {}
    loads = loads.to(s.device)
    dist.all_reduce(loads)
    return expert_figures(loads, step_aux, s.device)


def _compile(model: nn.Module, mesh, cfg) -> nn.Module:
    """The simplefsdp backend, graph breaks allowed (Hugging Face losses and masks
    break graphs in some architectures); adapted MoE experts traced with their split
    sizes as unbacked sizes, as our MoE's."""
    from ..models.parallelize import compile_backend_for, compile_model

    return compile_model(model, compile_backend_for(mesh, cfg, model), fullgraph=False)


def build_llama_from_hf(cfg, mesh, dims, device, convert):
    """Our Llama preset, its weights read (sharded, ``convert``: our names -> the folder's)
    from a Hugging Face Llama folder. RoPE is recomputed; no full random init, so no rank
    holds the whole model."""
    import simplefsdp

    from ..models.llama import Transformer
    from ..models.parallelize import parallelize
    from .llama_layout import check_matches
    from .model import load_config, refuse_unsupported
    from .weights import WeightFiles, check_sources, load_sharded, unique_tensors

    refuse_unsupported(cfg.parallel.tp, cfg.parallel.pp)
    folder = Path(cfg.model.init_from_hf)
    args = cfg.model.model_args()
    check_matches(load_config(folder), args, str(folder / "config.json"))
    with torch.device("meta"):
        model = Transformer(args)
    names = [n for names, _ in unique_tensors(model) for n in names]
    sources = convert(names, cfg)
    check_sources(model, WeightFiles(folder), sources)
    runnable = parallelize(model, mesh, dims, cfg)
    model.to_empty(device=device)
    with simplefsdp.disable_active_parametrization():
        model.rope_cache = model._rope_cache(device)
    report = load_sharded(model, folder, cfg.model.load_weights, sources)
    _print_report(report, folder, cfg.model.load_weights)
    return runnable, model


def _print_report(report, folder: Path, mode: str) -> None:
    """Rank 0 prints each rank's load time, bytes read and peak RSS while loading."""
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (report.seconds, report.bytes_read, report.peak_rss_bytes,
                                  report.peak_anon_bytes))
    if dist.get_rank() == 0:
        per_rank = ", ".join(f"rank {r}: {s:.2f}s, read {b / 2**20:.1f} MiB, peak RSS "
                             f"{m / 2**20:.0f} MiB ({a / 2**20:.0f} MiB private)"
                             for r, (s, b, m, a) in enumerate(rows))
        print(f"[simplefsdp] loaded {report.tensors} tensors from {folder} "
              f"(load_weights = {mode}): {per_rank}", flush=True)


def flops_per_token(cfg, model: nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token of a Hugging Face model: 6 per parameter a token uses
    plus attention (``12 * layers * hidden * seq_len``); of the routed experts of an MoE,
    a token uses ``num_experts_per_tok`` of ``E``."""
    from ..models.llama import num_params
    from .experts import WEIGHTS, experts_modules

    text = text_config(model.config)
    layers = getattr(text, "num_hidden_layers", 0)
    hidden = getattr(text, "hidden_size", 0)
    top_k = getattr(text, "num_experts_per_tok", None)
    idle = 0.0
    for _, module in experts_modules(model):
        experts = module._parameters["gate_up_proj"].shape[0]
        size = sum(module._parameters[w].numel() for w in WEIGHTS)
        idle += size * (experts - min(top_k or experts, experts)) / experts
    return 6.0 * (num_params(model) - idle) + 12.0 * layers * hidden * seq_len


# ---------------------------------------------------------------------------------------
# Export.
# ---------------------------------------------------------------------------------------
def export_hf_model(cfg, model: nn.Module, tokenizer) -> Path:
    """``checkpoint.export_hf`` of a Hugging Face model: its own config, and its files'
    names and layout (transformers' reverse conversion, :mod:`.conversion`)."""
    require("transformers", "safetensors")
    from .conversion import file_tensors
    from .export import export_hf

    config = type(model.config).from_dict(model.config.to_dict())
    to_files = _merged(cfg, model, lambda name, full: file_tensors(model, name, full))
    return _exporting(lambda folder: export_hf(model, folder, config, tokenizer,
                                               to_files=to_files), cfg)


def _merged(cfg, model: nn.Module, to_files):
    """With ``[lora]``, an export writes the adapted weights (``models.lora.merging``)."""
    if not cfg.lora.enable:
        return to_files
    from ..models.lora import merging

    return merging(model, to_files)


def export_llama(cfg, model: nn.Module, tokenizer) -> Path:
    """``checkpoint.export_hf`` of our Llama: a Hugging Face Llama folder."""
    require("transformers", "safetensors")
    from .export import export_hf, renamed
    from .llama_layout import hf_config, rope_heads, to_hf_name

    args = cfg.model.model_args()
    config = hf_config(args)
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None:
        config.eos_token_id = eos
    to_files = _merged(cfg, model, renamed(to_hf_name, lambda name: rope_heads(name, args)))
    return _exporting(lambda folder: export_hf(model, folder, config, tokenizer,
                                               to_files=to_files), cfg)


def export_moe(cfg, model: nn.Module, tokenizer) -> Path:
    """``checkpoint.export_hf`` of our MoE: a Mixtral folder (``convert.hf_moe_config``;
    ``validate_moe_export`` refused what Mixtral computes otherwise). Names and RoPE rows
    as for our Llama; the fused experts are saved per expert by transformers' reverse
    conversion for Mixtral (``conversion.file_tensors`` on a meta Mixtral)."""
    require("transformers", "safetensors")
    from transformers import AutoModelForCausalLM

    from .conversion import file_tensors
    from .export import export_hf, renamed
    from .llama_layout import hf_moe_config, rope_heads, to_hf_name

    args = cfg.model.model_args()
    config = hf_moe_config(args)
    config.eos_token_id = getattr(tokenizer, "eos_id", None)
    with torch.device("meta"):  # transformers' conversion mapping is looked up on a model
        layout = AutoModelForCausalLM.from_config(config)
    to_hf = renamed(to_hf_name, lambda name: rope_heads(name, args))

    def to_files(name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
        return {key: tensor for hf_name, value in to_hf(name, full).items()
                for key, tensor in file_tensors(layout, hf_name, value).items()}

    return _exporting(lambda folder: export_hf(model, folder, config, tokenizer,
                                               to_files=to_files), cfg)


def _exporting(write, cfg) -> Path:
    """Run ``write(<metrics.output_dir>/hf)`` (a collective); rank 0 says where and how
    long it took."""
    started = time.perf_counter()
    out = write(Path(cfg.metrics.output_dir) / "hf")
    if dist.get_rank() == 0:
        print(f"[simplefsdp] exported a Hugging Face model to {out} "
              f"({time.perf_counter() - started:.1f}s)", flush=True)
    return out
