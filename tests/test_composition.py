"""Composition under compile: every data-parallel mode with TP/SP, PP and activation
checkpointing compiles, buckets and reorders only its own collectives.

Crashes from issue 17, each reproduced here (they failed before the fix):
* hybrid_shard + bucketing: the HSDP all-reduce was merged as a reduce-scatter;
* the trainer with TP + compile + manual bucketing: the TP all-reduce, likewise;
* replicate + bucketing: one all-reduce per parameter was left (no buckets);
* auto wrapping left every all-reduce alone.
Then the pairwise composition subset of ``scripts/composition_matrix.py`` (the full
matrix is that script's job).

Auto bucketing plans here with a fixed communication model (``FIXED_COMM``) and a fresh
cache folder per test: the calibration, its disk cache and the drift probe that guards
it are tested elsewhere (test_cost_model, test_calibration_probe,
test_loaded_calibration); timing them here cost the most CPU of this file, and a host
loaded by other jobs made them recalibrate. A fresh folder keeps the plan cache from
an earlier run out, so the auto pass measures, decides and agrees live every time.

Tolerances: aot_eager runs the ops eager runs, and bucketing only concatenates and
slices; every reduction here is over 2 ranks (a + b == b + a exactly), so compiled and
eager must be bitwise equal. Inductor: ``composition_matrix.INDUCTOR_ATOL`` (1e-4).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rank_runner import run_ranks
from toy import Toy, global_batch, loss_fn

import simplefsdp as sf
from simplefsdp.compiler.cost.comm import default_comm_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import composition_matrix as matrix  # noqa: E402

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

# The auto cells' comm model: the fabric table's CPU loopback figures for 4 ranks.
FIXED_COMM = default_comm_model(4)


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    """Every test's ranks (they inherit the environment) keep their plan cache in a
    folder of their own: no decision is read from an earlier run."""
    monkeypatch.setenv("SIMPLEFSDP_CACHE_DIR", str(tmp_path / "simplefsdp_cache"))


def _train(model, rank, steps=2):
    """Two SGD steps: the second runs on the first's update, so a wrong gradient shows
    in its loss, and the last weights hold both updates."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        loss = loss_fn(model, global_batch(step, 4)[2 * rank:2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _params(model):
    return [(name, p.to_local().detach().clone()) for name, p in model.named_parameters()]


