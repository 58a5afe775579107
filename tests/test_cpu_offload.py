"""CPU offload (``offload_policy=sf.CPUOffloadPolicy()``) on 2 real gloo ranks, with the
CPU standing in for the compute device (``offload.cpu_stands_in_for_device``: the same
code as on CUDA, every copy made and counted; a CPU mesh is otherwise refused).

The run with offload must match the run without it bitwise (losses, gradients and
parameters after 2 AdamW steps of 2 micro-steps, the first with gradient sync off, so
its unreduced gradient accumulates on the compute device): the copies move values,
they never change them.
Each step issues one host->device copy per all-gather (the shard, before it is
gathered: forward reads and backward's re-gathers) and one device->host copy per
reduce-scatter (the reduced gradient), with the bytes of the shards and gradients.
"""

from __future__ import annotations

import collections

import pytest
import torch
from rank_runner import run_ranks
from torch.distributed.tensor import DTensor
from toy import Toy, global_batch, loss_fn

import simplefsdp as sf
from simplefsdp import offload

WORLD, STEPS = 2, 2


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step_collectives(fn) -> collections.Counter:
    """(op, input bytes) of the all-gathers and reduce-scatters ``fn()`` issues."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        fn()
    counts = collections.Counter()
    for e in prof.events():
        op = e.name.rsplit("::", 1)[-1]
        if e.name.startswith("_c10d_functional::") and op in ("all_gather_into_tensor",
                                                              "reduce_scatter_tensor"):
            numel = 1
            for dim in e.input_shapes[0]:
                numel *= dim
            counts[op] += 1
            counts[op + " bytes"] += numel * 4  # float32 toy
    return counts


def _train(rank: int, offloaded: bool, compiled: bool):
    torch.manual_seed(0)
    policy = sf.CPUOffloadPolicy(pin_memory=True) if offloaded else None
    model = sf.data_parallel(Toy(n_layers=1), sf.make_mesh(dp_shard=WORLD),
                             offload_policy=policy)
    forward = model
    if compiled:
        torch._dynamo.reset()
        forward = torch.compile(model, fullgraph=True, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    (host,) = offload.offloads(model) if offloaded else (None,)
    steps = []
    for step in range(STEPS):
        if host is not None:
            host.reset_counts()
        tokens = global_batch(step, WORLD, per_rank=4)[4 * rank:4 * (rank + 1)]

        def fwd_bwd(tokens=tokens):  # 2 micro-steps, the first one's gradient unreduced
            losses = []
            for micro, sync in enumerate((False, True)):
                model.set_requires_gradient_sync(sync)
                loss = loss_fn(forward, tokens[2 * micro:2 * (micro + 1)])
                loss.backward()
                losses.append(loss.detach().clone())
            steps.append([torch.stack(losses)])
        if compiled and step == 0:  # traces and compiles: counted from the next step
            fwd_bwd()
            counts = collections.Counter()
        else:
            counts = _step_collectives(fwd_bwd)
        copies = None if host is None else (dict(host.copies), dict(host.bytes))
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        steps[-1] += [grads, counts, copies]
        opt.step()
        opt.zero_grad()
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    devices = {p.to_local().device.type for p in model.parameters()}
    return steps, params, devices


def _parity(rank: int, world: int, compiled: bool) -> list:
    ref_steps, ref_params, _ = _train(rank, False, compiled)
    with offload.cpu_stands_in_for_device():
        steps, params, devices = _train(rank, True, compiled)
    assert devices == {"cpu"}, devices  # the shards (and so AdamW's state) on the host
    for i, (ref, test) in enumerate(zip(ref_steps, steps, strict=True)):
        assert torch.equal(ref[0], test[0]), (i, ref[0], test[0])
        assert ref[1].keys() == test[1].keys()
        for name, grad in ref[1].items():
            assert torch.equal(grad, test[1][name]), (i, name)
        assert test[2] == ref[2]  # offload adds or changes no collective
        if not compiled:  # a traced graph counts no copies (offload.HostOffload._copy)
            counts, copies = test[2], test[3]
            assert copies[0] == {"to_device": counts["all_gather_into_tensor"],
                                 "to_host": counts["reduce_scatter_tensor"]}, (copies, counts)
            # a shard copied in per gather (its bytes: the gather's input, padded to the
            # first rank's rows, which rank 0 holds exactly); a gradient shard back per
            # reduce-scatter (1/world of the scattered input, padded alike)
            exact = (lambda a, b: a == b) if rank == 0 else (lambda a, b: 0 < a <= b)
            assert exact(copies[1]["to_device"], counts["all_gather_into_tensor bytes"])
            assert exact(copies[1]["to_host"] * WORLD, counts["reduce_scatter_tensor bytes"])
    for name, value in ref_params.items():
        assert torch.equal(value, params[name]), name
    return [s[3] for s in steps]


@pytest.mark.parametrize("compiled", [
    pytest.param(False, id="eager", marks=pytest.mark.quick),
    pytest.param(True, id="compiled"),
])
def test_offload_matches_no_offload_and_copies_each_shard(compiled):
    copies = run_ranks(_parity, WORLD, compiled)[0]
    print(f"{'compiled' if compiled else 'eager'} offload copies per step: {copies}")


def _refused(rank: int, world: int) -> None:
    mesh = sf.make_mesh(dp_shard=world)
    with pytest.raises(ValueError, match=r"offload_policy: the mesh runs on the CPU"):
        sf.data_parallel(Toy(), mesh, offload_policy=sf.CPUOffloadPolicy())
    with pytest.raises(TypeError, match=r"offload_policy must be a simplefsdp.CPUOffloadPolicy"):
        with offload.cpu_stands_in_for_device():
            sf.data_parallel(Toy(), mesh, offload_policy=True)


def test_offload_on_a_cpu_mesh_refused():
    run_ranks(_refused, WORLD)


def test_trainer_cpu_offload_on_cpu_refused():
    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"training\.cpu_offload = true .* job\.device = 'cpu'"):
        load_config(None, ["--training.cpu_offload", "true"], world_size=WORLD)
    assert load_config(None, ["--training.cpu_offload", "true", "--job.device", "cuda"],
                       world_size=WORLD).training.cpu_offload
