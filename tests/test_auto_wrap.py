"""Auto wrapping (Algorithm 1): the greedy on synthetic timelines with hand-derived
answers, and bucketing="auto" on real gloo ranks (bitwise parity with eager under
aot_eager, 1e-5 under Inductor, the same schedule on every rank).

The calibration itself (fit on a live gloo group, identical on all ranks, predictions
within 3x of fresh measurements) is tested in tests/test_cost_model.py.

Time units below: ms; ``_model(alpha_ms, ns_per_byte)`` builds a CommModel with the
same figures for every collective kind.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from rank_runner import run_ranks
from test_compiler import INDUCTOR_ATOL, _check_schedule, _fresh, _step
from toy import Toy

import simplefsdp as sf
from simplefsdp.compiler import auto_wrap as aw
from simplefsdp.compiler.cost import CommModel

MS = 1e-3


def _model(alpha_ms: float, ns_per_byte: float) -> CommModel:
    pair = (alpha_ms * MS, ns_per_byte * 1e-9)
    return CommModel(pair, pair, pair, world_size=2, source="test")


def _steps(compute_ms, nbytes=1_000_000, memory=1_000_000, scatter=0) -> list[aw.Step]:
    return [aw.Step(f"s{i}", nbytes, c * MS, memory, scatter) for i, c in enumerate(compute_ms)]


# ------------------------------------------------------------------ the greedy, pure


def test_fits_under_compute_merges_and_tight_memory_splits():
    # alpha 1 ms, 1 ns/B, 1 MB per step: a bucket of k steps costs 1 + k ms.
    # First bucket: nothing to hide behind; merging step 1 exposes 3 ms, a split 2 ms.
    # Second bucket hides behind step 0's 10 ms: 1 + k <= 10 holds for all 7 others.
    steps, comm = _steps([10] * 8), _model(1.0, 1.0)
    buckets, decisions = aw.greedy_buckets(steps, comm)
    assert buckets == [[0], [1, 2, 3, 4, 5, 6, 7]]
    assert [d.merged for d in decisions] == [False] + [True] * 6
    assert all(d.reason == "fits under compute" for d in decisions[1:])
    assert decisions[1].comm_s == pytest.approx(3 * MS)  # step 2 joins {1}: 1 + 2 ms
    assert decisions[1].compute_s == pytest.approx(10 * MS)  # behind step 0's compute
    # Memory 1 MB per step, limit 3 MB: at most 3 steps per bucket.
    tight, tight_decisions = aw.greedy_buckets(steps, comm, memory_limit_bytes=3e6)
    assert tight == [[0], [1, 2, 3], [4, 5, 6], [7]]
    assert len(tight) > len(buckets)
    assert all(sum(steps[i].memory_bytes for i in b) <= 3e6 for b in tight)
    assert [d.reason for d in tight_decisions].count("memory over the limit") == 2
    assert aw.greedy_buckets(steps, comm) == (buckets, decisions)  # deterministic


def test_no_overlap_means_fewest_buckets_under_memory():
    # The first test's timeline, but compute hides nothing (gloo sharing the cores):
    # every split adds an exposed alpha, so one bucket; a memory limit still splits it.
    steps = _steps([10] * 8)
    comm = dataclasses.replace(_model(1.0, 1.0), hidden_fraction=0.0)
    buckets, decisions = aw.greedy_buckets(steps, comm)
    assert buckets == [list(range(8))]
    assert all(d.compute_s == 0.0 for d in decisions)  # the window is compute x hidden_fraction
    assert aw.greedy_buckets(steps, comm, memory_limit_bytes=3e6)[0] == \
        [[0, 1, 2], [3, 4, 5], [6, 7]]
    # Half hidden: step 0's 10 ms hides 5 ms, so the second bucket stops at 4 steps
    # (1 + 4 ms fits, 1 + 5 ms exposes 1 ms, more than a new collective would).
    half = dataclasses.replace(comm, hidden_fraction=0.5)
    assert aw.greedy_buckets(steps, half)[0][:2] == [[0], [1, 2, 3, 4]]


@pytest.mark.parametrize(("alpha_ms", "expected"), [
    (0.1, [[0], [1, 2, 3, 4, 5, 6, 7]]),  # fast: one collective hides behind 1 ms
    (2.5, [[0, 1, 2], [3, 4, 5, 6, 7]]),  # grow until compute (3 ms) hides alpha
    (5.5, [[0, 1, 2, 3, 4, 5], [6, 7]]),  # grow until compute (6 ms) hides alpha
    (100.0, [[0, 1, 2, 3, 4, 5, 6, 7]]),  # compute never hides it: one collective
])
def test_slow_network_buckets_more(alpha_ms, expected):
    # 1 ms of compute per step, ~1 us of bytes: latency decides. Exposed either way,
    # merging costs 1 us, splitting costs alpha minus the compute so far: merge while
    # the bucket's compute is below alpha.
    steps, comm = _steps([1] * 8), _model(alpha_ms, 0.001)
    buckets, _ = aw.greedy_buckets(steps, comm)
    assert buckets == expected
    chosen = aw.estimate_exposed(steps, buckets, comm)
    singles = aw.estimate_exposed(steps, [[i] for i in range(8)], comm)
    one = aw.estimate_exposed(steps, [list(range(8))], comm)
    assert chosen <= min(singles, one) + 1e-12, (chosen, singles, one)


def test_backward_reduce_scatter_shares_the_window():
    # AG and RS: alpha 0.1 ms, 0.5 MB per step at 1 ns/B -> k steps cost 0.1 + 0.5k ms.
    compute = [1, 1, 10, 10, 10]
    comm = _model(0.1, 1.0)
    forward, _ = aw.greedy_buckets(_steps(compute, nbytes=500_000), comm)
    # Forward: step 1 (0.6 ms) hides behind step 0 alone; {1, 2} (1.1 ms) would not.
    assert forward == [[0], [1], [2], [3, 4]]
    steps = _steps(compute, nbytes=500_000, scatter=500_000)
    backward, decisions = aw.greedy_buckets(steps, comm)
    # Backward: behind step 1's compute, step 2 alone would share it with bucket {0}'s
    # 0.6 ms reduce-scatter (0.2 ms exposed); merged into {1, 2} only 0.1 ms is exposed.
    assert backward == [[0], [1, 2], [3, 4]]
    last = decisions[-1]  # step 4 joins {3}: behind {1, 2}'s 11 ms with {0}'s RS
    assert last.merged and last.scatter_s == pytest.approx(0.6 * MS)
    assert last.compute_s == pytest.approx(11 * MS)


def test_bad_inputs():
    with pytest.raises(ValueError, match="memory_limit_gb must be a positive"):
        sf.compile_backend(bucketing="auto", memory_limit_gb=-1)
    with pytest.raises(ValueError, match="memory_limit_gb must be a positive"):
        aw.check_memory_limit(0)
    with pytest.raises(ValueError, match="memory_limit_bytes must be positive"):
        aw.greedy_buckets(_steps([1]), _model(1, 1), memory_limit_bytes=-5)
    with pytest.raises(ValueError, match="comm_model must be"):
        sf.compile_backend(bucketing="auto", comm_model={"alpha": 1})
    assert aw.greedy_buckets([], _model(1, 1)) == ([], [])
    assert aw.check_memory_limit(2) == 2e9


# ------------------------------------------------------------------ on real ranks


def _diff(a, b) -> float:
    (la, ga), (lb, gb) = a, b
    return max([(la - lb).abs().item()] + [(x - y).abs().max().item()
                                           for x, y in zip(ga, gb, strict=True)
                                           if x is not None])


def _auto_variants(rank: int, world: int, cache_dir: str) -> dict:
    import os

    os.environ["SIMPLEFSDP_CACHE_DIR"] = cache_dir
    eager = _step(_fresh(world), rank, world)
    out = {}
    variants = {"calibrated": {},  # measured on this group, cached under cache_dir
                "slow": {"comm_model": _model(1000.0, 1.0)},  # nothing ever hides it
                "tight": {"memory_limit_gb": 1e-9}}  # 1 byte: nothing may merge
    for name, kwargs in variants.items():
        torch._dynamo.reset()
        be = sf.compile_backend(backend="aot_eager", bucketing="auto", **kwargs)
        result = _step(torch.compile(_fresh(world), fullgraph=True, backend=be), rank, world)
        assert _diff(result, eager) == 0.0, name  # bucketing only concatenates and slices
        fwd = next(r for r in be.reports if r.graph == "forward")
        bwd = next(r for r in be.reports if r.graph == "backward")
        for report in (fwd, bwd):
            _check_schedule(report)
            assert len(report.decisions) == report.collectives_before["all_gather"] - 1
            assert report.estimated_exposed_s is not None and report.estimated_exposed_s >= 0
            assert "decision:" in str(report)
            for kind, count in report.collectives_after.items():
                assert count == sum(b["kind"] == kind for b in report.buckets)
        # reduce-scatters follow their all-gathers' buckets
        ag_names = {b["name"] for b in bwd.buckets if b["kind"] == "all_gather"}
        assert {b["name"] for b in bwd.buckets if b["kind"] == "reduce_scatter"} <= ag_names
        if name == "slow":
            assert fwd.collectives_after == {"all_gather": 1}
            assert bwd.collectives_after == {"all_gather": 1, "reduce_scatter": 1}
        if name == "tight":
            assert fwd.collectives_after == fwd.collectives_before
            assert not any(d.merged for r in (fwd, bwd) for d in r.decisions)
        if name == "calibrated":
            assert fwd.comm_model["source"] in ("calibrated", "cache")
        out[name] = [(r.graph, r.schedule, [str(d) for d in r.decisions], r.buckets)
                     for r in be.reports]
    # No re-gather in backward: the reduce-scatters are the steps (walked backwards).
    torch._dynamo.reset()
    eager_keep = _step(_fresh(world, reshard_after_forward=False), rank, world)
    be = sf.compile_backend(backend="aot_eager", bucketing="auto")
    model = _fresh(world, reshard_after_forward=False)
    result = _step(torch.compile(model, fullgraph=True, backend=be), rank, world)
    assert _diff(result, eager_keep) == 0.0
    bwd = next(r for r in be.reports if r.graph == "backward")
    assert "all_gather" not in bwd.collectives_before
    assert len(bwd.decisions) == bwd.collectives_before["reduce_scatter"] - 1
    _check_schedule(bwd)
    out["no_regather"] = [(r.graph, r.schedule, r.buckets) for r in be.reports]
    # Inductor: the pass talks to the other rank, so it must run on every compile; a
    # second compile of the same graph must not be served from Inductor's caches.
    for attempt in range(2):
        torch._dynamo.reset()
        be = sf.compile_backend(backend="inductor", bucketing="auto")
        result = _step(torch.compile(_fresh(world), fullgraph=True, backend=be), rank, world)
        assert _diff(result, eager) <= INDUCTOR_ATOL, attempt
        assert {r.graph for r in be.reports} == {"forward", "backward"}, attempt
        assert all(r.decisions for r in be.reports), attempt
        out[f"inductor{attempt}"] = [(r.graph, r.schedule, r.buckets) for r in be.reports]
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    assert all(o == everyone[0] for o in everyone), "ranks chose different buckets"
    return {k: [len(v[i][-1]) for i in range(len(v))] for k, v in out.items()}


def test_auto_matches_eager_and_ranks_agree(tmp_path):
    buckets = run_ranks(_auto_variants, 2, str(tmp_path))[0]
    print("buckets per graph (forward, backward):", buckets)
    assert list(tmp_path.glob("comm_model_*.json")), "calibration was not cached on disk"


def _hybrid_and_stages(rank: int, world: int, cache_dir: str) -> dict:
    import os

    from simplefsdp.mesh import stage_group

    os.environ["SIMPLEFSDP_CACHE_DIR"] = cache_dir
    # HSDP 2x2: each replica has its own shard group, but all four ranks compile the same
    # graph, so the measurements are agreed over all of them and the plans are identical.
    mesh = sf.make_mesh(dp_replicate=2, dp_shard=2)
    torch.manual_seed(0)
    model = sf.data_parallel(Toy(n_layers=2), mesh, mode="hybrid_shard")
    be = sf.compile_backend(backend="aot_eager", bucketing="auto")
    _step(torch.compile(model, fullgraph=True, backend=be), rank % 2, 2)
    plans = [(r.graph, r.schedule, [str(d) for d in r.decisions]) for r in be.reports]
    everyone = [None] * world
    dist.all_gather_object(everyone, plans)
    assert all(p == everyone[0] for p in everyone), "HSDP replicas chose different buckets"
    # Under PP the ranks of one stage agree: stage_group is this rank's stage.
    group = stage_group(sf.make_mesh(pp=2, dp_shard=2))
    assert dist.get_process_group_ranks(group) == ([0, 1] if rank < 2 else [2, 3])
    assert stage_group(mesh) is None  # no pp: one stage, all ranks
    return {"graphs": len(plans)}


def test_hybrid_shard_ranks_agree_and_stage_groups(tmp_path):
    assert run_ranks(_hybrid_and_stages, 4, str(tmp_path))[0] == {"graphs": 2}
