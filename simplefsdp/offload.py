"""CPU offload for ``data_parallel`` (FSDP2's ``CPUOffloadPolicy``): parameter shards,
their gradients and so the optimizer's state live in host memory; the compute device
holds only what a step gathers.

* Each read copies the host shard to the compute device (``to_device``) before the
  all-gather (non-blocking from pinned memory: it is ordered on the device's stream).
* The gradient's reduction (reduce-scatter / all-reduce) runs on the device; its result
  is copied back to the host shard's gradient (``to_host``, a blocking copy: the
  optimizer reads it on the host right after backward).
* The optimizer, built on ``model.parameters()`` (host DTensors), steps on the host.

Copies go "host <-> compute device" through one :class:`HostOffload` per
``data_parallel`` call, which counts them (copies and bytes each way): the numbers the
tests check and the trainer can log. On a mesh whose device is the CPU there is nothing
to offload to and ``data_parallel`` refuses; tests run the same code with the CPU
standing in for the device (:func:`cpu_stands_in_for_device`): the same copies (forced,
``copy=True``), the same counts, only the device differs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

HOST = torch.device("cpu")
_cpu_stands_in = False  # test hook, see cpu_stands_in_for_device


@dataclass(frozen=True)
class CPUOffloadPolicy:
    """Offload parameter shards, gradients and optimizer state to the host (FSDP2's
    name). ``pin_memory``: keep the shards in pinned host memory, so the copies to the
    device are asynchronous (costs page-locked host memory)."""

    pin_memory: bool = True


@contextmanager
def cpu_stands_in_for_device() -> Iterator[None]:
    """Tests only: let a CPU mesh use offload, the CPU playing the compute device. Every
    copy is still made (``copy=True``) and counted; pinning is skipped (it needs CUDA)."""
    global _cpu_stands_in
    previous, _cpu_stands_in = _cpu_stands_in, True
    try:
        yield
    finally:
        _cpu_stands_in = previous


def compute_device(mesh: DeviceMesh, key: str = "offload_policy") -> torch.device:
    """The device the gathered parameters compute on (the mesh's), or a ValueError
    naming ``key`` when it is the CPU (nothing to offload to)."""
    device_type = mesh.device_type
    if device_type == "cpu":
        if _cpu_stands_in:
            return HOST
        raise ValueError(f"{key}: the mesh runs on the CPU, so there is no device memory to "
                         f"offload to; drop it (or run on CUDA)")
    module = getattr(torch, device_type)
    return torch.device(device_type, module.current_device())


@dataclass
class HostOffload:
    """The copies of one ``data_parallel`` call's offloaded parameters."""

    device: torch.device
    pin_memory: bool
    # ("to_device" | "to_host") -> copies / bytes since the last reset_counts()
    copies: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    @classmethod
    def build(cls, policy: CPUOffloadPolicy, mesh: DeviceMesh) -> HostOffload:
        if not isinstance(policy, CPUOffloadPolicy):
            raise TypeError(f"offload_policy must be a simplefsdp.CPUOffloadPolicy, got "
                            f"{type(policy).__name__}")
        device = compute_device(mesh)
        return cls(device, policy.pin_memory and device.type != "cpu")

    def _copy(self, local: torch.Tensor, device: torch.device, direction: str) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # a traced graph counts nothing
            self.copies[direction] += 1
            self.bytes[direction] += local.numel() * local.element_size()
        non_blocking = direction == "to_device" and self.pin_memory
        return local.to(device, non_blocking=non_blocking, copy=True)

    def to_device(self, sharded: DTensor) -> DTensor:
        """``sharded`` (host) as a DTensor on the compute device; its gradient comes back
        to the host (:class:`_ToDevice`). Without autograd: a plain copy."""
        return _ToDevice.apply(sharded, self)

    def place_on_host(self, param: nn.Parameter) -> nn.Parameter:
        """A sharded parameter with its local shard moved to (pinned) host memory."""
        local = param.to_local().detach()
        if local.device.type == "meta":  # materialized later: see data_parallel's note
            return param
        host = local.to(HOST, copy=True)
        if self.pin_memory:
            host = host.pin_memory()
        moved = DTensor.from_local(host, param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
        return nn.Parameter(moved, requires_grad=param.requires_grad)

    def reset_counts(self) -> None:
        self.copies.clear()
        self.bytes.clear()


class _ToDevice(torch.autograd.Function):
    """Host DTensor -> the same DTensor on the compute device; the gradient (the
    reduction's result, on the device) goes back to the host."""

    @staticmethod
    def forward(ctx, sharded: DTensor, offload: HostOffload) -> DTensor:
        ctx.offload = offload
        local = offload._copy(sharded.to_local(), offload.device, "to_device")
        return DTensor.from_local(local, sharded.device_mesh, sharded.placements,
                                  run_check=False, shape=sharded.shape,
                                  stride=sharded.stride())

    @staticmethod
    def backward(ctx, grad: DTensor):
        local = ctx.offload._copy(grad.to_local(), HOST, "to_host")
        return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False,
                                  shape=grad.shape, stride=grad.stride()), None


def on_device(offload: HostOffload | None, param: DTensor) -> DTensor:
    """``param`` on the compute device: itself without offload, else its host shard
    copied in (differentiable: the gradient goes back to the host)."""
    return param if offload is None else offload.to_device(param)


def offloads(model: nn.Module) -> list[HostOffload]:
    """The offloads of ``model``'s ``data_parallel`` calls (one each), for counting."""
    seen: dict[int, HostOffload] = {}
    for module in model.modules():
        for gather in getattr(module, "_sf_compute", {}).values():
            offload = getattr(gather, "offload", None)
            if offload is not None:
                seen.setdefault(id(offload), offload)
    return list(seen.values())


def place_shards_on_host(model: nn.Module) -> None:
    """Move the shards of ``model``'s offloaded parameters to (pinned) host memory, in
    place: for a model built on ``meta``, after ``to_empty`` and initialization and
    before the optimizer is built (it must hold the host parameters). Tied parameters
    stay tied; parameters already on the host are left as they are."""
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, gather in getattr(module, "_sf_compute", {}).items():
            offload, param = getattr(gather, "offload", None), module._parameters[name]
            if offload is None or param.to_local().device == HOST:
                continue
            if id(param) not in moved:
                moved[id(param)] = offload.place_on_host(param)
            module._parameters[name] = moved[id(param)]
