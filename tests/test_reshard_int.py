"""``reshard_after_forward=<int>`` on 4 real gloo ranks, eager and compiled (aot_eager):
resharding to groups of 2 after forward.

Each case trains the toy for 2 AdamW steps twice from one seed: with
``reshard_after_forward=True`` (the reference) and ``=2``. Losses, gradients and
parameters must be bitwise equal: every gather copies the same values (only which
ranks they come from changes) and the gradient is reduce-scattered over the same 4
ranks in one collective with the same padding, so the arithmetic is identical.

The collectives of each forward and each backward are read from the profiler with their
group size and input size:
* eager: forward gathers on all 4 ranks as the reference does; backward gathers the same
  parameters on groups of 2, each rank sending its kept piece (2 shards' worth);
* compiled (our backend, aot_eager, manual bucketing with reordering): forward gathers
  in two steps on groups of 2 (the outer group's shards, then the inner group's pieces);
  backward recomputes only the inner step, from the pieces. Collectives are compared as
  counts and total sizes per group size, so buckets (one per block and group: the
  passes never merge groups) compare like single collectives.
Reduce-scatters are unchanged: on 4 ranks.
"""

from __future__ import annotations

import collections

import pytest
import torch
from rank_runner import run_ranks
from torch.distributed.tensor import DTensor
from toy import Toy, global_batch, loss_fn

import simplefsdp as sf

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

WORLD, GROUP, STEPS = 4, 2, 2
GATHER, SCATTER = "_c10d_functional::all_gather_into_tensor", \
    "_c10d_functional::reduce_scatter_tensor"


def _collectives(fn) -> tuple[object, collections.Counter]:
    """``fn()``'s result and its collectives as a Counter of (op, group size, input numel)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        result = fn()
    counts = collections.Counter()
    for e in prof.events():
        if e.name in (GATHER, SCATTER):
            size_arg = 1 if e.name == GATHER else 2  # (input, [op,] group_size, group_name)
            numel = 1
            for dim in e.input_shapes[0]:
                numel *= dim
            counts[e.name.rsplit("::", 1)[1], int(e.concrete_inputs[size_arg]), numel] += 1
    return result, counts


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(rank: int, reshard, compiled: bool):
    torch.manual_seed(0)
    model = sf.data_parallel(Toy(n_layers=1), sf.make_mesh(dp_shard=WORLD),
                             reshard_after_forward=reshard)
    forward = model
    if compiled:  # our backend: each block's collectives bucketed, prefetched, per group
        torch._dynamo.reset()
        forward = torch.compile(model, fullgraph=True, backend=sf.compile_backend(
            backend="aot_eager", bucketing="manual", reordering=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    steps = []
    for step in range(STEPS):
        tokens = global_batch(step, WORLD)[2 * rank:2 * (rank + 1)]
        if compiled and step == 0:  # traces and compiles: its counts are not compared
            loss, fwd = loss_fn(forward, tokens), collections.Counter()
            _, bwd = loss.backward(), collections.Counter()
        else:
            loss, fwd = _collectives(lambda tokens=tokens: loss_fn(forward, tokens))
            _, bwd = _collectives(loss.backward)
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        steps.append((loss.detach().clone(), grads, fwd, bwd))
        opt.step()
        opt.zero_grad()
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return steps, params


def _totals(counts: collections.Counter) -> dict[tuple[str, int], tuple[int, int]]:
    """{(op, group size): (collectives, total input numel)}: comparable whether or not
    the compiler merged a block's collectives into buckets (it never merges groups)."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    for (kind, group, numel), n in counts.items():
        count, total = out.get((kind, group), (0, 0))
        out[kind, group] = (count + n, total + n * numel)
    return out


