"""The package's errors: low, so every layer (mesh, corpus, models, parallel, plan,
bench, train) raises them without importing the layer that reads the config.

A :class:`ConfigError` is what the command lines report as one line naming the key
and the fix, without a traceback (``python -m simplefsdp.train`` exits 78 on one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


def require(ok: bool, key: str, value: object, rule: str) -> None:
    """Raise a ConfigError naming ``key`` unless ``ok``; ``rule`` says what is allowed."""
    if not ok:
        raise ConfigError(f"{key} = {value!r} is out of range: it must be {rule}")


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
    """Re-raise a ValueError from a shared check (``simplefsdp.mesh``) as a ConfigError,
    the error the command lines report without a traceback."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def choices(values) -> str:
    """``'a', 'b', 'c'``: allowed values for an error message."""
    return ", ".join(repr(v) for v in values)
