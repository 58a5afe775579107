"""Loss parallel (issue 27): with ``parallel.tp > 1`` the output projection's logits stay
split over the vocabulary on the TP ranks and the cross-entropy runs over the pieces
(torch's ``loss_parallel``), instead of every TP rank holding the whole-vocabulary logits.

The reference is the same trainer with ``parallel.loss_parallel = false`` (logits
gathered, the plain float32 cross-entropy) on the same 2 gloo ranks, global batch, seed
and masked targets; the text is relabelled so that kept and ignored targets fall in both
TP ranks' vocabulary halves (the shipped text is ASCII: all in rank 0's half otherwise).
``test_loss_parallel_matches_one_process_cross_entropy`` checks the loss and each
shard's logit gradients against one process's ``F.cross_entropy``, also on a vocabulary
that does not split evenly. The math is the same; the log-sum-exp is summed in a different
order (each rank's vocabulary half, then an all-reduce of the maxima, the sums of
exponentials and the target logits), so the losses agree to float32 rounding (~1e-7
relative per op). Tolerances: losses 1e-6 relative over 3 steps; parameters after 3
AdamW steps 1e-5 absolute at lr 1e-2: Adam divides each gradient by its own running
magnitude, so a rounding-level gradient difference becomes at most a rounding-level
fraction of lr per step (measured: see the assertion messages' printout).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_runner import run_ranks
from toy import VOCAB_SPLIT, relabel_odd_bytes

from simplefsdp.parallel.tensor import IGNORE_INDEX
from simplefsdp.train.__main__ import main

STEPS = 3


def _argv(out: Path, *extra: str) -> list[str]:
    return ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
            "--model.n_kv_heads", "2", "--training.seq_len", "32",
            "--training.batch_size", "8", "--training.steps", str(STEPS),
            "--training.warmup_steps", "1", "--training.lr", "1e-2",
            "--metrics.log_every", "1", "--metrics.output_dir", str(out),
            "--checkpoint.folder", str(out / "ckpt"), "--checkpoint.export_safetensors",
            "true", "--parallel.tp", "2", *extra]


# Ignored targets on both vocabulary halves (after ``relabel_odd_bytes``): the vowels
# (odd bytes: ids 128 and up) and the space and newline (even: below 128).
MASKED = "aeiouAEIOU \n"


def _mask_on_both_halves(inputs: torch.Tensor, targets: torch.Tensor):
    """The text relabelled so that the targets fall on both TP ranks' vocabulary halves
    (``toy.relabel_odd_bytes``), then the targets in ``MASKED`` ignored (``IGNORE_INDEX``).
    Asserts that each half holds kept targets and ignored ones."""
    inputs, targets = relabel_odd_bytes(inputs, targets)
    _, masked_ids = relabel_odd_bytes(*[torch.tensor([ord(c) for c in MASKED])] * 2)
    masked = torch.isin(targets, masked_ids)
    upper = targets >= VOCAB_SPLIT
    for half in (upper, ~upper):
        assert (half & masked).any() and (half & ~masked).any(), targets
    return inputs, targets.masked_fill(masked, IGNORE_INDEX)


def _train_each(rank: int, world: int, runs: dict[str, list[str]]) -> dict[str, list[float]]:
    """Every run's losses, one run after the other on the same 2 ranks (each run builds
    its own model and seeds itself; one group of processes for the three)."""
    return {name: main(argv, batch_transform=_mask_on_both_halves).losses
            for name, argv in runs.items()}


def _logits(rank: int, world: int) -> list[tuple]:
    """The logits the TP model returns, with and without loss parallel: their type,
    placements and local shape."""
    import simplefsdp
    from simplefsdp.config.job import load_config
    from simplefsdp.models.llama_family import build_model

    found = []
    for flag in ("true", "false"):
        cfg = load_config(None, ["--parallel.tp", "2", "--parallel.loss_parallel", flag,
                                 "--training.seq_len", "16"])
        p = cfg.parallel.resolve(world)
        mesh = simplefsdp.make_mesh(dp_shard=p.dp_shard, tp=p.tp, device_type="cpu")
        runnable, _ = build_model(cfg, mesh, p.dims(), torch.device("cpu"))
        out = runnable(torch.zeros(2, 16, dtype=torch.long))
        placements = [(type(x).__name__, getattr(x, "dim", None))
                      for x in getattr(out, "placements", ())]
        local = out.to_local() if hasattr(out, "to_local") else out
        found.append((type(out).__name__, placements, tuple(local.shape)))
    return found


def test_logits_stay_vocabulary_sharded():
    """debug Llama (vocabulary 256) on tp 2: 128 columns per rank as a Shard(2) DTensor
    with loss parallel; the whole 256 on each rank, a plain tensor, without."""
    for sharded, whole in run_ranks(_logits, 2):
        assert sharded == ("DTensor", [("Shard", 2)], (2, 16, 128)), sharded
        assert whole == ("Tensor", [], (2, 16, 256)), whole


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[dict[str, list[float]], dict[str, Path]]:
    """The reference, TP 2 without loss parallel (logits gathered, eager), and loss
    parallel eager and compiled (aot_eager): rank 0's losses and each run's folder."""
    outs = {name: tmp_path_factory.mktemp(name) for name in ("gathered", "false", "true")}
    runs = {"gathered": _argv(outs["gathered"], "--parallel.loss_parallel", "false")}
    runs.update({compiled: _argv(outs[compiled], "--compile.enable", compiled,
                                 "--compile.backend", "aot_eager")
                 for compiled in ("false", "true")})
    return run_ranks(_train_each, 2, runs)[0], outs


@pytest.mark.parametrize("compiled", ["false", "true"])
def test_loss_parallel_trains_as_gathered_logits(trained, compiled):
    """Loss parallel, eager and compiled (aot_eager, manual buckets), against the
    eager reference without it. Measured: losses 1.9e-7 relative, parameters 3.7e-7
    absolute, both eager and compiled (aot_eager runs eager's ops)."""
    losses, outs = trained
    off, out_off, on, tmp_path = losses["gathered"], outs["gathered"], losses[compiled], \
        outs[compiled]
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(on, off, strict=True))
    from safetensors.torch import load_file

    mine = load_file(tmp_path / "model.safetensors")
    theirs = load_file(out_off / "model.safetensors")
    assert mine.keys() == theirs.keys()
    param_diff = max(float((mine[k] - theirs[k]).abs().max()) for k in theirs)
    print(f"compiled={compiled}: losses {on} vs {off}: max relative diff {loss_diff:.2e}; "
          f"parameters max abs diff {param_diff:.2e}")
    assert len(on) == STEPS and loss_diff <= 1e-6, (on, off)
    assert param_diff <= 1e-5


