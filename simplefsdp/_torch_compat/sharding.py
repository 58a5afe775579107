"""DTensor's sharding propagation: the eager memory tracker (``plan/eager.py``) pauses
while it runs an op on fake tensors of the global shape (nothing is allocated there)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable


def around_sharding_propagation(ctx) -> Callable[[], None]:
    """Enter ``ctx`` (a reusable context manager) around each run DTensor's sharding
    propagation makes of an op on fake global-shape tensors: torch wraps that run in
    ``ShardingPropagator._fake_mode_lock`` (a no-op context by default; checked on
    2.13), replaced here; returns the undo.

    Version fallback: 2.11 has no ``_fake_mode_lock``; its fake run is the whole of
    ``ShardingPropagator._propagate_tensor_meta_non_cached`` (checked: 2.11), wrapped
    instead. Without either, a warning and a no-op undo. Under the planner's fake step
    that run uses the step's own fake mode, so a tracker left running would count its
    global-shape temporaries (loss parallel's ``log_softmax`` on every vocabulary
    column) as this rank's memory."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    saved = ShardingPropagator.__dict__.get("_fake_mode_lock")
    if saved is None:
        return _around_tensor_meta_propagation(ShardingPropagator, ctx)

    class Around:
        def __enter__(self):
            ctx.__enter__()
            return saved.__enter__()

        def __exit__(self, *exc):  # in the reverse order of entering
            try:
                return saved.__exit__(*exc)
            finally:
                ctx.__exit__(*exc)

    ShardingPropagator._fake_mode_lock = Around()
    return lambda: setattr(ShardingPropagator, "_fake_mode_lock", saved)


def _around_tensor_meta_propagation(propagator: type, ctx) -> Callable[[], None]:
    """:func:`around_sharding_propagation` where torch has no ``_fake_mode_lock``."""
    saved = propagator.__dict__.get("_propagate_tensor_meta_non_cached")
    if saved is None:
        warnings.warn("no ShardingPropagator._fake_mode_lock in this torch: eager memory "
                      "predictions also count DTensor's fake global-shape runs", stacklevel=3)
        return lambda: None

    @functools.wraps(saved)
    def around(self, *args, **kwargs):
        with ctx:
            return saved(self, *args, **kwargs)

    propagator._propagate_tensor_meta_non_cached = around
    return lambda: setattr(propagator, "_propagate_tensor_meta_non_cached", saved)
