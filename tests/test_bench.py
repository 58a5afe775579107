"""Smoke test of ``python -m simplefsdp.bench``: 2 gloo ranks, the tiniest model, 2 steps.

No timing is asserted: only that the run finishes, writes its outputs with the expected
structure, that a variant that cannot be built is recorded as failed (not fatal), and
that all variants that train on the same data agree on the loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from simplefsdp.bench.__main__ import build_config, parse_args
from simplefsdp.bench.config import BenchConfig, BenchConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE_VARIANTS = ["simplefsdp-eager", "simplefsdp-reordering", "simplefsdp-auto",
                  "fsdp2-eager", "ddp-replicate", "torch-ddp", "compute-only"]


def _bench(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):  # never look like torchrun
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "simplefsdp.bench", "--output-dir", str(tmp_path), *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_smoke_two_ranks(tmp_path):
    proc = _bench(tmp_path, "--world-size", "2", "--model-arg", "n_layers=1",
                  "--model-arg", "dim=32", "--seq-len", "16", "--batch-size", "2",
                  "--warmup", "3", "--steps", "2", "--compile-backend", "aot_eager",
                  "--variants", ",".join(SMOKE_VARIANTS))
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = list(tmp_path.iterdir())
    assert len(runs) == 1
    out = runs[0]
    for name in ("results.json", "report.md", "results.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    meta = results["meta"]
    assert meta["world_size"] == 2 and meta["process_group"] == "gloo"
    assert meta["torch"] and meta["model"] == "debug" and meta["model_args"]["dim"] == 32
    rows = {r["name"]: r for r in results["variants"]}
    assert list(rows) == SMOKE_VARIANTS
    for name, row in rows.items():
        assert row["status"] == "ok", f"{name} failed: {row['error']}"
        for key in ("median_step_s", "tokens_per_s", "ratio_vs_fsdp2", "peak_mem_mib",
                    "collectives_per_step", "final_loss", "losses", "step_times_s"):
            assert key in row, (name, key)
        assert len(row["step_times_s"]) == 2 and len(row["losses"]) == 5
        assert row["peak_mem_mib"] > 0
        assert row["compiles_in_measured_steps"] == 0, name
    # Communication shows up where it should, and nowhere else.
    assert rows["compute-only"]["collectives_per_step"] == {}
    assert rows["fsdp2-eager"]["collectives_per_step"].get("all_gather", 0) > 0
    assert rows["simplefsdp-eager"]["collectives_per_step"].get("reduce_scatter", 0) > 0
    assert rows["ddp-replicate"]["collectives_per_step"].get("all_reduce", 0) > 0
    assert rows["torch-ddp"]["collectives_per_step"].get("all_reduce", 0) > 0
    assert "broadcast" not in rows["torch-ddp"]["collectives_per_step"]  # steady state
    assert rows["simplefsdp-reordering"]["compile_s"] is not None
    # Blocked in communication: measured for every communicating variant, never for the
    # compute-only one; the cost model's estimate only for auto.
    assert rows["compute-only"]["comm_blocked_s"] == 0
    for name in ("simplefsdp-eager", "simplefsdp-reordering", "simplefsdp-auto"):
        assert rows[name]["comm_blocked_s"] > 0, name
    auto = rows["simplefsdp-auto"]
    assert auto["estimated_exposed_comm_s"] is not None and auto["estimated_exposed_comm_s"] >= 0
    assert rows["simplefsdp-reordering"]["estimated_exposed_comm_s"] is None
    assert {p["graph"] for p in auto["passes"]} == {"forward", "backward"}
    assert all(p["decisions"] > 0 for p in auto["passes"])  # 1 layer: ~9 params per graph
    report = (out / "report.md").read_text()
    assert "simplefsdp-auto forward" in report and "decisions, estimated exposed" in report
    for name in auto["passes"][0]["bucket_names"]:
        assert name in report
    assert "blocked ms" in proc.stdout and "est. ms" in proc.stdout
    # Same weights, same data: every data-parallel variant trains the same model.
    for name, row in rows.items():
        if row["status"] == "ok" and name != "compute-only":
            assert row["loss_match"], (name, row["max_loss_diff"])
    assert rows["compute-only"]["loss_match"] is None
    assert "simplefsdp-eager" in proc.stdout and "tokens/s" in proc.stdout


def test_unknown_variant_is_a_clear_error(tmp_path):
    proc = _bench(tmp_path, "--variants", "simplefsdp-eager,nope")
    assert proc.returncode == 2
    assert "unknown variant" in proc.stderr and "nope" in proc.stderr


def test_config_validation(tmp_path):
    with pytest.raises(BenchConfigError, match="warmup"):
        BenchConfig(warmup=2).validate()
    with pytest.raises(BenchConfigError, match="max_seq_len"):
        BenchConfig(seq_len=10_000).validate()
    with pytest.raises(BenchConfigError, match="unknown \\[model\\] keys"):
        BenchConfig(model_overrides={"width": 3}).validate()
    path = tmp_path / "bench.toml"
    path.write_text('world_size = 3\nsteps = 4\n[model]\npreset = "debug"\nn_layers = 1\n')
    cfg = load_config(path)
    assert (cfg.world_size, cfg.steps, cfg.model_overrides) == (3, 4, {"n_layers": 1})
    cfg, explicit = build_config(parse_args(["--config", str(path), "--steps", "7",
                                             "--model-arg", "dim=64"]))
    assert explicit and cfg.steps == 7 and cfg.model_overrides == {"n_layers": 1, "dim": 64}
    path.write_text("wold_size = 3\n")
    with pytest.raises(BenchConfigError, match="unknown keys"):
        load_config(path)


def test_world_size_mismatch_under_torchrun(monkeypatch):
    from simplefsdp.bench.launch import run_torchrun

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(BenchConfigError, match="torchrun started 4"):
        run_torchrun(BenchConfig(world_size=2))


class _FailsOnRank1(nn.Module):
    """A model whose forward raises on rank 1 from its second step on."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, tokens):
        import torch.distributed as dist

        self.calls += 1
        if dist.get_rank() == 1 and self.calls >= 2:
            raise RuntimeError("boom on rank 1")
        return self.inner(tokens)


