"""compile_backend on real gloo ranks: parity with eager, graph shape, SPMD safety.

Compiling is slow on CPU, so each spawned group compiles several variants of the smallest
model that shows the behaviour (the 2-block toy) and checks everything about them.

Tolerances: aot_eager runs the very ops eager runs (bucketing only concatenates and
slices, and two-rank sums commute exactly), so it must be bitwise equal to eager.
Inductor fuses and reorders float math: 1e-5 absolute on the loss and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rank_runner import run_ranks
from toy import Block, Toy, global_batch, loss_fn

import simplefsdp as sf
from simplefsdp._torch_compat import disable_compile_caches

INDUCTOR_ATOL = 1e-5


def _grads(model):
    return [p.grad.full_tensor() if p.grad is not None else None for p in model.parameters()]


def _step(model, rank, world):
    tokens = global_batch(0, world)[2 * rank:2 * rank + 2]
    loss = loss_fn(model, tokens)
    loss.backward()
    return loss.detach(), _grads(model)


def _fresh(world, n_layers=2, **kwargs):
    torch.manual_seed(0)
    return sf.data_parallel(Toy(n_layers=n_layers), sf.make_mesh(dp_shard=world), **kwargs)


def _check_schedule(report) -> None:
    """Order constraints of the paper's Figure 2 on the final schedule."""
    events = [(e, name) for e, name, _ in report.schedule]
    starts = [name for e, name in events if e == "all_gather"]
    pos = {ev: i for i, ev in enumerate(events)}
    for prev, nxt in zip(starts, starts[1:], strict=False):
        if report.graph == "forward":  # next gather issued before previous wait
            assert pos["all_gather", nxt] < pos["wait all_gather", prev], (prev, nxt, events)
        else:  # next gather issued after previous wait (and before its compute)
            assert pos["wait all_gather", prev] < pos["all_gather", nxt], (prev, nxt, events)
    scatters = [name for e, name in events if e == "reduce_scatter"]
    for prev, nxt in zip(scatters, scatters[1:], strict=False):
        # previous reduce-scatter's wait deferred until just before the next one
        assert pos["wait reduce_scatter", prev] < pos["reduce_scatter", nxt]
        if _one_op_gradients(prev, nxt):
            # both gradients come out of one op, so the second is ready when the first
            # is issued: nothing is left to overlap the first, and its wait comes right
            # before the second. (Counting nodes here would count a no-op view that
            # some torch versions add to the gradient: DTensor's to_local backward
            # wraps it with from_local.)
            assert pos["wait reduce_scatter", prev] + 1 == pos["reduce_scatter", nxt]
            continue
        # ... so computation runs while it is in flight
        assert report.nodes_in_flight[f"reduce_scatter {prev}"] > 0, report.nodes_in_flight
    if report.graph == "forward":  # every prefetched gather overlaps computation
        for name in starts[1:]:
            assert report.nodes_in_flight[f"all_gather {name}"] > 0, report.nodes_in_flight


def _one_op_gradients(prev: str, nxt: str) -> bool:
    """Whether two buckets hold the weight's and the bias's gradient of one LayerNorm
    (``bucketing="none"``: a bucket each), which one op (``native_layer_norm_backward``)
    computes together."""
    module = prev.rsplit("#", 1)[0]
    return module.endswith("norm") and nxt.rsplit("#", 1)[0] == module


