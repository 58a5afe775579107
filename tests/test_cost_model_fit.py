"""The robust alpha-beta fit of the comm model, the compute-slowdown term of the
simulated step, and per-group calibration on a 2x2 mesh (4 gloo ranks)."""

from __future__ import annotations

import os

import pytest
from rank_runner import run_ranks

from simplefsdp.compiler.cost import CommModel, comm, fit
from simplefsdp.compiler.simulate import CollectiveCost, simulate

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

SIZES = [4096 * 4 ** i for i in range(7)]  # the CPU calibration sizes, 4 KiB .. 16 MiB
ALPHA, BETA = 5e-4, 1.5e-9  # a gloo-like latency and per-byte time


def line(n: float) -> float:
    return ALPHA + BETA * n


def test_theil_sen_and_robust_fit_are_exact_without_noise():
    a, b = fit.theil_sen([float(n) for n in SIZES], [line(n) for n in SIZES])
    assert a == pytest.approx(ALPHA, rel=1e-12) and b == pytest.approx(BETA, rel=1e-12)
    (alpha, beta), dropped = fit.robust_fit(SIZES, [line(n) for n in SIZES])
    assert dropped == []
    # float round-off only: the weighted least squares is exact in exact arithmetic
    assert alpha == pytest.approx(ALPHA, rel=1e-9) and beta == pytest.approx(BETA, rel=1e-9)


def test_robust_fit_rejects_outliers():
    # Repeats: every size has one sample 8x too slow (a descheduled rank) among five;
    # the median ignores it.
    samples = [[line(n)] * 4 + [8 * line(n)] for n in SIZES]
    (alpha, beta), dropped = fit.robust_fit(SIZES, samples)
    assert dropped == []
    assert alpha == pytest.approx(ALPHA, rel=1e-9) and beta == pytest.approx(BETA, rel=1e-9)
    # A whole size off (a burst of load over every repeat of 64 KiB: 6x slow; of 16 MiB:
    # 3x slow): both are dropped and the rest are fitted exactly. The plain least
    # squares over the same medians is far off, so the rejection is what makes it exact.
    medians = [line(n) for n in SIZES]
    medians[2] *= 6
    medians[6] *= 3
    (alpha, beta), dropped = fit.robust_fit(SIZES, medians)
    assert dropped == [2, 6]
    assert alpha == pytest.approx(ALPHA, rel=1e-9) and beta == pytest.approx(BETA, rel=1e-9)
    naive_alpha, naive_beta = fit.fit_alpha_beta(SIZES, medians)
    assert max(abs(naive_beta / BETA - 1), abs(naive_alpha / ALPHA - 1)) > 0.1
    # Too few points left to drop any: all are kept (and nothing raises).
    assert fit.robust_fit([4096, 65536], [1e-3, 9e-3])[1] == []
    assert fit.robust_fit([4096], [[1e-3, 2e-3, 3e-3]]) == ((2e-3, 0.0), [])
    with pytest.raises(ValueError, match="as many sizes as timings"):
        fit.robust_fit([1, 2], [1.0])


def test_compute_slowdown_is_contention_in_the_estimate():
    steps = [CollectiveCost(f"layers.{i}", 4 * 2 ** 20, 2e-3, 0) for i in range(4)]
    base = CommModel((1e-4, 1e-10), (1e-4, 1e-10), (2e-4, 2e-10), hidden_fraction=1.0,
                     world_size=2)
    slowed = CommModel((1e-4, 1e-10), (1e-4, 1e-10), (2e-4, 2e-10), hidden_fraction=1.0,
                       compute_slowdown=1.5, world_size=2)
    plan = [[0, 1], [2, 3]]
    a, b = simulate(steps, plan, base), simulate(steps, plan, slowed)
    assert a.compute_s == b.compute_s == pytest.approx(8e-3)
    assert a.contention_s == 0.0 and b.contention_s == pytest.approx(4e-3)
    # slower compute hides at least as much: the exposed communication cannot grow
    assert b.exposed_s <= a.exposed_s
    assert b.overhead_s == pytest.approx(b.contention_s + b.copy_s + b.exposed_s)
    assert b.step_s == pytest.approx(b.compute_s + b.overhead_s)
    # the slowdown round-trips through the cache form; the default model has none
    assert CommModel.from_dict(slowed.to_dict()) == slowed
    assert comm.default_comm_model(2).compute_slowdown == 1.0


def _per_group(rank: int, world_size: int, folder: str) -> dict:
    import simplefsdp as sf

    os.environ["SIMPLEFSDP_CACHE_DIR"] = folder
    mesh = sf.make_mesh(dp_replicate=2, dp_shard=2)
    models = comm.get_comm_models(mesh["dp_replicate", "dp_shard"],
                                  sizes=[4096, 262144], repeats=3, warmup=1)
    again = comm.get_comm_models(mesh["dp_replicate", "dp_shard"], calibrate_on_miss=False)
    return {"models": models, "again": again, "files": sorted(os.listdir(folder))}


def test_per_group_calibration_on_a_2x2_mesh(tmp_path):
    results = run_ranks(_per_group, 4, str(tmp_path))
    for r in results:
        assert set(r["models"]) == {"dp_replicate", "dp_shard"}
        shard, replicate = r["models"]["dp_shard"], r["models"]["dp_replicate"]
        # each calibrated on its own group: ranks {0,1},{2,3} vs {0,2},{1,3}
        assert shard.group == (0, 1) and replicate.group == (0, 2)
        for m in (shard, replicate):
            assert m.source == "calibrated" and m.world_size == 2
            # (compute_slowdown is clamped to >= 1 by its probe, so no check of it here
            # could fail; its arithmetic is checked on a fake clock in test_cost_model)
            assert m.max_bytes == 262144
            for kind in comm.COLLECTIVE_KINDS:
                alpha, beta = m.params(kind)
                assert alpha >= 0 and beta >= 0 and (alpha > 0 or beta > 0)
        # the second lookup is the cache, per group
        assert r["again"] == r["models"]
        assert {m.source for m in r["again"].values()} == {"cache"}
    # the ranks of one group hold the same figures (agreed over that group)
    for dim, pairs in (("dp_shard", [(0, 1), (2, 3)]), ("dp_replicate", [(0, 2), (1, 3)])):
        for i, j in pairs:
            assert repr(results[i]["models"][dim]) == repr(results[j]["models"][dim])
    # one cache file per group layout, keyed apart
    assert len(results[0]["files"]) == 2
    # HSDP's plan reads each kind from its group
    shard, replicate = results[0]["models"]["dp_shard"], results[0]["models"]["dp_replicate"]
    hsdp = shard.with_kind_from("all_reduce", replicate)
    assert hsdp.all_reduce == replicate.all_reduce and hsdp.reduce_scatter == shard.reduce_scatter
