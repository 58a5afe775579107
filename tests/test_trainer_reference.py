"""The trainer's own loop against a plain PyTorch loop written here, on one process.

Nothing in the reference comes from the trainer: the model is built from
``simplefsdp.models.llama`` (meta, ``to_empty``, ``init_weights`` after
``torch.manual_seed(training.seed)``, as ``Transformer.init_weights`` documents), the
optimizer is ``torch.optim.AdamW`` with the trainer's hyper-parameters (``training.lr``,
``training.weight_decay``, ``training.beta1/beta2/eps``: set here away from their defaults,
so that a trainer ignoring them shows), the
clipping is ``torch.nn.utils.clip_grad_norm_``, the learning-rate factors are written
out by hand below, and the loss is README's "sum over tokens divided by the global
number of valid tokens", accumulated over the step's microsteps. The data are the
windows the trainer read, recorded through its ``batch_transform`` hook, and checked to
be distinct ``seq_len + 1``-byte windows of the corpus at multiples of ``seq_len``.

The step has 2 gradient-accumulation microsteps with a different number of masked
targets each, so a per-microstep mean differs from the step's token mean; ``max_norm``
is low enough that clipping acts on every step (checked).

Tolerances:
* losses, gradient norms and the final parameters (the trainer's safetensors export):
  bitwise. On one rank the trainer runs the same float32 ops in the same order as the
  plain loop (measured: identical), so any change of schedule, clipping, weight decay
  or normalization shows.
* the ``lr`` column of ``metrics.csv`` (a row per step) against the hand-written factors:
  1e-12 relative (a float through the CSV's text).
* each step's loss against its definition computed independently, one
  ``F.cross_entropy(reduction="mean")`` over the step's whole batch in one forward:
  1e-6 relative (one forward over 4 sequences and one mean, against two forwards and
  sum / count: float32 sums split differently, ~1e-7 per op).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from rank_runner import run_ranks

STEPS, WARMUP, LR, WEIGHT_DECAY, MAX_NORM, SEED = 5, 2, 1e-2, 0.1, 0.25, 3
BETAS, EPS = (0.8, 0.99), 1e-6  # not the defaults (0.9, 0.95), 1e-8
SEQ_LEN, BATCH, ACCUM = 32, 2, 2

# The LR factor of optimizer step k = 1..5 (the trainer's documented schedule: linear
# warmup over warmup_steps = 2 steps, (i + 1) / (warmup + 1) for the i-th step from 0,
# then cosine decay from 1 to 0.1 reached at training.steps, progress (i - 2) / (5 - 2)):
#   1/3, 2/3, cos(0) -> 1, 0.1 + 0.45 * (1 + cos(pi/3)) = 0.775, 0.1 + 0.45 * 0.5 = 0.325.
LR_FACTORS = [1 / 3, 2 / 3, 1.0, 0.775, 0.325]


def _argv(out: Path) -> list[str]:
    return ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
            "--model.n_kv_heads", "2", "--training.seq_len", str(SEQ_LEN),
            "--training.batch_size", str(BATCH), "--training.grad_accum_steps", str(ACCUM),
            "--training.steps", str(STEPS), "--training.warmup_steps", str(WARMUP),
            "--training.lr", str(LR), "--training.weight_decay", str(WEIGHT_DECAY),
            "--training.max_norm", str(MAX_NORM), "--training.seed", str(SEED),
            "--training.beta1", str(BETAS[0]), "--training.beta2", str(BETAS[1]),
            "--training.eps", str(EPS),
            "--metrics.log_every", "1", "--metrics.output_dir", str(out),
            "--checkpoint.export_safetensors", "true"]


def _mask_vowels(targets: torch.Tensor) -> torch.Tensor:
    """Leave out targets that are lowercase vowels: a different count in every sample."""
    vowels = torch.tensor([ord(c) for c in "aeiou"])
    return targets.masked_fill(torch.isin(targets, vowels), -100)


def _plain_loop(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The same training written with plain PyTorch: one step per ACCUM recorded
    microbatches; also each step's loss as one mean over the step's whole batch."""
    import torch.nn.functional as F

    from simplefsdp.models.llama import LLAMA3_PRESETS, Transformer

    args = dataclasses.replace(LLAMA3_PRESETS["debug"], dim=32, n_layers=2, n_heads=4,
                               n_kv_heads=2)
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY, foreach=True)
    losses, means, norms = [], [], []
    for step in range(STEPS):
        step_batches = batches[step * ACCUM:(step + 1) * ACCUM]
        step_batches = [(i, _mask_vowels(t)) for i, t in step_batches]
        with torch.no_grad():  # the step's loss by definition: one mean over its batch
            logits = model(torch.cat([i for i, _ in step_batches]))
            targets = torch.cat([t for _, t in step_batches])
            means.append(float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                               ignore_index=-100)))
        # The same mean, accumulated over the microsteps as README's definition says:
        # the token losses' sum divided by the step's valid-token count.
        n_tokens = sum(int((t != -100).sum()) for _, t in step_batches)
        loss = torch.zeros(())
        for i, t in step_batches:
            part = F.cross_entropy(model(i).flatten(0, 1), t.flatten(), ignore_index=-100,
                                   reduction="sum") / n_tokens
            part.backward()
            loss += part.detach()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        for group in opt.param_groups:
            group["lr"] = LR * LR_FACTORS[step]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    # numpy arrays: pickled by value (a tensor through the queue needs its sender alive)
    params = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}
    return {"losses": losses, "means": means, "grad_norms": norms, "params": params}


