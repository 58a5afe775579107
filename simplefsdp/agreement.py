"""How ranks agree on a value, and which way is safe where.

Every rank must take the same decisions (bucketing plans, calibrated figures, the
checkpoint to resume from), or the collectives they issue stop matching and the job
hangs. There are two ways to agree here:

* **collectives** (:func:`agree_across_ranks`, :func:`broadcast_from_rank0`,
  :func:`gather_objects`): an all-reduce, a broadcast or an all-gather on a process
  group. For eager code only: building the backend, calibrating, the trainer's start-up
  checks and resume point. (The trainer's per-step stop/NaN flags, ``train/guard.py``,
  ride on one on-device all-reduce of their own, eager too.)
* **the rendezvous store** (:class:`StoreAgreement`): a TCP key-value exchange outside
  every process group.

The rule: **inside a compiler pass, only the store.** A gloo all-reduce issued from
inside the compiler (where our FX passes run) deadlocked about one run in four, one rank
stuck issuing it; the store never did. Whatever a pass needs from a collective is
therefore done before compiling (e.g. the nonce of :meth:`StoreAgreement.create`, the
calibration in ``compile_backend``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ._torch_compat import default_store, disable_current_modes

__all__ = ["StoreAgreement", "agree_across_ranks", "broadcast_from_rank0", "gather_objects",
           "group_device"]


def _resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def group_device(group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None) -> torch.device:
    """The device ``group``'s collectives take tensors on: ``device`` if given, the
    current CUDA device for NCCL, else the CPU."""
    if device is not None:
        return torch.device(device)
    backend = str(dist.get_backend(_resolve_group(group))).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------- eager: collectives


def agree_across_ranks(values: Sequence[float], group: dist.ProcessGroup | None = None,
                       op: str = "max") -> list[float]:
    """Make per-rank measurements identical on every rank (all-reduce MAX or MIN).

    MAX is the default: a step is as slow as its slowest rank. Collective when a process
    group is initialized (all ranks must pass lists of the same length, which is checked
    first); returns ``values`` unchanged otherwise. Eager code only (see module doc).
    """
    if op not in ("max", "min"):
        raise ValueError(f"op must be 'max' or 'min', not {op!r}")
    values = [float(v) for v in values]
    if not dist.is_available() or not dist.is_initialized():
        return values
    group = _resolve_group(group)
    if dist.get_world_size(group) == 1:
        return values
    with disable_current_modes():  # real tensors even when called under a fake mode
        dev = group_device(group)
        n = torch.tensor([len(values), -len(values)], dtype=torch.int64, device=dev)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        if int(n[0]) != -int(n[1]):
            raise ValueError(f"ranks disagree on the number of values ({len(values)} here, "
                             f"between {-int(n[1])} and {int(n[0])} across ranks)")
        if not values:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN
        dist.all_reduce(t, op=reduce_op, group=group)
        return t.cpu().tolist()


def broadcast_from_rank0(obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    """``obj`` as the group's first rank holds it (any picklable value), on every rank;
    ``obj`` itself without a process group. Collective; eager code only."""
    if not dist.is_available() or not dist.is_initialized():
        return obj
    group = _resolve_group(group)
    holder = [obj]
    with disable_current_modes():
        dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0), group=group)
    return holder[0]


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` (any picklable value), in rank order, on every rank;
    ``[obj]`` without a process group. Collective; eager code only."""
    if not dist.is_available() or not dist.is_initialized():
        return [obj]
    group = _resolve_group(group)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    with disable_current_modes():
        dist.all_gather_object(everyone, obj, group=group)
    return everyone


# ------------------------------------------------------- inside the compiler: the store


@dataclass
class StoreAgreement:
    """The MAX of per-rank numbers over ``ranks``, exchanged through the rendezvous store:
    safe inside a compiler pass (see module doc).

    ``ranks`` must be every rank that compiles the same graphs: agreeing only within the
    FSDP shard group would let HSDP replicas or TP peers choose different buckets.
    Floats travel as JSON, which round-trips them exactly, so every rank computes the
    same MAX. Every rank must call :meth:`max` the same number of times, in one order.
    """

    ranks: list[int]
    prefix: str
    rounds: int = 0

    @classmethod
    def create(cls, group: dist.ProcessGroup | None = None) -> StoreAgreement | None:
        """Collective (eager, e.g. when the backend is built): rank 0's nonce keeps two
        agreements from sharing keys. None without a process group."""
        if not dist.is_initialized():
            return None
        ranks = dist.get_process_group_ranks(group) if group is not None else \
            list(range(dist.get_world_size()))
        nonce = broadcast_from_rank0(uuid.uuid4().hex, group)
        return cls(ranks, f"simplefsdp/agreement/{nonce}")

    def max(self, values: list[float]) -> list[float]:
        """The element-wise MAX of ``values`` over ``ranks`` (lengths must match)."""
        store = default_store()
        round_key = f"{self.prefix}/{self.rounds}"
        self.rounds += 1
        store.set(f"{round_key}/{dist.get_rank()}", json.dumps(values))
        keys = [f"{round_key}/{r}" for r in self.ranks]
        store.wait(keys)  # the store's timeout: the process group's
        everyone = [json.loads(store.get(k)) for k in keys]
        if any(len(v) != len(values) for v in everyone):
            raise ValueError(f"ranks disagree on the number of values to agree on: "
                             f"{[len(v) for v in everyone]} for ranks {self.ranks}")
        return [max(column) for column in zip(*everyone, strict=True)]
