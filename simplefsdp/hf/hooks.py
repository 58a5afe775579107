"""The calls the trainer makes for Hugging Face models, tokenizers, data and export.

Each returns the trainer's own default when the job asks for nothing from this package,
so the trainer calls them unconditionally:

- :func:`choose_tokenizer`, :func:`check_vocab`
- :func:`build_model` (``model.hf_path``: transformers' class; ``model.init_from_hf``: our
  Llama, weights read from a Hugging Face Llama folder); both load sharded
- :func:`flops_per_token`, :func:`export` (``checkpoint.export_hf``)
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import HFError, require


def uses_hf_model(cfg) -> bool:
    return cfg.model.hf_path is not None


def validate(cfg) -> None:
    """Config checks that need no Hugging Face import (run by ``JobConfig.validate``)."""
    m = cfg.model
    if m.hf_path is not None and m.init_from_hf is not None:
        raise HFError("model.hf_path and model.init_from_hf exclude each other: hf_path trains "
                      "transformers' own class, init_from_hf our Llama preset")
    if m.hf_path is not None or m.init_from_hf is not None:
        from .model import check_folder, refuse_unsupported

        check_folder(m.hf_path or m.init_from_hf)
        refuse_unsupported(cfg.parallel.tp, cfg.parallel.pp)
    name = cfg.data.tokenizer
    if name not in ("auto", "byte") and not Path(name).exists():
        raise HFError(f"data.tokenizer = {name!r}: choose 'auto', 'byte', or the path of a "
                      f"tokenizer.json, a folder holding one, or a tiktoken file")


# ---------------------------------------------------------------------------------------
# Tokenizer and data.
# ---------------------------------------------------------------------------------------
def choose_tokenizer(cfg):
    """``data.tokenizer``: 'byte'; a path; 'auto' = the ``hf_path`` folder's own, or bytes."""
    from ..train.data import build_tokenizer
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

        eos = getattr(_text_config(load_config(folder)), "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) else eos
    return load_tokenizer(name, eos)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_vocab(cfg, tokenizer) -> None:
    """Every token id must index the Hugging Face model's embedding."""
    if cfg.model.hf_path is None:
        return
    from .model import load_config

    vocab = _text_config(load_config(cfg.model.hf_path)).vocab_size
    if tokenizer.vocab_size > vocab:
        source = cfg.data.tokenizer if cfg.data.tokenizer != "auto" else cfg.model.hf_path
        raise HFError(f"the tokenizer ({source}) has {tokenizer.vocab_size} tokens but "
                      f"{Path(cfg.model.hf_path) / 'config.json'} has vocab_size = {vocab}; "
                      f"use the model's own tokenizer (data.tokenizer = 'auto')")


# ---------------------------------------------------------------------------------------
# Model.
# ---------------------------------------------------------------------------------------
def build_model(cfg, mesh, device: torch.device, default):
    """(module to call, model): ``default(cfg, mesh, device)`` unless a Hugging Face
    model or weights are configured."""
    if cfg.model.hf_path is not None:
        return _build_hf(cfg, mesh, device)
    if cfg.model.init_from_hf is not None:
        return _build_llama_from_hf(cfg, mesh, device)
    return default(cfg, mesh, device)


def _build_hf(cfg, mesh, device):
    from ..train.parallelize import apply_dp
    from .model import (
        apply_ac,
        build_on_meta,
        causal_lm_call,
        load_config,
        materialize,
        name_sources,
        refuse_unsupported,
    )
    from .weights import WeightFiles, load_sharded

    refuse_unsupported(cfg.parallel.tp, cfg.parallel.pp)
    folder = Path(cfg.model.hf_path)
    config = load_config(folder)
    model = build_on_meta(config)
    files = WeightFiles(folder)
    sources = name_sources(model, files, getattr(model, "base_model_prefix", ""))
    from .weights import check_sources

    check_sources(model, files, sources)  # names and shapes, before anything is allocated
    apply_ac(model, config, cfg.activation_checkpoint.mode)
    apply_dp(model, mesh, cfg)
    materialize(model, device)
    report = load_sharded(model, folder, cfg.model.load_weights, sources)
    _print_report(report, folder, cfg.model.load_weights)
    runnable = model
    if cfg.compile.enable:
        runnable = _compile(model, mesh, cfg)
    return causal_lm_call(runnable), model


def _compile(model: nn.Module, mesh, cfg) -> nn.Module:
    """The simplefsdp backend, graph breaks allowed (Hugging Face losses and masks
    break graphs in some architectures)."""
    from ..train.parallelize import compile_backend_for

    return torch.compile(model, backend=compile_backend_for(mesh, cfg, model))


def _build_llama_from_hf(cfg, mesh, device):
    """Our Llama preset, its weights read (sharded, converted) from a Hugging Face Llama
    folder. RoPE is recomputed; no full random init, so no rank holds the whole model."""
    import simplefsdp

    from ..models.llama import Transformer
    from ..train.parallelize import parallelize
    from .convert import check_matches, sources_from_hf
    from .model import load_config, refuse_unsupported
    from .weights import WeightFiles, check_sources, load_sharded, unique_tensors

    refuse_unsupported(cfg.parallel.tp, cfg.parallel.pp)
    folder = Path(cfg.model.init_from_hf)
    args = cfg.model.model_args()
    check_matches(load_config(folder), args, str(folder / "config.json"))
    with torch.device("meta"):
        model = Transformer(args)
    names = [n for names, _ in unique_tensors(model) for n in names]
    sources = sources_from_hf(names, args)
    check_sources(model, WeightFiles(folder), sources)
    runnable = parallelize(model, mesh, cfg)
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
    """Training FLOPs per token of a Hugging Face model: 6 per parameter plus attention
    (``12 * layers * hidden * seq_len``); None for our own Llama."""
    if cfg.model.hf_path is None:
        return None
    from ..models.llama import num_params

    text = _text_config(model.config)
    layers = getattr(text, "num_hidden_layers", 0)
    hidden = getattr(text, "hidden_size", 0)
    return 6.0 * num_params(model) + 12.0 * layers * hidden * seq_len


# ---------------------------------------------------------------------------------------
# Export.
# ---------------------------------------------------------------------------------------
def export(cfg, model: nn.Module, tokenizer) -> Path | None:
    """``checkpoint.export_hf``: write ``<metrics.output_dir>/hf`` (a collective)."""
    if not cfg.checkpoint.export_hf:
        return None
    require("transformers", "safetensors")
    from .export import export_hf

    folder = Path(cfg.metrics.output_dir) / "hf"
    started = time.perf_counter()
    if cfg.model.hf_path is not None:
        config = type(model.config).from_dict(model.config.to_dict())
        out = export_hf(model, folder, config, tokenizer)
    else:
        from .convert import hf_config, rope_heads, to_hf_name

        args = cfg.model.model_args()
        config = hf_config(args)
        eos = getattr(tokenizer, "eos_id", None)
        if eos is not None:
            config.eos_token_id = eos
        out = export_hf(model, folder, config, tokenizer, rename=to_hf_name,
                        rope_heads=lambda name: rope_heads(name, args))
    if dist.get_rank() == 0:
        print(f"[simplefsdp] exported a Hugging Face model to {out} "
              f"({time.perf_counter() - started:.1f}s)", flush=True)
    return out