def _mesh(mode, world):
    if mode == "hybrid_shard":
        return sf.make_mesh(dp_replicate=2, dp_shard=world // 2)
    if mode == "replicate":
        return sf.make_mesh(dp_replicate=world, dp_shard=1)
    return sf.make_mesh(dp_shard=world)


def _compiled_vs_eager(rank, world, mode, settings):
    """Per backend setting: (reports, what differs from eager on this rank after the SGD
    steps of ``_train``: its losses, or the names of its parameter shards that are not
    bitwise equal).
    Every rank returns its own: each holds a different shard (and, under hybrid_shard,
    ranks 2 and 3 the other replica), so the test checks all of them."""
    torch.manual_seed(0)
    eager = sf.data_parallel(Toy(n_layers=2), _mesh(mode, world), mode=mode)
    eager_losses = _train(eager, rank)
    out = []
    for kwargs in settings:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = sf.data_parallel(Toy(n_layers=2), _mesh(mode, world), mode=mode)
        backend = sf.compile_backend("aot_eager", **kwargs)
        losses = _train(torch.compile(model, fullgraph=True, backend=backend), rank)
        differs = ([] if losses == eager_losses else [f"losses {losses} != {eager_losses}"]) + [
            name for (name, a), (_, b) in zip(_params(model), _params(eager), strict=True)
            if not torch.equal(a, b)]
        out.append(([(r.graph, r.collectives_before, r.collectives_after, r.buckets,
                      r.schedule) for r in backend.reports[-2:]], differs))
    return out


def _every_rank_equal(results, settings, what):
    """Every rank's result: compiled bitwise equal to eager under every setting; then
    rank 0's reports (the graphs and plans are the same on every rank)."""
    for rank, per_setting in enumerate(results):
        for kwargs, (_, differs) in zip(settings, per_setting, strict=True):
            assert not differs, f"rank {rank}, {kwargs}: compiled {what} differs from eager: " \
                f"{differs}"
    return results[0]


def _backward(reports):
    return next(r for r in reports if r[0] == "backward")


def test_hybrid_shard_compiles_with_manual_and_auto_bucketing():
    settings = [dict(bucketing="manual"),
                dict(bucketing="auto", memory_limit_gb=None, comm_model=FIXED_COMM)]
    results = _every_rank_equal(run_ranks(_compiled_vs_eager, 4, "hybrid_shard", settings),
                                settings, "HSDP")
    for kwargs, (reports, _) in zip(settings, results, strict=True):
        _, before, after, buckets, _ = _backward(reports)
        # Toy: 15 gradients; each reduce-scatter (shard group) feeds one all-reduce of
        # its shard (replicate group): bucketed alike, one all-reduce per RS bucket.
        assert before["reduce_scatter"] == before["all_reduce"] == 15, before
        assert after["all_reduce"] == after["reduce_scatter"] < 15, (kwargs, after)
        for kind in after:
            assert after[kind] == sum(b["kind"] == kind for b in buckets), (kind, buckets)
        rs = [b["modules"] for b in buckets if b["kind"] == "reduce_scatter"]
        ar = [b["modules"] for b in buckets if b["kind"] == "all_reduce"]
        assert rs == ar, "each all-reduce bucket must hold its reduce-scatter's shards"


@pytest.mark.quick
def test_replicate_compiles_into_size_capped_all_reduce_buckets():
    nbytes = sum(p.numel() * 4 for p in Toy(n_layers=2).parameters())  # 2200 B, fp32
    cap_mb = 500 / 1e6  # 500 B: several buckets
    settings = [dict(bucketing="manual"), dict(bucketing="auto", comm_model=FIXED_COMM),
                dict(bucketing="manual", all_reduce_bucket_mb=cap_mb)]
    results = _every_rank_equal(run_ranks(_compiled_vs_eager, 2, "replicate", settings),
                                settings, "replicate")
    counts = []
    for kwargs, (reports, _) in zip(settings, results, strict=True):
        _, before, after, buckets, schedule = _backward(reports)
        assert before == {"all_reduce": 15}, before
        cap = kwargs.get("all_reduce_bucket_mb", 25.0) * 1e6
        assert after["all_reduce"] <= nbytes // cap + 1, (kwargs, after)
        assert after["all_reduce"] == len(buckets)
        counts.append(after["all_reduce"])
        # Reordering (on by default) issues every bucket before the first wait: each
        # runs under the rest of backward, and none waits for the one before (as DDP).
        events = [event for event, _, _ in schedule]
        assert events == ["all_reduce"] * len(buckets) + ["wait all_reduce"] * len(buckets), \
            (kwargs, schedule)
    assert counts[:2] == [1, 1] and counts[2] >= nbytes // 500, counts


# ---------------------------------------------------------------------------------------
# The pairwise composition subset.
# ---------------------------------------------------------------------------------------
@pytest.mark.quick
def test_ci_cells_cover_every_pair_within_four_processes():
    assert all(c.world <= 4 for c in matrix.CI_CELLS)
    # Full AC under compile trains (issue 27): no cell is refused on a torch whose
    # Inductor takes a custom partitioner (2.13), so the full-AC cells must come out ok.
    from simplefsdp._torch_compat import custom_partitioner_base

    if custom_partitioner_base() is not None:
        assert not any(matrix.refused(c) for c in matrix.CI_CELLS)
    assert {c.backend for c in matrix.CI_CELLS if c.ac == "full"} == {"aot_eager", "inductor"}
    assert matrix.uncovered_pairs(matrix.CI_CELLS, 4) == []
    for k in range(len(matrix.CI_CELLS)):  # every cell is needed: the check can fail
        assert matrix.uncovered_pairs(matrix.CI_CELLS[:k] + matrix.CI_CELLS[k + 1:], 4)


def _check_cell(row: dict, cell: matrix.Cell) -> None:
    if matrix.refused(cell):
        assert row["status"] == "refused", row
        assert "custom_partitioner_fn" in row["error"], row["error"]
        return
    assert row["status"] == "ok", f"{cell.name}: {row['error']}"
    if cell.backend == "aot_eager":
        assert row["loss_diff"] == 0.0 and row["param_diff"] == 0.0, row
    else:
        assert row["loss_diff"] <= matrix.INDUCTOR_ATOL, row
        assert row["param_diff"] <= matrix.INDUCTOR_ATOL, row
    # What the profiler saw in a compiled step: one collective per bucket, plus the
    # TP/SP collectives our passes left alone.
    assert row["profiled"] == row["buckets"] + row["other"], row
    assert (row["other"] > 0) == (cell.tp > 1), row
    if cell.bucketing != "none":
        assert sum(row["after"].values()) < sum(row["before"].values()), row


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_composition_pairwise_subset(backend):
    cells = [c for c in matrix.CI_CELLS if c.backend == backend]
    rows = run_ranks(matrix.run_cells, 4, cells, None, FIXED_COMM)[0]
    print("\n" + matrix.table(rows))
    for row, cell in zip(rows, cells, strict=True):
        _check_cell(row, cell)
