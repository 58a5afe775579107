"""The trainer end to end, on gloo ranks, with a tiny Llama (dim 32, 2 layers, 8 steps).

One reference run (2 ranks, FSDP) is shared: it must lower the loss and write its
metrics and plots, and every other run is compared with its per-step losses.

Tolerances:
* resume (from a copied or a surviving checkpoint): the same ops on the same values
  in the same order, so the losses must be *identical* (``==``).
* TP=2 x DP=2 and PP=2 x DP=2 at 4 ranks, and TP=2 alone at 2 ranks (eager, no
  activation checkpointing), vs FSDP at 2 ranks, same global batch: the
  math is the same but float32 sums are split differently (row-wise TP partial sums,
  per-microbatch gradients under PP), so we allow 1e-5 relative on the loss over
  8 steps: float32 rounding is ~1e-7 per op and 8 AdamW steps at this size stay far
  below 1e-5 (measured: 0 for TP, 1.2e-7 for PP).
* world 2 with 2 grad-accumulation microsteps vs world 1 with one big batch, with an
  uneven number of masked tokens per rank: the token-normalized loss is the same mean,
  summed in a different order, so 1e-6 relative.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch
from rank_runner import run_ranks

from simplefsdp.parallel.tensor import IGNORE_INDEX
from simplefsdp.train.__main__ import main
from simplefsdp.train.checkpoint import list_checkpoints

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

STEPS = 8


def _argv(out: Path, *extra: str, batch_size: int = 4, steps: int = STEPS) -> list[str]:
    return ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
            "--model.n_kv_heads", "2", "--training.seq_len", "32",
            "--training.batch_size", str(batch_size), "--training.steps", str(steps),
            "--training.warmup_steps", "2", "--training.lr", "1e-2",
            "--metrics.log_every", "2", "--metrics.output_dir", str(out),
            "--checkpoint.folder", str(out / "ckpt"), *extra]


def _run(rank: int, world: int, argv: list[str], mask: bool = False) -> dict:
    transform = _mask_some_targets if mask else None
    result = main(argv, batch_transform=transform)
    return {"losses": result.losses, "grad_norms": result.grad_norms,
            "start_step": result.start_step}


def _mask_some_targets(inputs: torch.Tensor, targets: torch.Tensor):
    """Leave out targets that are lowercase vowels: a different count in every sample."""
    vowels = torch.tensor([ord(c) for c in "aeiou"])
    targets = targets.masked_fill(torch.isin(targets, vowels), IGNORE_INDEX)
    return inputs, targets


def _rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    """2 ranks, FSDP, 8 steps, a checkpoint every 4 steps (all kept), export at the end,
    TensorBoard on."""
    out = tmp_path_factory.mktemp("reference")
    argv = _argv(out, "--checkpoint.enable", "true", "--checkpoint.every", "4",
                 "--checkpoint.keep_latest", "0", "--checkpoint.export_safetensors", "true",
                 "--metrics.tensorboard", "true")
    return out, run_ranks(_run, 2, argv)[0]


@pytest.mark.quick
def test_end_to_end_loss_falls_and_writes_metrics(reference):
    out, ref = reference
    losses = ref["losses"]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 0.3, losses
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
    assert all(float(r["tokens_per_s"]) > 0 and float(r["max_rss_gib"]) > 0 for r in rows)
    assert 0 < float(rows[-1]["mfu_pct"]) < 100
    assert (out / "loss.png").stat().st_size > 0 and (out / "memory.png").stat().st_size > 0
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0, events
    assert [s for s, _ in list_checkpoints(out / "ckpt")] == [4, 8]
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert weights["layers.0.attention.wq.weight"].shape == (32, 32)
    assert "tok_embeddings.weight" in weights and "output.weight" in weights


@pytest.mark.quick
def test_resume_reproduces_losses_exactly(reference, tmp_path):
    out, ref = reference
    # A run that stopped after step 4: its folder holds the step-4 checkpoint only.
    shutil.copytree(out / "ckpt" / "step-4", tmp_path / "ckpt" / "step-4")
    resumed = run_ranks(_run, 2, _argv(tmp_path, "--checkpoint.enable", "true",
                                       "--checkpoint.every", "4", "--resume"))[0]
    assert resumed["start_step"] == 4
    assert resumed["losses"] == ref["losses"][4:]
    assert resumed["grad_norms"] == ref["grad_norms"][4:]
    with open(tmp_path / "metrics.csv") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [6, 8]


def test_two_rank_checkpoint_resumes_on_one_rank_with_twice_the_batch(reference, tmp_path):
    """README, "Data at scale": a checkpoint written by 2 data-parallel ranks resumed on 1
    rank with twice the per-rank batch (the same global batch of 8) continues the same
    global sample order: steps 5-8 give the losses and grad norms of an uninterrupted
    1-rank run of batch 8. Not bitwise: the 2-rank run's first 4 steps summed each
    gradient over 2 ranks (another float32 order), so the resumed weights are a few ulps
    off the 1-rank run's; measured 1e-7 relative at most; 1e-5 allowed (another window
    in a batch moves the loss by about 1e-2)."""
    out, ref = reference
    shutil.copytree(out / "ckpt" / "step-4", tmp_path / "resumed" / "ckpt" / "step-4")
    resumed = run_ranks(_run, 1, _argv(tmp_path / "resumed", "--checkpoint.enable", "true",
                                       "--checkpoint.every", "4", "--resume",
                                       batch_size=8))[0]
    alone = run_ranks(_run, 1, _argv(tmp_path / "alone", batch_size=8))[0]
    assert resumed["start_step"] == 4
    print(f"resumed {resumed}, uninterrupted {alone}: losses "
          f"{_rel_diff(resumed['losses'], alone['losses'][4:]):.1e}, grad norms "
          f"{_rel_diff(resumed['grad_norms'], alone['grad_norms'][4:]):.1e} relative")
    assert _rel_diff(resumed["losses"], alone["losses"][4:]) <= 1e-5
    assert _rel_diff(resumed["grad_norms"], alone["grad_norms"][4:]) <= 1e-5
    # the uninterrupted 1-rank run's first 4 steps are the 2-rank run's, within rounding
    assert _rel_diff(alone["losses"][:4], ref["losses"][:4]) <= 1e-5


def _run_in_memory(rank: int, world: int, argv: list[str]) -> dict:
    """``_run`` with the corpus encoded in memory, as before the token cache: the loader
    built over ``TextDataset(source)`` instead of the memory-mapped cache's tokens."""
    from simplefsdp.corpus import setup
    from simplefsdp.corpus.text import TextDataset

    replaced = []

    def in_memory(source, tokenizer, val_fraction, tokens=None):
        replaced.append(type(tokens).__name__)
        return TextDataset(source, tokenizer, val_fraction)

    setup.TextDataset = in_memory
    return {**_run(rank, world, argv), "replaced": replaced}


