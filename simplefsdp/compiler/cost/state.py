"""Bytes a training step holds outside the compiled graphs: the optimizer's state.

The planner's predicted peak (``cost.memory``) counts what lives inside the forward and
backward graphs: their inputs (the local parameter shards, saved activations), gathered
parameters, gradients. The optimizer's state lives across the whole step outside them
(AdamW: two fp32 tensors per parameter, twice the sharded parameters), so a
``memory_limit_gb`` that means the step's peak must leave room for it:
``compile_backend(state_bytes_outside_graphs=optimizer_state_bytes(...))``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...mesh import local_shard

__all__ = ["STATE_TENSORS_PER_PARAM", "model_state_bytes_per_param", "optimizer_state_bytes",
           "optimizer_traffic_bytes_per_param", "sharded_param_bytes"]

# Full-size state tensors per parameter, in the parameter's dtype (torch's defaults:
# scalar step counters, a few bytes per parameter, are left out).
STATE_TENSORS_PER_PARAM = {
    "adam": 2,  # exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad)
    "adamw": 2,
    "sgd": 0,  # + momentum_buffer with momentum != 0
}


def model_state_bytes_per_param(optimizer: str = "adamw", param_bytes: int = 4) -> int:
    """Bytes a trained parameter holds through a step: itself, its gradient and the
    optimizer's state tensors, all in the parameter's dtype (``param_bytes``; the trainer
    keeps float32 shards): 16 for AdamW."""
    return param_bytes * (2 + STATE_TENSORS_PER_PARAM[optimizer.lower()])


def optimizer_traffic_bytes_per_param(optimizer: str = "adamw", param_bytes: int = 4) -> int:
    """Memory traffic of one optimizer step per parameter, with gradient clipping: read
    the parameter, its gradient and the state tensors, write the parameter and the state
    back, and read the gradients twice more (the norm, then the clip's scaling): 36 B
    for AdamW on float32."""
    states = STATE_TENSORS_PER_PARAM[optimizer.lower()]
    reads, writes, clipping = 2 + states, 1 + states, 2
    return param_bytes * (reads + writes + clipping)


def sharded_param_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's share of ``params`` (a DTensor's local shard; each tensor
    once). Works on meta tensors, so it can run before the model is materialised."""
    seen: set[int] = set()
    total = 0
    for p in params:
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        local = local_shard(p)
        total += local.numel() * local.element_size()
    return total


def optimizer_state_bytes(optimizer: str | type | torch.optim.Optimizer,
                          params: Iterable[torch.Tensor], *, amsgrad: bool = False,
                          momentum: float = 0.0) -> int:
    """Bytes of ``optimizer``'s state for the trainable ``params`` on this rank.

    ``optimizer``: a name ("adamw", "adam", "sgd"), an optimizer class, or an instance
    (its ``amsgrad`` / ``momentum`` defaults are read from it). Assumes the state has
    the parameters' dtype and sharding (torch's optimizers on DTensor parameters):
    Adam/AdamW 2x the sharded parameter bytes (3x with ``amsgrad``), SGD 1x with
    ``momentum`` (0 without). Other optimizers raise: pass the bytes to
    ``compile_backend(state_bytes_outside_graphs=...)`` yourself.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        amsgrad = bool(optimizer.defaults.get("amsgrad", amsgrad))
        momentum = float(optimizer.defaults.get("momentum", momentum))
        name = type(optimizer).__name__
    elif isinstance(optimizer, type):
        name = optimizer.__name__
    elif isinstance(optimizer, str):
        name = optimizer
    else:
        raise ValueError(f"optimizer must be a name, an optimizer class or instance, got "
                         f"{type(optimizer).__name__}")
    key = name.lower()
    if key not in STATE_TENSORS_PER_PARAM:
        raise ValueError(f"no state size known for optimizer {name!r} (known: "
                         f"{sorted(STATE_TENSORS_PER_PARAM)}); pass the bytes its state "
                         f"holds on this rank as compile_backend(state_bytes_outside_graphs=...)")
    tensors = STATE_TENSORS_PER_PARAM[key]
    if key.startswith("adam") and amsgrad:
        tensors += 1
    if key == "sgd" and momentum:
        tensors += 1
    return tensors * sharded_param_bytes(params)
