"""Swapping a module's class in place, its state and parameters kept: the one helper for
data parallel (gathering properties for the parameters' names), expert parallelism (the
experts' and the router's forwards) and the Hugging Face experts' routed forward."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from torch import nn

_DERIVED: dict[tuple, type] = {}


def derived_class(cls: type[nn.Module], prefix: str, mixin: type | None = None,
                  attrs: Mapping[str, Any] | None = None, key: Hashable = ()) -> type:
    """``cls`` with ``mixin``'s methods first (when given) and ``attrs`` added, named
    ``prefix`` + its name. One class per ``(cls, prefix, mixin, key)`` (``key`` stands for
    ``attrs``, built anew by each caller), so modules of one class share one subclass and
    pickling by class stays possible."""
    k = (cls, prefix, mixin, key)
    if k not in _DERIVED:
        bases = (cls,) if mixin is None else (mixin, cls)
        _DERIVED[k] = type(f"{prefix}{cls.__name__}", bases, dict(attrs or {}))
    return _DERIVED[k]