def _check_counts(ref_step, step, compiled: bool) -> None:
    _, _, ref_fwd, ref_bwd = ref_step
    ref_fwd, ref_bwd = _totals(ref_fwd), _totals(ref_bwd)
    fwd, bwd = _totals(step[2]), _totals(step[3])
    gather, scatter = "all_gather_into_tensor", "reduce_scatter_tensor"
    # the gradients: unchanged, on all 4 ranks
    assert bwd[scatter, WORLD] == ref_bwd[scatter, WORLD]
    # backward: as many gathers, on groups of 2 only, each sending its kept piece (2
    # shards' worth)
    count, numel = ref_bwd[gather, WORLD]
    assert {k for k in bwd if k[0] == gather} == {(gather, GROUP)}, bwd
    assert bwd[gather, GROUP] == (count, GROUP * numel), (bwd, ref_bwd)
    count, numel = ref_fwd[gather, WORLD]
    if compiled:  # two steps on groups of 2: the shards (outer), then the pieces (inner)
        assert set(fwd) == {(gather, GROUP)}, fwd
        assert fwd[gather, GROUP] == (2 * count, numel + GROUP * numel), (fwd, ref_fwd)
    else:  # eager: forward is the reference's, on all 4 ranks
        assert fwd == ref_fwd, (fwd, ref_fwd)


def _parity(rank: int, world: int, compiled: bool) -> dict:
    ref_steps, ref_params = _train(rank, True, compiled)
    steps, params = _train(rank, GROUP, compiled)
    for i, (ref_step, step) in enumerate(zip(ref_steps, steps, strict=True)):
        assert torch.equal(ref_step[0], step[0]), (i, ref_step[0], step[0])
        assert ref_step[1].keys() == step[1].keys()
        for name, grad in ref_step[1].items():
            assert torch.equal(grad, step[1][name]), (i, name)
        if i > 0 or not compiled:  # compiled: the first step traces, unprofiled
            _check_counts(ref_step, step, compiled)
    for name, value in ref_params.items():
        assert torch.equal(value, params[name]), name
    return {"reference": dict(ref_steps[-1][3]), "reshard to 2": dict(steps[-1][3]),
            "forward": dict(steps[-1][2])}


@pytest.mark.parametrize("compiled", [
    pytest.param(False, id="eager", marks=pytest.mark.quick),
    pytest.param(True, id="compiled"),
])
def test_reshard_to_group_of_two_matches_full_reshard(compiled):
    report = run_ranks(_parity, WORLD, compiled)[0]
    print(f"{'compiled' if compiled else 'eager'} collectives (op, group, numel): {report}")


def _refused(rank: int, world: int) -> None:
    mesh = sf.make_mesh(dp_shard=world)
    with pytest.raises(ValueError, match=r"reshard_after_forward=3: .* one of \[2\]"):
        sf.data_parallel(Toy(), mesh, reshard_after_forward=3)
    with pytest.raises(ValueError, match=r"reshard_after_forward=4: .* one of \[2\]"):
        sf.data_parallel(Toy(), mesh, reshard_after_forward=4)
    with pytest.raises(ValueError, match=r"reshard_after_forward=2: .* 'fully_shard' only"):
        sf.data_parallel(Toy(), sf.make_mesh(dp_replicate=2, dp_shard=2),
                         mode="hybrid_shard", reshard_after_forward=2)
    with pytest.raises(ValueError, match=r"reshard_after_forward='2': pass true, false or"):
        sf.data_parallel(Toy(), mesh, reshard_after_forward="2")


def test_bad_reshard_ints_refused():
    run_ranks(_refused, WORLD)


@pytest.mark.parametrize("flags, message", [
    (["--parallel.reshard_after_forward", "3"],
     r"parallel\.reshard_after_forward=3: the group size must divide the 4 .* one of \[2\]"),
    (["--parallel.reshard_after_forward", "2", "--parallel.dp_mode", "replicate",
      "--parallel.dp_replicate", "4", "--parallel.dp_shard", "1"],
     r"parallel\.reshard_after_forward=2: .* 'fully_shard' only, not 'replicate'"),
    (["--parallel.reshard_after_forward", "2", "--parallel.tp", "2"],
     r"parallel\.reshard_after_forward = 2 \(reshard to a group\) is not built with "
     r"parallel\.tp = 2"),
])
def test_bad_reshard_config_refused(flags, message):
    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, flags, world_size=WORLD)