def test_memory_mapped_cache_and_in_memory_corpus_give_the_same_metrics(reference, tmp_path):
    """README, "Data at scale": the trainer on the memory-mapped token cache (the
    reference run) and on the corpus encoded in memory give bitwise-equal
    ``metrics.csv`` loss, grad norm and LR columns (the others time and measure memory)."""
    out, _ = reference
    run = run_ranks(_run_in_memory, 2, _argv(tmp_path, "--checkpoint.export_safetensors",
                                             "true"))
    assert [r["replaced"] for r in run] == [["memmap"]] * 2  # the mapped cache, replaced

    def columns(folder: Path) -> list[tuple]:
        with open(folder / "metrics.csv") as f:
            return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in csv.DictReader(f)]

    assert columns(tmp_path) == columns(out) and len(columns(out)) == STEPS // 2


def _config_error(rank: int, world: int, argv: list[str]) -> str:
    from simplefsdp.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        main(argv)
    return str(info.value)


def test_existing_checkpoints_without_resume_fail_early(reference):
    """A second run into a folder with complete checkpoints, without --resume, must
    neither mix into nor overwrite the first: every rank stops before building anything
    (metrics.csv and checkpoints untouched) with a message that names both ways out."""
    out, _ = reference
    before = {p: p.stat().st_mtime_ns for p in [out / "metrics.csv", *out.glob("ckpt/*/*")]}
    errors = run_ranks(_config_error, 2, _argv(out, "--checkpoint.enable", "true"))
    assert errors[0] == errors[1]
    assert "step-8" in errors[0] and "--resume" in errors[0], errors[0]
    assert "--checkpoint.folder" in errors[0], errors[0]
    assert {p: p.stat().st_mtime_ns for p in before} == before