def _compiled_variants(rank: int, world: int) -> dict:
    # The checks read our passes' reports, and an Inductor FX graph cache hit skips the
    # passes (its compiled code already holds what they did): every compile here is cold.
    # (On torch 2.11 a rerun's cache key matches the earlier run's; on 2.13 it never
    # does: the DeviceMeshes among its graph inputs pickle their per-process hash.)
    disable_compile_caches()
    eager = _fresh(world)
    eager_loss, eager_grads = _step(eager, rank, world)
    figures, schedules = {}, {}
    variants = [("aot_eager", "none", False), ("aot_eager", "none", True),
                ("aot_eager", "manual", False), ("aot_eager", "manual", True),
                ("inductor", "manual", True)]
    for backend, bucketing, reordering in variants:
        torch._dynamo.reset()
        model = _fresh(world)
        be = sf.compile_backend(backend=backend, bucketing=bucketing, reordering=reordering)
        loss, grads = _step(torch.compile(model, fullgraph=True, backend=be), rank, world)
        diff = max([(loss - eager_loss).abs().item()] +
                   [(a - b).abs().max().item() for a, b in zip(grads, eager_grads, strict=True)
                    if a is not None])
        if backend == "aot_eager":
            assert diff == 0.0, (backend, bucketing, reordering, diff)
        else:
            assert diff <= INDUCTOR_ATOL, (backend, bucketing, reordering, diff)
        fwd = next(r for r in be.reports if r.graph == "forward")
        bwd = next(r for r in be.reports if r.graph == "backward")
        # reshard_after_forward=True: backward gathers again, before any bucketing.
        assert bwd.collectives_before["all_gather"] > 0
        assert bwd.collectives_before["reduce_scatter"] == 15
        assert fwd.collectives_before == {"all_gather": 15}  # tied weight gathered once
        for report in (fwd, bwd):  # one collective per bucket
            for kind, count in report.collectives_after.items():
                assert count == sum(b["kind"] == kind for b in report.buckets), report
        if backend == "aot_eager":  # min-cut keeps 13 of 15 (see test_data_parallel)
            assert bwd.collectives_before["all_gather"] == 13
        if bucketing == "manual" and backend == "aot_eager":
            # default plan: [tok_embeddings], layers.0, layers.1, [norm, output]
            assert fwd.collectives_after == {"all_gather": 4}, fwd.collectives_after
            assert len(fwd.buckets) == 4
            # backward: the head, the two blocks (embedding read only via tied head)
            assert bwd.collectives_after == {"all_gather": 4, "reduce_scatter": 4}
        elif bucketing == "none":
            assert fwd.collectives_after == fwd.collectives_before
        if reordering:
            _check_schedule(fwd)
            _check_schedule(bwd)
            assert fwd.moves and bwd.moves
        else:
            assert not fwd.moves and not bwd.moves
        name = f"{backend}/{bucketing}/{'reorder' if reordering else 'keep'}"
        figures[name] = diff
        schedules[name] = [(r.graph, r.schedule) for r in be.reports]
    # SPMD: with uneven shards (hidden size 7 splits 4/3, the 1-row gate 1/0) every rank
    # must still issue the same collectives, of the same sizes, in the same order, in
    # every variant (a world of 4 adds no other kind of unevenness, and costs twice this)
    everyone = [None] * world
    dist.all_gather_object(everyone, schedules)
    assert all(s == everyone[0] for s in everyone), "ranks scheduled different collectives"
    return figures


def test_compiled_matches_eager_and_graphs_are_bucketed_and_reordered():
    figures = run_ranks(_compiled_variants, 2)[0]
    print("max |compiled - eager| per variant:", figures)


def _no_regather(rank: int, world: int) -> None:
    model = _fresh(world, reshard_after_forward=False)
    be = sf.compile_backend(backend="aot_eager", bucketing="manual")
    _step(torch.compile(model, fullgraph=True, backend=be), rank, world)
    bwd = next(r for r in be.reports if r.graph == "backward")
    assert "all_gather" not in bwd.collectives_before, bwd.collectives_before


def test_no_regather_without_reshard():
    run_ranks(_no_regather, 2)


def test_bad_backend_arguments():
    with pytest.raises(ValueError, match="backend must be one of"):
        sf.compile_backend(backend="tvm")
    with pytest.raises(ValueError, match="bucketing must be one of"):
        sf.compile_backend(bucketing="optimal")  # "greedy" is one now
    with pytest.raises(ValueError, match="module_plan is used only"):
        sf.compile_backend(module_plan=["layers.0"])
    with pytest.raises(ValueError, match="module_plan entries"):
        sf.compile_backend(bucketing="manual", module_plan=[3])


