"""The CPU/gloo kernel for ``_c10d_functional.all_gather_into_tensor``.

Several functional all-gathers are started before the first ``wait_tensor`` (what our
prefetching passes produce). With the kernel installed they must take gloo's plain
``_allgather_base`` path instead of the coalesced one, and give exactly the values of
the concatenation (an all-gather only copies bytes, so every comparison is bitwise),
for uneven/empty/bf16/complex inputs, through DTensor's redistribute forward and
backward, through ``data_parallel``'s recomputed gathers, and under ``torch.compile``
(aot_eager and inductor).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rank_runner import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.profiler import profile

import simplefsdp as sf
from simplefsdp.gloo_kernel import (
    install_gloo_collectives,
    installed,
    uninstall_gloo_collectives,
    uses_gloo,
)

OP = "_c10d_functional::all_gather_into_tensor"
PLAIN = "c10d::_allgather_base_"  # what the kernel issues
COALESCED = "c10d::allgather_into_tensor_coalesced_"  # what torch's own kernel issues

# (shape, dtype) of each all-gather started before any wait. Dim 0 of (5, 3) / (1, 4)
# is what DTensor gathers for uneven shards after padding; (0, 5) is an empty shard.
CASES = [((4, 3), torch.float32), ((5,), torch.float32), ((0, 5), torch.float32),
         ((1, 7), torch.bfloat16), ((3, 2, 2), torch.bfloat16), ((2, 3), torch.complex64),
         ((64, 33), torch.float32), ((17,), torch.bfloat16)]
REPEATS = 3


def _shard(rank: int, i: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    values = (torch.arange(numel, dtype=torch.float32) % 97 + 1000 * rank + 10 * i)
    if dtype.is_complex:
        return torch.complex(values, -values).reshape(shape).to(dtype)
    return values.reshape(shape).to(dtype)


def _c10d_ops(prof) -> set[str]:
    return {e.name for e in prof.events() if e.name.startswith("c10d::")}


def _gather_in_flight(rank: int, world: int, install: bool) -> dict:
    """All CASES in flight at once, REPEATS times; returns what ran and what differed."""
    if install:
        install_gloo_collectives()
        install_gloo_collectives()  # idempotent
    cases = CASES + ([((), torch.float32)] if install else [])  # torch's kernel rejects 0-dim
    name = dist.group.WORLD.group_name
    wrong = []
    with profile() as prof:
        for rep in range(REPEATS):
            outs = [torch.ops._c10d_functional.all_gather_into_tensor(
                _shard(rank, i, shape, dtype), world, name)
                for i, (shape, dtype) in enumerate(cases)]
            for i, ((shape, dtype), out) in enumerate(zip(cases, outs, strict=True)):
                out = torch.ops._c10d_functional.wait_tensor(out)
                parts = [_shard(r, i, shape, dtype).reshape(-1, *shape[1:]) for r in range(world)]
                expected = torch.cat(parts)
                if not (torch.equal(out, expected) and out.dtype == dtype
                        and out.is_contiguous()):
                    wrong.append((rep, shape, dtype, tuple(out.shape)))
    pending = torch._C._distributed_c10d._get_work_registry_size()
    return {"ops": _c10d_ops(prof), "wrong": wrong, "installed": installed(),
            "uses_gloo": uses_gloo(), "pending": pending}


def test_in_flight_all_gathers_use_plain_gloo_path_and_are_exact():
    results = run_ranks(_gather_in_flight, 2, True)
    for result in results:
        assert result["wrong"] == []
        assert result["installed"] and result["uses_gloo"]
        assert PLAIN in result["ops"] and COALESCED not in result["ops"]
        assert result["pending"] == 0  # every Work was registered and waited


def test_without_kernel_torch_takes_the_coalesced_path():
    """What the kernel replaces: torch's own kernel issues gloo's coalesced all-gather.

    (The reported abort with several of these in flight did not reproduce on this
    machine, so this test pins the dispatch rather than a crash; see the module doc of
    simplefsdp/gloo_kernel.py.)"""
    results = run_ranks(_gather_in_flight, 2, False)
    for result in results:
        assert result["wrong"] == []
        assert not result["installed"]
        assert COALESCED in result["ops"] and PLAIN not in result["ops"]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)  # 5 rows over 2 ranks: uneven shards (3, 2)
        self.b = nn.Linear(5, 3)
        self.c = nn.Linear(3, 1)  # bias of 1 element: rank 1 holds an empty shard

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _data_parallel_grads(rank: int, world: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = sf.data_parallel(_Net(), sf.make_mesh(dp_shard=world), mode="fully_shard")
    x = torch.randn(8, 6)[rank::world]
    model(x).square().sum().backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def _dtensor_and_compile(rank: int, world: int) -> dict:
    report = {}
    # data_parallel (SAC recomputes the gathers in backward): same grads bit for bit.
    before = _data_parallel_grads(rank, world)
    install_gloo_collectives()
    with profile() as prof:
        after = _data_parallel_grads(rank, world)
    report["data_parallel_equal"] = all(torch.equal(a, b) for a, b in zip(before, after,
                                                                           strict=True))
    report["data_parallel_ops"] = _c10d_ops(prof)

    # DTensor redistribute forward + backward, every gather in flight before first use.
    mesh = init_device_mesh("cpu", (world,))
    report["uses_gloo_mesh"] = uses_gloo(mesh)
    shapes = [(5, 3), (1, 4), (8,), (6, 2)]
    fulls = [torch.arange(float(torch.Size(s).numel())).reshape(s) + 1 for s in shapes]
    params = [nn.Parameter(distribute_tensor(f, mesh, [Shard(0)])) for f in fulls]
    dtypes = [None, None, torch.bfloat16, None]  # a bf16 gather, as mixed precision does
    weights = [torch.full(s, 0.5 * (i + 1)) for i, s in enumerate(shapes)]
    with profile() as prof:
        gathered = [p.redistribute(mesh, [Replicate()], forward_dtype=dt)
                    .to_local(grad_placements=[Partial()]) for p, dt in zip(params, dtypes,
                                                                             strict=True)]
        loss = sum((g.float() * w * (rank + 1)).sum() for g, w in zip(gathered, weights,
                                                                       strict=True))
        loss.backward()
    report["dtensor_forward"] = all(
        torch.equal(g, f.to(dt or f.dtype)) for g, f, dt in zip(gathered, fulls, dtypes,
                                                                 strict=True))
    # d loss / d full = (rank + 1) * w on each rank; Partial sums that over the ranks.
    scale = sum(r + 1 for r in range(world))
    report["dtensor_backward"] = all(
        torch.equal(p.grad.full_tensor(), (w * scale).to(p.dtype))
        for p, w in zip(params, weights, strict=True))
    report["dtensor_ops"] = _c10d_ops(prof)

    # torch.compile: compiled graphs call the same op.
    name = dist.group.WORLD.group_name

    def fn(xs):
        outs = [torch.ops._c10d_functional.all_gather_into_tensor(x * 2, world, name)
                for x in xs]
        outs = [torch.ops._c10d_functional.wait_tensor(o) for o in outs]
        return [o + 1 for o in outs]

    xs = [_shard(rank, i, shape, dtype) for i, (shape, dtype) in enumerate(CASES)
          if not dtype.is_complex]  # inductor does not take complex inputs
    expected = fn(xs)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        with profile() as prof:
            got = compiled(xs)
        report[f"compile_{backend}"] = all(torch.equal(g, e) for g, e in zip(got, expected,
                                                                             strict=True))
        report[f"compile_{backend}_ops"] = _c10d_ops(prof)
    return report


def test_dtensor_data_parallel_and_compile_with_kernel():
    for report in run_ranks(_dtensor_and_compile, 2):
        assert report["uses_gloo_mesh"]
        assert report["data_parallel_equal"]
        assert report["dtensor_forward"] and report["dtensor_backward"]
        assert report["compile_aot_eager"] and report["compile_inductor"]
        for key in ("data_parallel_ops", "dtensor_ops", "compile_aot_eager_ops",
                    "compile_inductor_ops"):
            assert PLAIN in report[key] and COALESCED not in report[key], key


def test_install_touches_only_the_cpu_kernel():
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    was_installed = installed()
    uninstall_gloo_collectives()
    try:
        assert not has(OP, "CPU")  # torch registers only a composite kernel
        install_gloo_collectives()
        install_gloo_collectives()
        assert installed() and has(OP, "CPU")
        assert not has(OP, "CUDA") and has(OP, "CompositeExplicitAutograd")
        uninstall_gloo_collectives()
        assert not installed() and not has(OP, "CPU")
    finally:
        if was_installed:
            install_gloo_collectives()


def test_other_cpu_backends_keep_torch_kernel():
    """A non-gloo group (torch's in-process fake backend) takes the original kernel."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    install_gloo_collectives()
    try:
        assert not uses_gloo()
        with profile() as prof:
            out = torch.ops._c10d_functional.all_gather_into_tensor(
                torch.ones(3, 2), 2, dist.group.WORLD.group_name)
            out = torch.ops._c10d_functional.wait_tensor(out)
        assert out.shape == (6, 2)
        assert PLAIN not in _c10d_ops(prof)
    finally:
        uninstall_gloo_collectives()
        dist.destroy_process_group()
