"""``[validation]``: the held-out loss, on gloo ranks, against one process written here.

The reference shares nothing with ``train/validation.py``: it reads the shipped corpus's
bytes (the byte tokenizer's tokens), takes the tail the data module holds out (the last
``int(n * 0.05)`` tokens), cuts it into ``seq_len + 1``-token windows at multiples of
``seq_len``, and evaluates the first ``validation.steps`` global batches of them with one
``F.cross_entropy(reduction="mean")`` on a plain ``Transformer`` holding the weights the
run exported at its last step (the step that also evaluated).

Tolerances:
* val_loss against the reference: 1e-6 relative. The same token losses, summed per
  rank (and pipeline stage) and over ranks instead of in one mean over one forward:
  float32 sums in another order, about 1e-7.
* training losses and gradient norms with and without validation: bitwise (``==``).
  An evaluation changes nothing training reads (data order, RNG, weights, the MoE
  experts' load counters that the bias update reads), so every step's floats repeat.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rank_runner import run_ranks

from simplefsdp.config.job import load_config
from simplefsdp.errors import ConfigError

STEPS, EVERY, VAL_STEPS, SEQ_LEN, BATCH = 4, 2, 2, 32, 4


def _argv(out: Path, *extra: str) -> list[str]:
    return ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
            "--model.n_kv_heads", "2", "--training.seq_len", str(SEQ_LEN),
            "--training.batch_size", str(BATCH), "--training.steps", str(STEPS),
            "--training.warmup_steps", "1", "--training.lr", "1e-2",
            "--metrics.log_every", "3", "--metrics.output_dir", str(out), *extra]


def _validating(out: Path, *extra: str) -> list[str]:
    return _argv(out, "--validation.enable", "true", "--validation.every", str(EVERY),
                 "--validation.steps", str(VAL_STEPS), *extra)


def _train(rank: int, world: int, argv: list[str]) -> dict:
    from simplefsdp.train.__main__ import main

    result = main(argv)
    return {"losses": result.losses, "grad_norms": result.grad_norms,
            "val_losses": result.val_losses}


def _reference_val_loss(weights: Path, global_batch: int) -> float:
    """The held-out loss by hand (module docstring) of the exported weights."""
    from safetensors.torch import load_file

    from simplefsdp.models.llama import LLAMA3_PRESETS, Transformer

    text = (resources.files("simplefsdp") / "data" / "shakespeare.txt").read_bytes()
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    tail = tokens[len(tokens) - int(len(tokens) * 0.05):]
    windows = tail.unfold(0, SEQ_LEN + 1, SEQ_LEN)[:VAL_STEPS * global_batch]
    assert len(windows) == VAL_STEPS * global_batch
    args = dataclasses.replace(LLAMA3_PRESETS["debug"], dim=32, n_layers=2, n_heads=4,
                               n_kv_heads=2)
    model = Transformer(args)
    model.load_state_dict(load_file(weights), strict=False)  # buffers: RoPE, rebuilt
    assert set(load_file(weights)) == {k for k, _ in model.named_parameters()}
    with torch.no_grad():
        logits = model(windows[:, :-1])
    return float(F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()))


LAYOUTS = {"fsdp": [], "pp": ["--parallel.pp", "2", "--parallel.pp_microbatches", "2"]}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """The 2-rank FSDP run with validation, shared by the two tests that read it."""
    out = tmp_path_factory.mktemp("fsdp")
    argv = _validating(out, "--checkpoint.export_safetensors", "true")
    return out, run_ranks(_train, 2, argv)


@pytest.mark.parametrize("layout", ["fsdp", "pp"])
def test_val_loss_matches_one_process(tmp_path, fsdp_run, layout):
    """2 ranks: FSDP (2 data-parallel ranks, global batch 8) or 2 pipeline stages
    (forward-only schedule, 2 microbatches; global batch 4)."""
    if layout == "fsdp":
        tmp_path, got = fsdp_run
    else:
        argv = _validating(tmp_path, "--checkpoint.export_safetensors", "true",
                           *LAYOUTS[layout])
        got = run_ranks(_train, 2, argv)
    assert got[0]["val_losses"] == got[1]["val_losses"]  # every rank has the value
    val = got[0]["val_losses"]
    assert sorted(val) == [2, 4]
    expected = _reference_val_loss(tmp_path / "model.safetensors",
                                   BATCH * (2 if layout == "fsdp" else 1))
    rel = abs(val[STEPS] - expected) / expected
    print(f"{layout}: val_loss {val[STEPS]:.8f}, one process {expected:.8f}, rel {rel:.1e}")
    assert rel <= 1e-6
    assert val[2] != val[4]  # the weights moved between evaluations
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    # a row at each evaluation (steps 2 and 4) and at log_every (3); val columns there only
    assert [r["step"] for r in rows] == ["2", "3", "4"]
    assert [r["val_loss"] for r in rows] == [repr(val[2]), "", repr(val[4])]
    assert float(rows[2]["val_ppl"]) == pytest.approx(math.exp(val[4]), rel=1e-12)


MOE_BIAS = ["--model.name", "debug_moe", "--model.num_experts", "4",
            "--model.moe_hidden_dim", "32", "--model.load_balance", "bias",
            "--parallel.ep", "2"]


@pytest.mark.parametrize("model", ["llama", "moe_bias"])
def test_training_bitwise_unchanged_by_validation(tmp_path, fsdp_run, model):
    """With and without validation, the same losses and gradient norms, bitwise. The
    MoE with bias balancing (EP 2) moves its router bias by the loads it counts, so
    held-out tokens counted as a step's load would change the next steps."""
    extra = MOE_BIAS if model == "moe_bias" else []
    plain = run_ranks(_train, 2, _argv(tmp_path / "off", *extra))[0]
    if model == "llama":
        validating = fsdp_run[1][0]
    else:
        validating = run_ranks(_train, 2, _validating(tmp_path / "on", *extra))[0]
    assert sorted(validating["val_losses"]) == [2, 4]
    assert validating["losses"] == plain["losses"]
    assert validating["grad_norms"] == plain["grad_norms"]


