"""Pipeline parallel composed with tensor + sequence parallel in the trainer.

PP 2 x TP 2 on 4 ranks (one data-parallel rank per stage, so FSDP's collectives are
over a group of one, and every TP/SP activation all-gather and reduce-scatter stays as
traced). The pairwise CI cells of the composition matrix never put pp = 2 with tp = 2
(that needs 8 processes there, with 2 data-parallel ranks).

Two checks share one eager PP 2 x TP 2 run (a tiny Llama: dim 32, 2 layers, one per
stage; 3 steps, 2 sequences of 16 tokens, 2 pipeline microbatches of one sequence):

* eager vs the FSDP reference: 2 ranks, plain FSDP (no PP, no TP), the same global
  batch (1 sequence per rank), the same initial model (built from ``training.seed`` on
  every layout) and the same data order. This is the comparison tests/test_trainer.py's
  ``test_tp_and_pp_match_fsdp`` makes for TP and PP alone, with its tolerances: the math
  is the same but float32 sums are split differently (row-wise TP partial sums, the
  sequence split, per-microbatch gradients summed by the schedule), so 1e-5 relative on
  each step's loss and 1e-4 on each step's gradient norm (float32 rounding is ~1e-7 per
  op; the TP-alone and PP-alone runs measure 0 and 1.2e-7 on the loss), and the
  exported model after the last step within 1e-4 absolute per weight (3 AdamW steps at
  lr 1e-2 move a weight by up to ~3e-2; rounding moves it by ~1e-7). Measured: all
  equal bitwise. A bug at the stage boundary or in the loss/gradient scaling changes
  the losses or the gradient norms by far more. A sequence-parallel norm whose weight
  gradient comes from its own sequence piece only (not summed over TP) moves them by
  just 3e-6 / 4e-5 in 3 AdamW steps (Adam's updates hardly depend on the gradient's
  size), inside those tolerances; the exported weights see it (2.5e-2 on ``ffn_norm``),
  and so does the check that every rank reports the same loss and gradient norm (the
  two TP ranks' copies of the norm drift apart).
* compiled vs eager: each stage compiled on its own with aot_eager and manual
  bucketing. Tolerance: none. aot_eager runs the ops eager runs, bucketing only
  concatenates and slices, and every reduction is over the same ranks in the same
  order, so losses and gradient norms must be equal (``==``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_runner import run_ranks

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def _argv(out: Path, *extra: str, batch_size: int) -> list[str]:
    return ["--config", str(ROOT / "configs/debug.toml"),
            "--training.steps", str(STEPS), "--training.batch_size", str(batch_size),
            "--training.seq_len", "16", "--training.lr", "1e-2",
            "--training.warmup_steps", "1", "--model.dim", "32", "--model.n_layers", "2",
            "--metrics.log_every", "1", "--checkpoint.enable", "false",
            "--metrics.output_dir", str(out), *extra]


PP_TP = ("--parallel.pp", "2", "--parallel.tp", "2", "--parallel.pp_microbatches", "2")


def _trainer(rank: int, world: int, argv: list[str]) -> tuple[list[float], list[float]]:
    from simplefsdp.train.__main__ import main

    result = main(argv)
    return result.losses, result.grad_norms


def _rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> tuple[Path, list]:
    """The eager PP 2 x TP 2 run (4 ranks, 2 sequences per step), with its export."""
    out = tmp_path_factory.mktemp("pp_tp_eager")
    argv = _argv(out, *PP_TP, "--checkpoint.export_safetensors", "true", batch_size=2)
    return out, run_ranks(_trainer, 4, argv)


def test_pp2_tp2_sequence_parallel_eager_matches_fsdp(eager, tmp_path):
    from safetensors.torch import load_file

    out, runs = eager
    # Every rank reports the same all-reduced loss and the same global norm.
    assert all(r == runs[0] for r in runs), runs
    losses, grad_norms = runs[0]
    ref_losses, ref_norms = run_ranks(_trainer, 2, _argv(
        tmp_path, "--checkpoint.export_safetensors", "true", batch_size=1))[0]
    diff = _rel_diff(losses, ref_losses)
    print(f"PP2 x TP2 vs FSDP: losses {losses} vs {ref_losses}, max relative diff "
          f"{diff:.2e}; grad norms {grad_norms} vs {ref_norms}")
    assert diff <= 1e-5
    assert _rel_diff(grad_norms, ref_norms) <= 1e-4
    # The consolidated export (PP stages and TP shards gathered) is the same model.
    mine, theirs = load_file(out / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=0, atol=1e-4, msg=key)


def test_pp2_tp2_sequence_parallel_compiled_matches_eager(eager, tmp_path):
    _, runs = eager
    compiled = run_ranks(_trainer, 4, _argv(
        tmp_path, *PP_TP, "--compile.enable", "true", "--compile.backend", "aot_eager",
        "--compile.bucketing", "manual", batch_size=2))
    assert compiled == runs, (compiled, runs)
