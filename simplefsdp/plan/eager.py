"""Eager memory: run one rank's eager step on fake tensors and follow every allocation.

Eager autograd keeps what each op saves for backward, frees other tensors when their
last Python reference dies, and (under checkpointing) recomputes in backward; none of
that is a graph a liveness pass could read. So the step itself runs, forward, the
trainer's loss and backward, on fake CPU tensors under the planner's fake process group
(nothing is computed), and a dispatch mode counts the bytes of every storage an op
returns until the last tensor on it is freed. Saved tensors are held through
``saved_tensors_hooks`` so their lifetime is autograd's, as on the GPU.

Model states are left out (counted by ``memory.states_bytes``): the parameter shards
exist before the step, and the gradient shards are recognised at its end.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from .._torch_compat import (
    TorchDispatchMode,
    around_sharding_propagation,
    storage_key,
    tree_flatten,
)
from ..compiler.collectives import CollectiveKind, collective_kind
from ..mesh import local_shard


@dataclass
class EagerMemory:
    """Bytes of one eager forward + loss + backward (model states left out)."""

    peak: int  # the largest live total during the step
    saved: int  # live at the end of forward + loss (what waits for backward)


class _Tracker(TorchDispatchMode):
    """Records (storage, +bytes) when an op returns a new storage and (storage, -bytes)
    when the last tensor object on it dies."""

    def __init__(self, existing: set[int], gather_groups: set[str]):
        super().__init__()
        self.existing = existing  # storages from before the step (parameter shards)
        self.gather_groups = gather_groups  # the data-parallel groups' names
        self.gathered: dict[int, int] = {}  # storage id -> bytes of a gathered parameter
        self.events: list[tuple[int, int]] = []  # (storage id, +-bytes)
        self.live: dict[int, list[int]] = {}  # storage address -> [id, tensors, bytes]
        self.next_id = 0
        self.paused = 0  # > 0 inside DTensor's sharding propagation (``_Paused``)

    def __enter__(self):
        super().__enter__()
        self.restore = around_sharding_propagation(_Paused(self))
        return self

    def __exit__(self, *exc):
        self.restore()
        return super().__exit__(*exc)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]  # the address may be reused by a later storage
            self.events.append((entry[0], -entry[2]))

    def storage_id(self, t: torch.Tensor) -> int | None:
        """The id of ``t``'s storage if it is tracked and alive."""
        entry = self.live.get(storage_key(t))
        return entry[0] if entry else None

    def watch(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage until ``t`` dies (a DTensor: its local shard's)."""
        local = _storage_tensor(t)
        key = storage_key(local)
        if key in self.existing or self.paused:
            return
        if key not in self.live:
            self.live[key] = [self.next_id, 0, local.untyped_storage().nbytes()]
            self.events.append((self.next_id, self.live[key][2]))
            self.next_id += 1
        self.live[key][1] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs))[0]):
            # DTensor's own dispatch runs the local ops (loss parallel's handlers: several
            # temporaries per op) with this mode still active: they are counted there
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        seen = set()
        name = str(func)
        gather = (collective_kind(name) == CollectiveKind.ALL_GATHER
                  and args[-1] in self.gather_groups) or (
            "wait_tensor" in name and self.storage_id(args[0]) in self.gathered)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                self.watch(t)
                if gather and self.storage_id(t) is not None:
                    self.gathered[self.storage_id(t)] = t.untyped_storage().nbytes()
        return out


class _Paused:
    """Pauses a tracker while DTensor's sharding propagation runs an op on fake tensors of
    the global shape to learn the output's (nothing is allocated on the GPU)."""

    def __init__(self, tracker: _Tracker):
        self.tracker = tracker

    def __enter__(self):
        self.tracker.paused += 1

    def __exit__(self, *exc):
        self.tracker.paused -= 1


def peak_of(events: list[tuple[int, int]], skip: set[int], upto: int | None = None
            ) -> tuple[int, int]:
    """(peak, live at ``upto``) of the event list, storages in ``skip`` left out."""
    live = peak = 0
    at = 0
    for i, (key, delta) in enumerate(events):
        if i == upto:
            at = live
        if key not in skip:
            live += delta
            peak = max(peak, live)
    return peak, (live if upto is None or upto >= len(events) else at)


def _storage_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's bytes: a DTensor's local shard (the mode sees ops
    on DTensors, e.g. the ``detach`` that stores a gradient, whose wrapper reports the
    storage of the whole logical tensor), else ``t``."""
    with torch.no_grad():
        return local_shard(t)


@functools.lru_cache(maxsize=256)
def eager_memory(key, exact_shards: bool = False) -> EagerMemory:
    """Run ``key``'s eager step (a ``trace.TraceKey`` with ``compile=False``) on fake
    tensors and return its activation peak and the bytes saved for backward.

    The peak is what the step needs on top of the model states, whose gradient part
    (``memory.states_bytes``) is counted whole. With ``exact_shards`` (``key`` is traced
    at the planned shard size) the gradients are followed as they appear in backward and
    the peak is the largest live total minus the whole gradient: eager autograd peaks
    early in backward, before most gradients exist (counting the gradient whole on top
    of the activations over-counts it). Otherwise they are left out, since their traced
    size is not the planned one (an upper bound)."""
    from .._torch_compat import FakeTensorMode
    from ..parallel.tensor import loss_context, token_loss_sum
    from .trace import (
        _job,
        build_model,
        data_parallel_groups,
        ensure_fake_world,
        key_mesh,
        stage_input,
    )

    ensure_fake_world()
    model, args, dtype = build_model(key)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        x = stage_input(key, args, dtype)
        params = list(model.parameters())
        existing = {storage_key(_storage_tensor(t))  # views of these are not new
                    for t in [*params, *model.buffers()]}
        mesh = key_mesh(key)
        tracker = _Tracker(existing, {mesh[d].get_group().group_name
                                      for d in ("dp_replicate", "dp_shard")}
                           | set(data_parallel_groups(mesh, key)))
        with tracker, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
                loss_context(_job(key).parallel.vocab_sharded_loss):
            out = model(x)
            if key.role == "first":  # the next stage's gradient arrives for the output
                loss, grad = out, torch.empty_like(out)
            else:
                # targets for the tokens this rank holds (a CP rank: its part of the sequence)
                loss, grad = token_loss_sum(out, torch.zeros(
                    out.shape[:2], dtype=torch.long)), None
            del out
            forward_end = len(tracker.events)
            loss.backward(grad)
            del loss, grad
        grads = {tracker.storage_id(_storage_tensor(p.grad)) for p in params if p.grad is not None}
    if not exact_shards:
        return EagerMemory(*peak_of(tracker.events, grads, forward_end))
    grad_bytes = sum(delta for id_, delta in tracker.events if id_ in grads)  # all live
    peak, saved = peak_of(tracker.events, set(), forward_end)
    return EagerMemory(peak - grad_bytes, saved)