# Issue 27's 70B layout (torchtitan ran it on 80-96 GB H100s): FSDP 32 x TP 8 on 256
# GPUs, full AC, batch 16 x 8192, compiled, bf16.
LLAMA_70B = ["--parallel.dp_shard", "32", "--parallel.tp", "8", "--activation_checkpoint.mode",
             "full", "--training.batch_size", "16", "--training.seq_len", "8192",
             "--compile.enable", "true", "--compile.bucketing", "manual",
             "--training.mixed_precision_param", "bfloat16"]


def test_planner_counts_an_eighth_of_the_logits_on_70b(planner):
    """The planner's loss term under loss parallel. Its active peak is the backward's
    loss peak: the saved block inputs plus the eager float32 cross-entropy's 16 B per
    logit under loss parallel (the saved log_softmax, and torch's DTensor handler's
    zeros, exp and product; ``plan.memory.loss_peaks``, counted op by op in
    ``tests/test_plan.py::test_loss_time_peak_by_hand``), each TP rank holding 16 x 8192
    tokens x 128,256 / 8 = 16,032 logits each: 16 x 131,072 x 16,032 B = 31.31 GiB by
    hand (without loss parallel all 128,256 at 12 B: 187.9 GiB, and 215 GiB active: it
    did not fit). The layout fits the 96 GB H100 (58.79 GiB active), as torchtitan ran
    it (71.9 GiB, with Float8)."""
    from simplefsdp.config.job import load_config
    from simplefsdp.plan import predict

    r = planner(predict, load_config("configs/llama3_70b.toml", LLAMA_70B), 256, "h100-96gb")
    full = r.detail["full"]
    print(f"70B: {r.peak_memory_gib:.2f} GiB active, {r.reserved_memory_gib:.2f} reserved, "
          f"{r.tokens_per_s_per_gpu:.0f} tok/s; {full}")
    loss = 16 * 16 * 8192 * 128_256 // 8 / 2**30
    # the same float sums in another order: 1e-9 relative
    assert full["activations_gib"] - full["saved_per_microbatch_gib"] \
        == pytest.approx(loss, rel=1e-9)
    assert r.fits