def test_wrapper_names_are_stripped_alike():
    """State dict keys and the module names the passes bucket by drop the same wrapper
    components (compile, activation checkpointing, FSDP1), wherever they stand."""
    from simplefsdp.state_dict import unwrapped_name

    assert unwrapped_name("_orig_mod.layers.0._checkpoint_wrapped_module.w.weight") == \
        "layers.0.w.weight"
    assert unwrapped_name("layers.1._fsdp_wrapped_module") == "layers.1"
    assert unwrapped_name("layers.2.attention") == "layers.2.attention"
    assert unwrapped_name("") == ""


class _WithUserAllReduce(torch.nn.Module):
    """A linear layer whose forward also runs the user's own all-reduce, on the very
    process group ``data_parallel`` shards over."""

    def __init__(self, group_name: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.group_name = group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        c10d = torch.ops._c10d_functional
        total = c10d.wait_tensor(c10d.all_reduce(y.detach(), "sum", self.group_name))
        return y * total


def _user_collective_counts(rank: int, world: int) -> dict:
    mesh = sf.make_mesh(dp_shard=world)
    torch.manual_seed(0)
    model = sf.data_parallel(_WithUserAllReduce(mesh["dp_shard"].get_group().group_name),
                             mesh)
    be = sf.compile_backend("aot_eager", bucketing="manual")
    torch.compile(model, fullgraph=True, backend=be)(torch.ones(2, 4)).sum().backward()
    return {r.graph: (r.collectives_before, r.other_collectives) for r in be.reports}


def test_only_the_parametrizations_collectives_are_ours():
    # Which collectives the passes own is read from the metadata data_parallel's gather
    # leaves on its nodes at trace time (issue 26), not from a list of group names: the
    # user's all-reduce on the same group stays the user's (a list of the groups took it
    # for ours). Counts by hand: weight and bias, gathered in forward, their gradients
    # reduce-scattered in backward (no re-gather: the input needs no gradient, so the
    # backward never reads the weight); the user's all-reduce is in forward only.
    counts = run_ranks(_user_collective_counts, 2)
    assert counts[0] == counts[1] == {
        "forward": ({"all_gather": 2}, 1),
        "backward": ({"reduce_scatter": 2}, 0)}, counts


class _EagerHelperToy(torch.nn.Module):
    """The toy whose output head is applied by a frame Dynamo leaves to eager
    (``_head``): it reads the head's weight itself, inside the compiled forward."""

    def __init__(self) -> None:
        super().__init__()
        self.toy = Toy(n_layers=2, tie=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        toy = self.toy
        h = toy.tok_embeddings(tokens)
        for layer in toy.layers:
            h = layer(h)
        return _head(toy, toy.norm(h))


@torch.compiler.disable
def _head(toy: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(h, toy.output.weight)


def _eager_frame_in_compiled_forward(rank: int, world: int) -> None:
    import importlib

    dp_module = importlib.import_module("simplefsdp.data_parallel")  # not the function
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = sf.data_parallel(_EagerHelperToy(), sf.make_mesh(dp_shard=world))
        run = torch.compile(model, backend="aot_eager") if compiled else model
        results.append(_step(run, rank, world))
        # back outside forward, parameters read as shards again
        assert dp_module._compiled_forward_depth == 0
        assert isinstance(model.toy.output.weight, torch.distributed.tensor.DTensor)
    (loss, grads), (loss_c, grads_c) = results
    assert torch.equal(loss, loss_c)
    for g, g_c in zip(grads, grads_c, strict=True):
        assert (g is None and g_c is None) or torch.equal(g, g_c)


def test_a_frame_left_to_eager_inside_a_compiled_forward_gathers():
    """A frame Dynamo runs eagerly inside a compiled forward (a ``torch.compiler.disable``
    function, or one past the recompile limit) reads the parameters gathered, as the
    graphs around it do (before: the sharded DTensor, "mixed torch.Tensor and DTensor").
    aot_eager runs eager's ops: the loss and every gradient bitwise equal to eager's."""
    run_ranks(_eager_frame_in_compiled_forward, 2)


_DEPTHS_SEEN: list[int] = []  # the compiled-forward depth each eager gelu ran at


@torch.compiler.disable
def _gelu_left_to_eager(x: torch.Tensor) -> torch.Tensor:
    """A frame Dynamo leaves to eager inside a block: records the compiled-forward depth
    (``data_parallel._compiled_forward_depth``) it runs at."""
    import importlib

    _DEPTHS_SEEN.append(importlib.import_module("simplefsdp.data_parallel")
                        ._compiled_forward_depth)
    return torch.nn.functional.gelu(x)


class _BlockWithEagerFrame(Block):
    """The toy's block with a graph break inside (its gelu left to eager), as a block
    Dynamo cannot trace whole (a Hugging Face layer, an untraceable dispatch): under a
    compiled model its checkpoint cannot be traced into one graph with it, and the model
    runs as several compiled frames around eager ones."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.down(_gelu_left_to_eager(self.up(self.norm(x))))


def _frames_around_eager_blocks(rank: int, world: int) -> dict:
    import torch.nn.functional as F
    from torch._dynamo.utils import guard_failures

    from simplefsdp.parallel.activation_checkpoint import checkpointed

    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Toy(n_layers=2, tie=False)
        model.layers = torch.nn.ModuleList(checkpointed(_BlockWithEagerFrame(), "full")
                                           for _ in range(2))
        model = sf.data_parallel(model, sf.make_mesh(dp_shard=world))
        _DEPTHS_SEEN.clear()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        tokens = global_batch(0, world)[2 * rank:2 * rank + 2]
        losses = []
        for _ in range(2):  # the second step enters the first step's frames again
            logits = run(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            losses.append(loss.detach())
        results.append((losses, _grads(model)))
    (losses, grads), (losses_c, grads_c) = results
    assert all(torch.equal(a, b) for a, b in zip(losses, losses_c, strict=True))
    for g, g_c in zip(grads, grads_c, strict=True):
        assert (g is None and g_c is None) or torch.equal(g, g_c)
    return {"depths": list(_DEPTHS_SEEN),
            "depth_guards": [str(r) for rs in guard_failures.values() for r in rs
                             if "_compiled_forward_depth" in str(r)]}


def test_the_forward_depth_counter_stays_out_of_guards():
    """Full AC on blocks Dynamo cannot trace whole (a graph break inside each), compiled
    with aot_eager on 2 gloo ranks, 2 steps: the model runs as compiled frames around
    the blocks' eager gelu, which runs at compiled-forward depth 1 (so it gathers). The
    counter moves by a call Dynamo replays after the graph holding it
    (``_torch_compat.replay_after_graph``), so its value is in no frame's guards: no
    guard fails on it. Traced, the update put the value in the guards, and frames
    compiled at one depth were entered at another (here on torch 2.13:
    ``G['_compiled_forward_depth'] == 0`` and ``== 2`` failing), so they compiled again;
    a model with many blocks (DeepSeek-V3 16B's 27, torch 2.11, a block recomputed from
    backward) passed the recompile limit, recomputed eagerly and saved other tensors
    than its compiled forward ("Recomputed values ... have different metadata"). Losses
    and every gradient bitwise equal to eager's (aot_eager runs eager's ops)."""
    for per_rank in run_ranks(_frames_around_eager_blocks, 2):
        assert per_rank["depths"] and set(per_rank["depths"]) == {1}, per_rank
        assert per_rank["depth_guards"] == [], per_rank
