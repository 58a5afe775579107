"""Can a model's shapes be split the way a layout asks? The checks every entry point runs
before any process group exists (the trainer's config validation, the benchmark's, and the
parallelisms themselves), so every rank fails at once with the same message naming the key."""

from __future__ import annotations

from ..errors import ConfigError
from ..models.llama import ModelArgs, ffn_hidden_dim

__all__ = ["check_pipeline", "check_seq_len", "check_tp"]


def check_tp(args: ModelArgs, tp: int) -> None:
    """Raise a ConfigError if the model's heads or FFN width cannot be split ``tp`` ways."""
    for what, value in (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.kv_heads),
                        ("the FFN hidden size", ffn_hidden_dim(args))):
        if value % tp:
            raise ConfigError(f"parallel.tp = {tp} does not divide {what} = {value}")


def check_pipeline(args: ModelArgs, pp: int) -> None:
    """Raise a ConfigError if the model cannot be cut into ``pp`` pipeline stages: each
    stage needs a block, and tied embeddings would need the embedding and the output
    (first and last stage) on one rank. ``pipeline.split_stage`` relies on this."""
    if pp == 1:
        return
    if args.n_layers < pp:
        raise ConfigError(f"parallel.pp = {pp} stages need at least {pp} layers, the model "
                          f"has model.n_layers = {args.n_layers}")
    if args.tie_embeddings:
        raise ConfigError("model.tie_embeddings = true cannot be split into pipeline stages "
                          "(parallel.pp > 1): the embedding and the output live on "
                          "different ranks")


def check_seq_len(seq_len: int, args: ModelArgs) -> None:
    """Raise a ConfigError if ``training.seq_len`` exceeds the model's ``max_seq_len``."""
    if seq_len > args.max_seq_len:
        raise ConfigError(f"training.seq_len = {seq_len} exceeds the model's max_seq_len = "
                          f"{args.max_seq_len}; lower training.seq_len or raise "
                          f"model.max_seq_len")