def _run_with_broken_variant(rank, world):
    from simplefsdp.bench import runner, variants

    spec = variants.VariantSpec(
        "broken", "fails on one rank mid-run",
        lambda ctx: variants.Built(_FailsOnRank1(variants.plain_model(ctx))))
    variants.VARIANTS["broken"] = spec
    cfg = BenchConfig(model_overrides={"n_layers": 1, "dim": 32}, seq_len=16, batch_size=2,
                      warmup=3, steps=2, world_size=world,
                      variants=["simplefsdp-eager", "broken", "fsdp2-eager"])
    return runner.run_benchmark(cfg, rank, world, fake=False, local_world=world)


def test_a_variant_failing_on_one_rank_is_dropped_on_all():
    from rank_runner import run_ranks

    raw, other = run_ranks(_run_with_broken_variant, 2)
    assert other is None
    assert raw["failed"] == {"broken": "rank 1: RuntimeError: boom on rank 1"}
    assert set(raw["variants"]) == {"simplefsdp-eager", "fsdp2-eager"}
    assert len(raw["variants"]["fsdp2-eager"]["losses"]) == 5


def test_fake_process_group_mode(tmp_path):
    """One process as 4 ranks (the single-GPU mode, here on CPU): sharding shows in the
    held memory; timings are flagged as not real and losses are not compared."""
    proc = _bench(tmp_path, "--fake-pg", "--world-size", "4", "--model-arg", "n_layers=1",
                  "--model-arg", "dim=32", "--seq-len", "16", "--batch-size", "2",
                  "--steps", "2", "--variants", "simplefsdp-eager,fsdp2-eager,compute-only")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(next(tmp_path.glob("*/results.json")).read_text())
    meta = results["meta"]
    assert meta["fake_pg"] and meta["process_group"] == "fake" and meta["world_size"] == 4
    assert meta["real_figures"] != "all"
    rows = {r["name"]: r for r in results["variants"]}
    assert all(r["status"] == "ok" and r["loss_match"] is None for r in rows.values())
    full = rows["compute-only"]["held_mib"]
    for name in ("simplefsdp-eager", "fsdp2-eager"):  # a quarter of the state, plus buffers
        assert rows[name]["held_mib"] < 0.4 * full, (name, rows[name]["held_mib"], full)


def test_blocked_time_counts_outermost_communication_once():
    from simplefsdp.bench.measure import _blocks, _union_s

    assert _blocks("c10d::_allgather_base_") and _blocks("_c10d_functional::wait_tensor")
    assert _blocks("_c10d_functional::all_gather_into_tensor")
    assert not _blocks("gloo:all_reduce") and not _blocks("aten::mm")
    # a c10d op nested in its functional collective, an overlapping wait, a disjoint one
    spans = [(0, 10_000_000), (2_000_000, 3_000_000), (8_000_000, 12_000_000),
             (20_000_000, 21_000_000)]
    assert _union_s(spans) == 0.013
    assert _union_s([]) == 0