def _sharded_loss_and_grads(rank: int, world: int, vocab: int) -> dict:
    """The trainer's loss (``token_loss_sum`` under ``loss_context(True)``) on logits
    split over the vocabulary on ``world`` ranks as torch splits a ``Shard(2)`` DTensor
    (uneven: the first ranks one column more), against one process's ``F.cross_entropy``
    on the whole logits: this rank's loss and its shard's logit gradients."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from simplefsdp.parallel.tensor import loss_context, token_loss_sum

    torch.manual_seed(0)  # the same logits and targets on every rank
    logits = torch.randn(2, 16, vocab) * 3
    targets = torch.randint(0, vocab, (2, 16))
    sizes = [len(c) for c in torch.arange(vocab).chunk(world)]  # torch's Shard split
    starts = [sum(sizes[:r]) for r in range(world + 1)]
    owner = torch.bucketize(targets, torch.tensor(starts[1:]), right=True)
    # Every shard owns kept and ignored targets: position 2r (kept) and 2r + 1 (ignored)
    # of sequence 0 take a target id from shard r; then a random quarter ignored too.
    for r in range(world):
        targets[0, 2 * r:2 * r + 2] = starts[r] + torch.arange(2) % sizes[r]
        owner[0, 2 * r:2 * r + 2] = r
    ignored = torch.rand(2, 16) < 0.25
    ignored[0, :2 * world] = torch.arange(2 * world) % 2 == 1
    for r in range(world):
        assert ((owner == r) & ignored).any() and ((owner == r) & ~ignored).any()
    targets = targets.masked_fill(ignored, IGNORE_INDEX)

    whole = logits.clone().requires_grad_()
    want = F.cross_entropy(whole.flatten(0, 1), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)
    want.backward()
    mesh = init_device_mesh("cpu", (world,))
    local = logits[..., starts[rank]:starts[rank + 1]].clone().requires_grad_()
    sharded = DTensor.from_local(local, mesh, [Shard(2)], shape=logits.shape,
                                 stride=logits.stride())
    with loss_context(True):
        got = token_loss_sum(sharded, targets)
        got.backward()
    return {"loss": (float(got), float(want)), "columns": local.shape[-1],
            "grad_diff": float((local.grad - whole.grad[..., starts[rank]:starts[rank + 1]])
                               .abs().max()),
            "ignored_grad": float(local.grad[ignored].abs().max())}


@pytest.mark.parametrize("vocab", [256, 321])
def test_loss_parallel_matches_one_process_cross_entropy(vocab):
    """Loss parallel's cross-entropy on 2 gloo ranks, each holding its vocabulary shard
    (256: 128 + 128; 321: 161 + 160, torch's uneven ``Shard`` split), with kept and
    ignored targets owned by each shard, against ``F.cross_entropy`` in one process: the
    summed loss within 1e-6 relative (float32, the log-sum-exp reduced over the ranks in
    another order: ~1e-7 per op) and each shard's logit gradients within 1e-6 absolute
    (softmax probabilities below 1, minus the one-hot: rounding ~1e-7), the ignored
    positions' exactly zero. The trainer refuses a vocabulary TP does not divide (its
    embedding and output projection, not the loss): a ConfigError naming both keys."""
    from simplefsdp.errors import ConfigError
    from simplefsdp.models.llama import ModelArgs
    from simplefsdp.parallel.tensor import check_sequence_parallel

    results = run_ranks(_sharded_loss_and_grads, 2, vocab)
    assert [r["columns"] for r in results] == ([128, 128] if vocab == 256 else [161, 160])
    for r in results:
        got, want = r["loss"]
        assert got == pytest.approx(want, rel=1e-6), r
        assert r["grad_diff"] <= 1e-6 and r["ignored_grad"] == 0, r
    if vocab % 2:
        args = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=vocab)
        with pytest.raises(ConfigError, match="parallel.tp = 2 does not divide "
                                              "model.vocab_size = 321"):
            check_sequence_parallel(args, 2)
