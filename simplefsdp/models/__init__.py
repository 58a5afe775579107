"""Models shipped with simplefsdp (a Llama-3-style decoder)."""

from .llama import (
    LLAMA3_PRESETS,
    ModelArgs,
    Transformer,
    ffn_hidden_dim,
    flops_per_token,
    num_params,
)

__all__ = [
    "LLAMA3_PRESETS",
    "ModelArgs",
    "Transformer",
    "ffn_hidden_dim",
    "flops_per_token",
    "num_params",
]
