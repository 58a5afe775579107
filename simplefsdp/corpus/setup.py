"""The trainer's data loader from ``[data]``: caches built once per node, then mapped.

With a process group, the node's local rank 0 (``LOCAL_RANK``, else the global rank 0)
builds the missing caches while the other ranks wait in one ``all_gather_object`` (the
process group's timeout bounds the wait); a build error reaches every rank. Then every
rank maps the caches: no rank holds the corpus in memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from ..errors import ConfigError
from .cache import (
    CacheSpec,
    TokenFile,
    build,
    default_cache_dir,
    token_dtype,
    tokenizer_fingerprint,
)
from .mixture import MixtureLoader
from .sources import resolve_all
from .text import TextDataset

VAL_FRACTION = 0.05  # the tail of each source held out for validation


def cache_dir(data_cfg) -> Path:
    return Path(data_cfg.cache_dir).expanduser() if data_cfg.cache_dir else default_cache_dir()


def _builds_here() -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0


def open_caches(data_cfg, tokenizer) -> list[TokenFile]:
    """Each source's cache, built if missing (see the module docstring); every check
    on the config runs before any tokenizing."""
    sources = resolve_all(data_cfg.dataset, list(data_cfg.weights))
    dtype = token_dtype(tokenizer.vocab_size)
    specs = [CacheSpec(src, tokenizer_fingerprint(tokenizer), getattr(tokenizer, "eos_id", None),
                       data_cfg.text_field, dtype, cache_dir(data_cfg)) for src in sources]
    workers = data_cfg.tokenize_workers or os.cpu_count() or 1
    error = None
    if _builds_here():
        try:
            for spec in specs:
                build(spec, tokenizer, workers, tokenizer.vocab_size)
        except ConfigError as e:
            error = str(e)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise ConfigError(error)
    return [TokenFile(spec.folder) for spec in specs]


def build_loader(cfg, tokenizer, dp_rank: int, dp_world: int, min_windows: int):
    """This data-parallel rank's training batches for the job ``cfg``."""
    d, t = cfg.data, cfg.training
    if d.document_mask and getattr(tokenizer, "eos_id", None) is None:
        raise ConfigError(f"data.document_mask = true needs a tokenizer with an EOS token to "
                          f"mark document ends; {type(tokenizer).__name__} has none (use a "
                          f"tokenizer.json or tiktoken file as data.tokenizer)")
    if d.streaming:
        from .stream import StreamLoader

        return StreamLoader(resolve_all(d.dataset, list(d.weights)), tokenizer, d.text_field,
                            t.batch_size, t.seq_len, dp_rank, dp_world, t.seed,
                            list(d.weights))
    files = open_caches(d, tokenizer)
    datasets = [TextDataset(f.meta["source"], tokenizer, VAL_FRACTION, tokens=f.tokens)
                for f in files]
    if len(datasets) == 1:
        return datasets[0].loader("train", t.batch_size, t.seq_len, dp_rank=dp_rank,
                                  dp_world=dp_world, seed=t.seed, min_windows=min_windows)
    per_source = [ds.loader("train", 1, t.seq_len, seed=t.seed + i)
                  for i, ds in enumerate(datasets)]
    return MixtureLoader(per_source, list(d.weights), t.batch_size, t.seq_len, dp_rank,
                         dp_world, t.seed)


def held_out_tokens(cfg, tokenizer) -> list:
    """Each source's held-out tail (its last ``VAL_FRACTION``, never in a training batch),
    from the caches :func:`build_loader` opened: the validation split."""
    return [TextDataset(f.meta["source"], tokenizer, VAL_FRACTION, tokens=f.tokens).val_tokens
            for f in open_caches(cfg.data, tokenizer)]
