"""Pipeline parallel composed with tensor + sequence parallel in the trainer, compiled.

PP 2 x TP 2 on 4 ranks (one data-parallel rank per stage, so FSDP's collectives are
over a group of one, and every TP/SP activation all-gather and reduce-scatter stays as
traced): each stage is compiled on its own with aot_eager and manual bucketing. The
pairwise CI cells of the composition matrix never put pp = 2 with tp = 2 (that needs
8 processes there, with 2 data-parallel ranks).

Tolerance: none. aot_eager runs the ops eager runs, bucketing only concatenates and
slices, and every reduction is over the same ranks in the same order, so losses and
gradient norms must be equal (``==``).
"""

from __future__ import annotations

from pathlib import Path

from rank_runner import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _trainer(rank: int, world: int, argv: list[str]) -> tuple[list[float], list[float]]:
    from simplefsdp.train.trainer import main

    result = main(argv)
    return result.losses, result.grad_norms


def test_pp2_tp2_sequence_parallel_compiled_matches_eager(tmp_path):
    base = ["--config", str(ROOT / "configs/debug.toml"), "--parallel.pp", "2",
            "--parallel.tp", "2", "--parallel.pp_microbatches", "2",
            "--training.steps", "2", "--training.batch_size", "2",
            "--training.seq_len", "16", "--model.dim", "32", "--model.n_layers", "2",
            "--metrics.log_every", "1", "--checkpoint.enable", "false"]
    runs = {}
    for name, extra in (("eager", []), ("compiled", [
            "--compile.enable", "true", "--compile.backend", "aot_eager",
            "--compile.bucketing", "manual"])):
        argv = base + extra + ["--metrics.output_dir", str(tmp_path / name)]
        runs[name] = run_ranks(_trainer, 4, argv)
    eager, compiled = runs["eager"], runs["compiled"]
    losses = eager[-1][0]  # the last stage computes the loss
    assert len(losses) == 2 and all(loss > 0 for loss in losses), eager
    assert compiled == eager, runs
