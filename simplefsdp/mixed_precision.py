"""Mixed precision policies, per model and per module (``data_parallel``'s ``mp_policy``
and ``mp_overrides``): which dtype a parameter is gathered and computed in, which its
gradient is reduced in, and the casts that let a module compute in its own dtype."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .state_dict import unwrapped_name


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for the gathered parameter (and compute) and for the gradient reduction.

    ``None`` keeps the parameter's own dtype. The sharded master weights, and so the
    optimizer, always stay in the dtype the model was built with.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def check_overrides(model: nn.Module, overrides: Mapping[str, MixedPrecisionPolicy] | None
                    ) -> dict[str, MixedPrecisionPolicy]:
    """``mp_overrides`` checked: globs to policies, each glob matching some module."""
    overrides = dict(overrides or {})
    names = [unwrapped_name(n) for n, _ in model.named_modules()]
    for glob, policy in overrides.items():
        if not isinstance(glob, str) or not isinstance(policy, MixedPrecisionPolicy):
            raise TypeError("mp_overrides maps module FQN globs (str) to "
                            "simplefsdp.MixedPrecisionPolicy")
        if not any(fnmatch.fnmatchcase(n, glob) for n in names):
            raise ValueError(f"mp_overrides: {glob!r} matches no module of the model "
                             f"(module names look like {names[1:4]})")
    return overrides


def _own_policy(name: str, overrides: dict[str, MixedPrecisionPolicy]
                ) -> MixedPrecisionPolicy | None:
    """The policy the globs give module ``name`` itself, or None; two globs matching one
    module must agree."""
    found = {p for glob, p in overrides.items() if fnmatch.fnmatchcase(name, glob)}
    if len(found) > 1:
        raise ValueError(f"mp_overrides: module {name!r} matches globs with different "
                         f"policies: {sorted(map(repr, found))}")
    return found.pop() if found else None


def policy_for(module_name: str, overrides: dict[str, MixedPrecisionPolicy],
                default: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """The policy of the parameters of module ``module_name``: that of the deepest
    module on its path (itself first) a glob matches, else ``default``."""
    parts = unwrapped_name(module_name).split(".") if module_name else []
    for depth in range(len(parts), 0, -1):
        policy = _own_policy(".".join(parts[:depth]), overrides)
        if policy is not None:
            return policy
    return default


def _cast_tree(value: object, dtype: torch.dtype) -> object:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, tuple | list):
        return type(value)(_cast_tree(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_tree(v, dtype) for k, v in value.items()}
    return value


def _cast_io(module: nn.Module, dtype: torch.dtype, outer: torch.dtype | None) -> None:
    """Compute ``module`` in ``dtype``: cast its floating-point inputs to it, and its
    floating-point outputs to ``outer`` (the enclosing policy's compute dtype)."""
    def pre(mod, args, kwargs):
        return _cast_tree(args, dtype), _cast_tree(kwargs, dtype)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    if outer is not None and outer != dtype:
        module.register_forward_hook(lambda mod, args, output: _cast_tree(output, outer))


def install_casts(model: nn.Module, overrides: dict[str, MixedPrecisionPolicy],
                  default: MixedPrecisionPolicy) -> None:
    """On each module a glob names (with a ``param_dtype``): its input/output casts."""
    for module_name, module in model.named_modules():
        policy = _own_policy(unwrapped_name(module_name), overrides)
        if policy is not None and policy.param_dtype is not None:
            parent = module_name.rpartition(".")[0] if "." in module_name else ""
            outer = policy_for(parent, overrides, default).param_dtype \
                if module_name else None
            if outer is None:  # the enclosing computation runs in the master dtype
                outer = next((p.dtype for p in module.parameters()
                              if p.is_floating_point()), None)
            _cast_io(module, policy.param_dtype, outer)