def _start_error(rank: int, world: int, argv: list[str]) -> str:
    from simplefsdp.train.__main__ import main

    try:
        main(argv)
    except ConfigError as e:
        return str(e)
    return "no error"


def test_too_small_a_held_out_split_fails_at_start(tmp_path):
    """A corpus whose 5% tail holds fewer windows than one global batch (or than
    validation.steps asks) is refused before step 1, naming the keys."""
    corpus = tmp_path / "small.txt"
    corpus.write_text("All the world's a stage, and all the men and women players. " * 60)
    small = ["--data.dataset", str(corpus), "--data.cache_dir", str(tmp_path / "cache")]
    # 3600 bytes: a held-out tail of 180 bytes, 5 windows of 33 < one global batch of 8
    errors = run_ranks(_start_error, 2, _validating(tmp_path / "a", *small))
    assert errors[0] == errors[1]
    assert "validation.enable = true" in errors[0] and "5 windows" in errors[0]
    assert "fewer than one global batch of 8" in errors[0]
    # the shipped corpus: 1382 held-out windows of 33, 345 global batches of 4 (1 rank)
    errors = run_ranks(_start_error, 1, _argv(tmp_path / "b", "--validation.enable", "true",
                                              "--validation.steps", "500"))
    assert "validation.steps = 500" in errors[0] and "holds 345 global batches" in errors[0]
    assert not (tmp_path / "b" / "metrics.csv").exists()  # refused before the first row


@pytest.mark.parametrize("flags, message", [
    (["--validation.every", "0"], r"validation\.every = 0 is out of range"),
    (["--validation.steps", "0"], r"validation\.steps = 0 is out of range"),
    (["--validation.enable", "true", "--data.streaming", "true"],
     r"validation\.enable = true needs the held-out split.*data\.streaming = true"),
    (["--training.beta2", "1.0"], r"training\.beta2 = 1\.0 is out of range"),
    (["--training.eps", "0"], r"training\.eps = 0\.0 is out of range"),
])
def test_bad_validation_and_optimizer_keys_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, flags)
