"""data_parallel on real gloo process groups: parity, edge cases, bad input.

Tolerances. Against the single-process reference the sharded run computes each rank's
gradient on its half of the batch and sums the halves in a collective, so float32
rounding differs from one big matmul: we allow 1e-6 absolute on the parameters
(measured: ~3e-8 after 5 AdamW steps) and 1e-6 *relative* on the losses: the toy's
losses are 6-9, where a float32 ulp is ~5e-7, and the global loss is a mean of the
ranks' means, rounded differently from one mean (measured: up to 2.4e-7 relative,
1.4e-6 absolute, on this CPU). Against FSDP2 at world size 2 (untied weights) the math
is the same operation for operation (two-term sums commute exactly, averaging by 2 is
exact), so we ask for bitwise equality.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from rank_runner import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from toy import Toy, global_batch, loss_fn, train

import simplefsdp as sf

STEPS = 5
REFERENCE_ATOL = 1e-6  # parameters
REFERENCE_LOSS_RTOL = 1e-6


def _reference(seed: int = 0, tie: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    return Toy(tie=tie)


def _max_param_diff(model: nn.Module, ref: nn.Module) -> float:
    worst = 0.0
    for (name, p), (ref_name, q) in zip(model.named_parameters(), ref.named_parameters(),
                                        strict=True):
        assert name == ref_name
        full = p.full_tensor() if isinstance(p, DTensor) else p
        worst = max(worst, (full.detach() - q.detach()).abs().max().item())
    return worst


MESHES = {  # (mode, world) -> make_mesh kwargs
    ("fully_shard", 2): dict(dp_shard=2), ("fully_shard", 4): dict(dp_shard=4),
    ("replicate", 2): dict(dp_replicate=2, dp_shard=1),
    ("replicate", 4): dict(dp_replicate=4, dp_shard=1),
    ("hybrid_shard", 2): dict(dp_replicate=1, dp_shard=2),
    ("hybrid_shard", 4): dict(dp_replicate=2, dp_shard=2),
}


def _parity_vs_reference(rank: int, world: int) -> dict[str, tuple[float, float]]:
    ref = _reference()
    ref_losses = train(ref, STEPS, None, world)
    figures = {}
    for mode in ("fully_shard", "replicate", "hybrid_shard"):
        model = sf.data_parallel(_reference(), sf.make_mesh(**MESHES[mode, world]), mode=mode)
        losses = train(model, STEPS, rank, world)
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
        figures[mode] = (loss_diff, _max_param_diff(model, ref))
        assert figures[mode][0] <= REFERENCE_LOSS_RTOL and figures[mode][1] <= REFERENCE_ATOL, \
            (mode, figures[mode])
    return figures


@pytest.mark.quick
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.many_ranks)])
def test_parity_with_single_process_reference(world):
    figures = run_ranks(_parity_vs_reference, world)[0]
    print(f"world {world}: (max relative loss diff, max param diff) per mode: {figures}")


def _parity_vs_fsdp2(rank: int, world: int, mixed: bool) -> tuple[list[float], float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = sf.make_mesh(dp_shard=world)
    param_dtype = torch.bfloat16 if mixed else None
    reduce_dtype = torch.float32 if mixed else None
    # Untied: with a tied weight FSDP2 sums the two uses' gradients before its one
    # reduce-scatter while we reduce each use, so the float sums differ in order.
    fsdp2 = _reference(tie=False)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in fsdp2.layers:
        fully_shard(block, mesh=mesh["dp_shard"], mp_policy=policy)
    fully_shard(fsdp2, mesh=mesh["dp_shard"], mp_policy=policy)
    ours = sf.data_parallel(_reference(tie=False), mesh, mp_policy=sf.MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    fsdp2_losses = train(fsdp2, STEPS, rank, world)
    our_losses = train(ours, STEPS, rank, world)
    assert our_losses == fsdp2_losses, (our_losses, fsdp2_losses)
    for (name, p), (_, q) in zip(ours.named_parameters(), fsdp2.named_parameters(), strict=True):
        assert p.dtype == torch.float32, f"{name}: master weights must stay float32"
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
    return our_losses


@pytest.mark.quick
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-fp32"])
def test_bitwise_parity_with_fsdp2(mixed):
    losses = run_ranks(_parity_vs_fsdp2, 2, mixed)[0]
    assert losses[-1] < losses[0]


def _gathers(fn) -> int:
    with CommDebugMode() as comm:
        fn()
    counts = comm.get_comm_counts()
    return sum(v for k, v in counts.items() if "all_gather" in str(k))


def _cases(rank: int, world: int) -> dict[str, object]:
    mesh = sf.make_mesh(dp_shard=world)
    model = sf.data_parallel(_reference(), mesh)
    n_params = len(list(model.parameters()))  # tied weight counted once

    # Names, placements, local sizes: uneven (7 rows) and 1-row params on every world size.
    sd = model.state_dict()
    assert set(sd) == set(_reference().state_dict()), sorted(sd)
    assert all(isinstance(v, DTensor) for k, v in sd.items() if k != "position_scale")
    up = model.layers[0].up.weight
    assert up.placements == (Shard(0),) and up.shape == (7, 8)
    # torch.chunk's split of 7 rows, by hand: 4 + 3 over 2 ranks, 2 + 2 + 2 + 1 over 4.
    start, stop = {2: [(0, 4), (4, 7)], 4: [(0, 2), (2, 4), (4, 6), (6, 7)]}[world][rank]
    assert torch.equal(up.to_local(), _reference().layers[0].up.weight[start:stop]), \
        (rank, up.to_local().shape)
    gate = model.layers[0].gate.to_local()
    assert gate.shape[0] == (1 if rank == 0 else 0)
    # Tied weights stay one parameter; the frozen one stays frozen; the buffer is untouched.
    assert model.output.weight is model.tok_embeddings.weight
    assert not model.norm.bias.requires_grad and isinstance(model.norm.bias, DTensor)
    assert not isinstance(model.position_scale, DTensor)

    # Outside forward nothing communicates, even on one rank only.
    if rank == 0:
        assert _gathers(lambda: (repr(model), str(model), model.layers[0].up.bias,
                                 model.output.weight)) == 0

    # reshard_after_forward: re-gather every parameter in backward, or keep them.
    tokens = global_batch(0, world)[2 * rank:2 * rank + 2]
    fwd = _gathers(lambda: loss_fn(model, tokens))
    fwd_bwd = _gathers(lambda: loss_fn(model, tokens).backward())
    keep = sf.data_parallel(_reference(), mesh, reshard_after_forward=False)
    keep_fwd_bwd = _gathers(lambda: loss_fn(keep, tokens).backward())
    # The tied weight is read twice in forward (embedding, head): one gather per read.
    assert fwd == n_params + 1, (fwd, n_params)
    # Backward re-gathers exactly what autograd saved: per block the LayerNorm weight and
    # bias, up.weight, down.weight and gate (not up.bias: addmm keeps no bias), the final
    # norm's weight and bias, and the head's (tied) weight: 5 * 2 + 2 + 1.
    assert fwd_bwd - fwd == 13, (fwd_bwd, fwd)
    assert keep_fwd_bwd == fwd, (keep_fwd_bwd, fwd)
    for (name, p), (_, q) in zip(model.named_parameters(), keep.named_parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), name
    assert model.norm.bias.grad is None  # frozen

    # A forward whose compilation fails traces the root's pre-hook (no eager count) and
    # then runs its always_call post-hook eagerly on the error path; the eager state must
    # stay balanced: forward still gathers, nothing gathers outside it.
    for hook in model._forward_hooks.values():
        hook(model, (tokens,), None)
    # (a negative count made compiled graphs, which guarded on it, recompile)
    assert importlib.import_module("simplefsdp.data_parallel")._forward_depth == 0
    assert _gathers(lambda: loss_fn(model, tokens)) == fwd
    if rank == 0:
        assert _gathers(lambda: repr(model)) == 0

    # Summed instead of averaged gradients.
    summed = sf.data_parallel(_reference(), mesh, reduce_op="sum")
    loss_fn(summed, tokens).backward()
    for p, q in zip(model.parameters(), summed.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(q.grad.full_tensor(), world * p.grad.full_tensor())
    return {"gathers_forward": fwd, "gathers_forward_backward": fwd_bwd}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.many_ranks)])
def test_uneven_tied_frozen_buffers_reshard(world):
    print(run_ranks(_cases, world)[0])


def _meta_init_and_checkpoint(rank: int, world: int, tmp: str) -> None:
    mesh = sf.make_mesh(dp_shard=world)
    with torch.device("meta"):
        model = Toy()
    sf.data_parallel(model, mesh)
    model.to_empty(device="cpu")
    # Only shards were ever allocated: every local piece is at most ceil(rows / world).
    for name, p in model.named_parameters():
        assert p.to_local().shape[0] <= -(-p.shape[0] // world), name
    with sf.disable_active_parametrization():
        torch.manual_seed(rank)  # ranks differ: we then load identical values everywhere
        for p in model.parameters():
            nn.init.normal_(p, std=0.1)
    model.position_scale = torch.linspace(0.5, 1.5, 4).unsqueeze(-1)
    losses = train(model, 2, rank, world)
    assert all(torch.isfinite(torch.tensor(losses)))

    # DCP round trip: save after 2 steps, continue; a fresh model loads and continues alike.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = global_batch(7, world)[2 * rank:2 * rank + 2]
    loss_fn(model, tokens).backward()
    opt.step()
    opt.zero_grad()
    sf.save_checkpoint(f"{tmp}/step", {"app": sf.state_dict.ModelAndOptimizer(model, opt)})
    expected = loss_fn(model, tokens)
    expected.backward()
    opt.step()

    fresh = sf.data_parallel(_reference(seed=123), mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sf.load_checkpoint(f"{tmp}/step", {"app": sf.state_dict.ModelAndOptimizer(fresh, fresh_opt)})
    got = loss_fn(fresh, tokens)
    assert torch.equal(got, expected)
    got.backward()
    fresh_opt.step()
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), name
    full = sf.full_state_dict(fresh)
    if rank == 0:
        assert full["layers.0.up.weight"].shape == (7, 8)
        assert not isinstance(full["layers.0.up.weight"], DTensor)
    else:
        assert full == {}


@pytest.mark.quick
def test_meta_init_and_dcp_round_trip(tmp_path):
    run_ranks(_meta_init_and_checkpoint, 2, str(tmp_path))


def _full_state_dict_on_every_rank(rank: int, world: int) -> None:
    model = sf.data_parallel(_reference(), sf.make_mesh(dp_shard=world))
    train(model, 2, rank, world)  # values that differ from the init, on uneven shards
    expected = {k: v.full_tensor() if isinstance(v, DTensor) else v
                for k, v in model.state_dict().items()}
    everywhere = sf.full_state_dict(model, rank0_only=False)
    assert everywhere.keys() == _reference().state_dict().keys()
    for key, value in everywhere.items():
        assert type(value) is torch.Tensor and value.device.type == "cpu", key
        assert torch.equal(value, expected[key]), key
    # The tied weight is gathered once and shared by its two names.
    assert everywhere["output.weight"] is everywhere["tok_embeddings.weight"]
    # A copy: writing to it leaves the model alone.
    everywhere["layers.0.up.weight"].zero_()
    assert model.layers[0].up.weight.full_tensor().abs().sum() > 0
    only_rank0 = sf.full_state_dict(model)
    assert (only_rank0.keys() == everywhere.keys()) if rank == 0 else only_rank0 == {}
    dist.barrier()


def test_full_state_dict_on_every_rank():
    run_ranks(_full_state_dict_on_every_rank, 2)


def _bad_inputs(rank: int, world: int) -> None:
    mesh = sf.make_mesh(dp_shard=world)

    def raises(exc, match, fn):
        with pytest.raises(exc, match=match):
            fn()

    raises(ValueError, "unknown mode 'zero3'", lambda: sf.data_parallel(Toy(), mesh, "zero3"))
    raises(ValueError, "needs a 2-D mesh",
           lambda: sf.data_parallel(Toy(), mesh["dp_shard"], "hybrid_shard"))
    raises(ValueError, "world size is 2", lambda: sf.make_mesh(dp_shard=3))
    raises(ValueError, "not divisible", lambda: sf.make_mesh(tp=3))
    raises(ValueError, "use mode='hybrid_shard'",
           lambda: sf.data_parallel(Toy(), sf.make_mesh(dp_replicate=2, dp_shard=1)))
    twice = sf.data_parallel(Toy(), mesh)
    raises(ValueError, "already applied", lambda: sf.data_parallel(twice, mesh))
    scalar = nn.Linear(2, 2)
    scalar.temperature = nn.Parameter(torch.tensor(1.0))
    raises(ValueError, "'temperature' is a 0-dim", lambda: sf.data_parallel(scalar, mesh))
    raises(TypeError, "expects an nn.Module", lambda: sf.data_parallel(lambda x: x, mesh))
    raises(TypeError, "DeviceMesh", lambda: sf.data_parallel(Toy(), "cpu"))
    # A 0-dim parameter is fine when replicated.
    ok = nn.Linear(2, 2)
    ok.temperature = nn.Parameter(torch.tensor(1.0))
    sf.data_parallel(ok, sf.make_mesh(dp_replicate=world, dp_shard=1), mode="replicate")
    assert ok.temperature.placements == (Replicate(),)
    dist.barrier()


def test_bad_inputs_raise_clear_errors():
    run_ranks(_bad_inputs, 2)


def _plain_copy_from_state_dict(rank: int, world: int) -> None:
    model = sf.data_parallel(_reference(), sf.make_mesh(dp_shard=1))
    plain = Toy()
    plain.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v
                           for k, v in model.state_dict().items()})
    tokens = global_batch(0, 1)
    assert torch.equal(loss_fn(model, tokens), loss_fn(plain, tokens))


def test_world_size_one_state_dict_loads_into_plain_model():
    run_ranks(_plain_copy_from_state_dict, 1)


def _meshes_shared_per_process_group(rank, world):
    """Meshes and experts' meshes of one layout built twice; then the world-of-one
    layout again after the process group is destroyed and a new one joined."""
    from simplefsdp.mesh import ParallelDims

    first = sf.make_mesh(dp_shard=world)
    again = sf.make_mesh(dp_shard=world)
    other = sf.make_mesh(dp_replicate=world, dp_shard=1)
    experts = ParallelDims.expert_mesh(first, world), ParallelDims.expert_mesh(again, world)
    shared = [first is again, other is not first, experts[0] is experts[1]]
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    fresh = sf.make_mesh(dp_shard=1)
    total = torch.ones(1)
    dist.all_reduce(total, group=fresh.get_group("dp_shard"))  # its group is live
    return shared, fresh is not first, float(total)


@pytest.mark.parametrize("world", [1, 2])
def test_make_mesh_shares_groups_until_the_process_group_is_destroyed(world):
    """A layout built twice in one process is one mesh (one set of process groups, not
    two), the experts' too; another layout is another mesh. A mesh built over a process
    group since destroyed is never handed out again: with one rank, the layout built
    after a new process group is the first one's."""
    for shared, fresh, total in run_ranks(_meshes_shared_per_process_group, world):
        assert shared == [True, world > 1, True] and fresh and total == 1.0