def _crash_in_save(rank: int, world: int, argv: list[str]) -> str | None:
    from torch.distributed.checkpoint import filesystem

    original = filesystem.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if "step-4" in str(self.path) and rank == 1:
            raise OSError("disk full (injected by the test)")
        return original(self, plan, planner)

    filesystem.FileSystemWriter.write_data = write_data
    try:
        main(argv)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return repr(e)
    return None


def test_crash_during_save_keeps_previous_checkpoint(reference, tmp_path):
    _, ref = reference
    # --resume on an empty folder starts from step 0 (with a note).
    argv = _argv(tmp_path, "--checkpoint.enable", "true", "--checkpoint.every", "2",
                 "--checkpoint.keep_latest", "2", "--resume")
    errors = run_ranks(_crash_in_save, 2, argv)
    assert all(e is not None and "disk full" in e for e in errors), errors
    ckpt = tmp_path / "ckpt"
    assert [s for s, _ in list_checkpoints(ckpt)] == [2]
    assert not (ckpt / "step-4").exists()
    assert not (ckpt / "step-4.tmp").exists()  # a failed save removes its partial files
    resumed = run_ranks(_run, 2, argv)[0]
    assert resumed["start_step"] == 2
    assert resumed["losses"] == ref["losses"][2:]
    assert [s for s, _ in list_checkpoints(ckpt)] == [6, 8]  # keep_latest = 2


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_tp_and_pp_match_fsdp(reference, tmp_path, layout):
    out, ref = reference
    extra = {
        # The layouts cover both AC modes; test_eager_tp_without_checkpointing, none.
        "tp": ["--parallel.tp", "2", "--activation_checkpoint.mode", "full"],
        "pp": ["--parallel.pp", "2", "--parallel.pp_microbatches", "2",
               "--activation_checkpoint.mode", "selective"],
    }[layout]
    got = run_ranks(_run, 4, _argv(tmp_path, "--checkpoint.export_safetensors", "true",
                                   *extra))[0]
    diff = _rel_diff(got["losses"], ref["losses"])
    print(f"{layout}: max relative loss diff vs FSDP over {STEPS} steps: {diff:.2e}")
    assert diff <= 1e-5
    assert _rel_diff(got["grad_norms"], ref["grad_norms"]) <= 1e-4
    # The consolidated export (TP shards / PP stages gathered) is the same model.
    from safetensors.torch import load_file

    mine, theirs = load_file(tmp_path / "model.safetensors"), load_file(out / "model.safetensors")
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=0, atol=1e-4, msg=key)