def _trainer_and_plain(rank: int, world: int, out: Path) -> dict:
    from simplefsdp.train.__main__ import main

    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(inputs: torch.Tensor, targets: torch.Tensor):
        recorded.append((inputs.clone(), targets.clone()))
        return inputs, _mask_vowels(targets)

    result = main(_argv(out), batch_transform=record)
    return {"trainer": {"losses": result.losses, "grad_norms": result.grad_norms},
            "plain": _plain_loop(recorded),
            "batches": [(i.numpy(), t.numpy()) for i, t in recorded]}


def _check_windows(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every recorded sequence is (window[:-1], window[1:]) of a distinct corpus window
    of seq_len + 1 bytes starting at a multiple of seq_len."""
    from importlib import resources

    text = (resources.files("simplefsdp") / "data" / "shakespeare.txt").read_bytes()
    windows = torch.frombuffer(bytearray(text), dtype=torch.uint8).long().unfold(
        0, SEQ_LEN + 1, SEQ_LEN)  # row w: bytes w * seq_len .. w * seq_len + seq_len
    starts = set()
    for inputs, targets in batches:
        inputs, targets = torch.from_numpy(inputs), torch.from_numpy(targets)
        for row_in, row_tgt in zip(inputs, targets, strict=True):
            assert torch.equal(row_tgt[:-1], row_in[1:])
            window = torch.cat([row_in, row_tgt[-1:]])
            hits = (windows == window).all(dim=1).nonzero().flatten().tolist()
            assert hits, "a sequence that is not a corpus window"
            starts.add(hits[0])
    assert len(starts) == STEPS * ACCUM * BATCH  # no window twice within the run


def test_trainer_loop_matches_plain_pytorch_loop(tmp_path):
    got = run_ranks(_trainer_and_plain, 1, tmp_path)[0]
    trainer, plain = got["trainer"], got["plain"]
    assert len(got["batches"]) == STEPS * ACCUM
    _check_windows(got["batches"])
    assert all(n > MAX_NORM for n in plain["grad_norms"]), plain["grad_norms"]  # clipped
    from safetensors.torch import load_file

    final = load_file(tmp_path / "model.safetensors")
    assert final.keys() == plain["params"].keys()
    mean_diff = max(abs(a - b) / b for a, b in zip(trainer["losses"], plain["means"],
                                                   strict=True))
    print(f"trainer vs plain loop over {STEPS} steps: losses {trainer['losses']}, "
          f"plain {plain['losses']}; max relative diff to the one-forward mean "
          f"{mean_diff:.2e}")
    assert trainer["losses"] == plain["losses"]
    assert trainer["grad_norms"] == plain["grad_norms"]
    for key, value in plain["params"].items():
        assert torch.equal(final[key], torch.from_numpy(value)), key
    assert mean_diff <= 1e-6
    # metrics.csv (a row per step): each row's lr is the one its step's update used (the
    # plain loop's), not the next step's (the scheduler has stepped by the time it logs).
    import csv

    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for row, factor in zip(rows, LR_FACTORS, strict=True):
        assert abs(float(row["lr"]) - LR * factor) <= 1e-12 * LR, (row, LR * factor)
