"""Frozen (``requires_grad=False``) and ignored (``ignored_params``) parameters on real gloo
process groups, eager and compiled, with the collectives of each step counted.

Frozen parameters (the toy's first block, as a LoRA base would be, and the final norm's
bias) are sharded and gathered for compute but must get no gradient and no reduction,
and must not change. Trainable parameters are compared with a single-process model
trained on the whole batch (tolerance 1e-6, as in test_data_parallel.py: each rank's
half of the batch is summed in a collective, rounding differently from one matmul).

Ignored parameters stay plain tensors: never gathered, never reduced; each rank's
gradient is its own, bitwise the gradient a plain model gets from that rank's half of the
batch (the other parameters gather to the same values, so the arithmetic is the same).
"""

from __future__ import annotations

import pytest
import torch
from rank_runner import run_ranks
from test_gradient_sync import count_collectives
from torch.distributed.tensor import DTensor
from toy import Toy, global_batch, loss_fn

import simplefsdp as sf

STEPS = 3
ATOL = 1e-6  # see the module docstring
MESHES = {"fully_shard": dict(dp_shard=2), "replicate": dict(dp_replicate=2, dp_shard=1)}
REDUCTION = {"fully_shard": "reduce_scatter_tensor", "replicate": "all_reduce"}


def _toy() -> Toy:
    torch.manual_seed(0)
    model = Toy(n_layers=2)
    model.layers[0].requires_grad_(False)  # a frozen block, as a LoRA base
    return model


def _reads(model: torch.nn.Module, keep) -> int:
    """Parameter reads per forward that ``keep(param)`` selects: each module's use of
    each of its parameters (the tied embedding/output weight is read twice)."""
    return sum(1 for m in model.modules() for p in m._parameters.values()
               if p is not None and keep(p))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _frozen_case(rank: int, world: int, mode: str, compiled: bool) -> list[dict]:
    ref = _toy()
    model = sf.data_parallel(_toy(), sf.make_mesh(**MESHES[mode]), mode=mode)
    frozen = {n: _full(p).clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable_reads = _reads(model, lambda p: p.requires_grad)
    assert 0 < trainable_reads < _reads(model, lambda p: True)
    if compiled:
        torch._dynamo.reset()
    forward = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    counts = []
    for step in range(STEPS):
        tokens = global_batch(step, world)
        count = count_collectives(
            lambda tokens=tokens: loss_fn(forward, tokens[2 * rank:2 * (rank + 1)]).backward())
        loss_fn(ref, tokens).backward()
        if not compiled or step > 0:  # the first compiled step also counts traced ops
            assert count[REDUCTION[mode]] == trainable_reads, (mode, count, trainable_reads)
            assert sum(count.values()) - count[REDUCTION[mode]] == count.get(
                "all_gather_into_tensor", 0)  # no other reduction
            counts.append(dict(count))
        for name, p in model.named_parameters():
            assert (p.grad is None) == (not p.requires_grad), name
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if name in frozen:
            assert torch.equal(_full(p.detach()), frozen[name]), name
        else:
            diff = (_full(p.detach()) - q.detach()).abs().max().item()
            assert diff <= ATOL, (name, diff)
    return counts


def _frozen_both_modes(rank: int, world: int, compiled: bool) -> dict[str, list[dict]]:
    return {mode: _frozen_case(rank, world, mode, compiled) for mode in MESHES}


@pytest.mark.quick
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_frozen_params_gathered_never_reduced(compiled):
    for mode, counts in run_ranks(_frozen_both_modes, 2, compiled)[0].items():
        print(f"{mode} {'compiled' if compiled else 'eager'}: collectives per step {counts}")


def _ignored_case(rank: int, world: int, compiled: bool) -> dict:
    torch.manual_seed(0)
    model = Toy(n_layers=1)
    plain = Toy(n_layers=1)
    plain.load_state_dict(model.state_dict())
    ignored = {model.layers[0].up.weight, model.norm.weight}
    sf.data_parallel(model, sf.make_mesh(dp_shard=world), ignored_params=ignored)
    for p in ignored:
        assert type(p) is torch.nn.Parameter and not isinstance(p.data, DTensor)
    sharded_reads = _reads(model, lambda p: id(p) not in {id(q) for q in ignored})
    trainable = _reads(model, lambda p: p.requires_grad and id(p) not in {id(q) for q in ignored})
    if compiled:
        torch._dynamo.reset()
    forward = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
    local = global_batch(0, world)[2 * rank:2 * (rank + 1)]
    for _attempt in range(2):  # compiled: the second call runs the graph (no tracing)
        model.zero_grad()
        count = count_collectives(lambda: loss_fn(forward, local).backward())
    assert count["reduce_scatter_tensor"] == trainable, (count, trainable)
    assert sharded_reads <= count["all_gather_into_tensor"] <= 2 * sharded_reads, count
    loss_fn(plain, local).backward()  # this rank's own gradient of the ignored ones
    assert torch.equal(model.layers[0].up.weight.grad, plain.layers[0].up.weight.grad)
    assert torch.equal(model.norm.weight.grad, plain.norm.weight.grad)
    return dict(count)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ignored_params_left_alone(compiled):
    counts = run_ranks(_ignored_case, 2, compiled)[0]
    print(f"ignored, {'compiled' if compiled else 'eager'}: collectives of one step {counts}")


def _bad_ignored(rank: int, world: int) -> None:
    mesh = sf.make_mesh(dp_shard=world)
    with pytest.raises(ValueError, match="not parameters of this model"):
        sf.data_parallel(Toy(), mesh, ignored_params={torch.nn.Parameter(torch.ones(3))})
    with pytest.raises(TypeError, match="ignored_params must be a set"):
        sf.data_parallel(Toy(), mesh, ignored_params=[Toy().norm.weight])
    with pytest.raises(ValueError, match=r"reshard_after_forward=2: the group size"):
        sf.data_parallel(Toy(), mesh, reshard_after_forward=2)
    model = sf.data_parallel(Toy(), mesh)
    with pytest.raises(TypeError, match="set_requires_gradient_sync takes a bool, got 0"):
        model.set_requires_gradient_sync(0)
    with pytest.raises(TypeError, match="set_requires_all_reduce takes a bool, got None"):
        model.set_requires_all_reduce(None)


def test_bad_ignored_params_reshard_and_sync_flags_refused():
    run_ranks(_bad_ignored, 2)