@pytest.mark.parametrize("layout", ["hsdp", "replicate"])
def test_hsdp_and_replicate_match_fsdp(reference, tmp_path, layout):
    """HSDP 2 x 2 (4 ranks, 2 sequences each) and replicate (2 ranks, 4 each) on the
    reference's global batch of 8 sequences: the same losses and gradient norms. A
    gradient norm summed over the replicas reads sqrt(2) times the reference's and,
    clipped at max_norm 1, changes the losses from step 2 on.

    4 steps, compared with the reference's first 4: with 2 warmup steps the first 3
    optimizer steps' LR factors (1/3, 2/3, 1) do not depend on training.steps, and the
    4th step's loss and norm come before its update. Tolerance 2e-6 relative: the
    gradients are the same sums split differently (per rank 2 or 4 sequences, one
    reduce-scatter + all-reduce or one all-reduce), float32 rounding ~1e-7 per op
    (measured over 8 steps: HSDP loss 1.1e-7, norm 8.7e-8; replicate loss 0, norm
    1.7e-7)."""
    _, ref = reference
    world, batch, extra = {
        "hsdp": (4, 2, ["--parallel.dp_mode", "hybrid_shard", "--parallel.dp_replicate", "2",
                        "--parallel.dp_shard", "2"]),
        "replicate": (2, 4, ["--parallel.dp_mode", "replicate", "--parallel.dp_replicate", "2",
                             "--parallel.dp_shard", "1"]),
    }[layout]
    steps = 4
    got = run_ranks(_run, world, _argv(tmp_path, *extra, batch_size=batch, steps=steps))[0]
    loss_diff = _rel_diff(got["losses"], ref["losses"][:steps])
    norm_diff = _rel_diff(got["grad_norms"], ref["grad_norms"][:steps])
    print(f"{layout}: max relative diff vs FSDP over {steps} steps: loss {loss_diff:.2e}, "
          f"grad norm {norm_diff:.2e}; grad norms {got['grad_norms']}")
    assert loss_diff <= 2e-6
    assert norm_diff <= 2e-6


def test_eager_tp_without_checkpointing(reference, tmp_path):
    """TP=2 on 2 ranks (one DP rank with the whole global batch of 8 sequences), eager,
    no activation checkpointing: autograd saves the TP layers' DTensors through
    eager_reshard's saved-tensor hook. It must train like the FSDP reference."""
    _, ref = reference
    got = run_ranks(_run, 2, _argv(tmp_path, "--parallel.tp", "2",
                                   "--activation_checkpoint.mode", "none", batch_size=8))[0]
    diff = _rel_diff(got["losses"], ref["losses"])
    print(f"eager TP, no AC: max relative loss diff vs FSDP over {STEPS} steps: {diff:.2e}")
    assert diff <= 1e-5
    assert _rel_diff(got["grad_norms"], ref["grad_norms"]) <= 1e-4


def test_token_normalized_loss_matches_single_process(tmp_path):
    # Same global batch of 8 sequences: world 1 in one microstep; world 2 as 2 ranks x
    # 2 microsteps x 2 sequences. Masked targets make every rank's token count differ.
    single = run_ranks(_run, 1, _argv(tmp_path / "w1", batch_size=8), True)[0]
    split = run_ranks(_run, 2, _argv(tmp_path / "w2", "--training.grad_accum_steps", "2",
                                     batch_size=2), True)[0]
    diff = _rel_diff(split["losses"], single["losses"])
    print(f"world 2 x accum 2 vs world 1: max relative loss diff {diff:.2e}")
    assert diff <= 1e-6


class _FoldedBytes:
    """A user tokenizer: bytes folded onto 64 ids (what the trainer's hook accepts)."""

    vocab_size = 64

    def encode(self, text: str) -> list[int]:
        return [b % 64 for b in text.encode("utf-8")]


def _custom_tokenizer(rank: int, world: int, argv: list[str]) -> tuple[list[float], str]:
    from simplefsdp.errors import ConfigError

    with pytest.raises(ConfigError) as info:  # the byte tokenizer does not fit 64 ids
        main(argv)
    return main(argv, tokenizer=_FoldedBytes()).losses, str(info.value)


def test_user_tokenizer_hook(tmp_path):
    losses, refused = run_ranks(_custom_tokenizer, 1, _argv(tmp_path, "--model.vocab_size",
                                                            "64"))[0]
    assert "256 tokens but model.vocab_size = 64" in refused, refused
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.3, losses
