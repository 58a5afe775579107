"""Collectives, their input bytes and the unreduced gradient memory of one optimizer step
(4 micro-steps) on the debug Llama, per rank, for each gradient-sync knob and for frozen
attention weights: eager, gloo, CPU. Prints one line per case (figures go in
docs/performance.md).

    PYTHONPATH=$PWD python scripts/measure_grad_sync.py
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from rank_runner import run_ranks  # noqa: E402

import simplefsdp as sf  # noqa: E402
from simplefsdp.gradient_sync import gathers  # noqa: E402
from simplefsdp.models.llama import LLAMA3_PRESETS, Transformer  # noqa: E402

MICRO, BATCH, SEQ = 4, 2, 64
KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
CASES = [  # mode, world, make_mesh kwargs, knob, frozen attention
    ("fully_shard", 2, dict(dp_shard=2), "every", False),
    ("fully_shard", 2, dict(dp_shard=2), "last", False),
    ("replicate", 2, dict(dp_replicate=2, dp_shard=1), "every", False),
    ("replicate", 2, dict(dp_replicate=2, dp_shard=1), "last", False),
    ("hybrid_shard", 4, dict(dp_replicate=2, dp_shard=2), "every", False),
    ("hybrid_shard", 4, dict(dp_replicate=2, dp_shard=2), "last", False),
    ("hybrid_shard", 4, dict(dp_replicate=2, dp_shard=2), "all_reduce_last", False),
    ("fully_shard", 2, dict(dp_shard=2), "every", True),
]


def _profile(fn) -> tuple[dict, dict]:
    """Count of each collective and the bytes of its (float32) input on this rank."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        fn()
    count, nbytes = collections.Counter(), collections.Counter()
    for event in prof.events():
        kind = event.name.removeprefix("_c10d_functional::")
        if kind in KINDS:
            count[kind] += 1
            nbytes[kind] += 4 * int(torch.Size(event.input_shapes[0]).numel())
    return dict(count), dict(nbytes)


def _unreduced_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients accumulated unreduced (sync off) on this rank."""
    total = 0
    for gather, _ in gathers(model):
        for sink in (gather.full_sink, gather.shard_sink):
            if sink is not None and sink.grad is not None:
                grad = sink.grad
                total += grad.to_local().nbytes if hasattr(grad, "to_local") else grad.nbytes
    return total


def _case(rank: int, world: int, mode: str, mesh_kw: dict, knob: str, frozen: bool):
    torch.manual_seed(0)
    model = Transformer(LLAMA3_PRESETS["debug"])
    if frozen:
        for layer in model.layers.values():
            layer.attention.requires_grad_(False)
    model = sf.data_parallel(model, sf.make_mesh(**mesh_kw), mode=mode)
    vocab, held = LLAMA3_PRESETS["debug"].vocab_size, []

    def step() -> None:
        for m in range(MICRO):
            sync = knob == "every" or m == MICRO - 1
            if knob == "last":
                model.set_requires_gradient_sync(sync)
            elif knob == "all_reduce_last":
                model.set_requires_all_reduce(sync)
            tokens = torch.randint(0, vocab, (BATCH, SEQ + 1),
                                   generator=torch.Generator().manual_seed(10 * m + rank))
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                              tokens[:, 1:].flatten()).backward()
            if m == MICRO - 2:  # held before the last micro-step reduces them
                held.append(_unreduced_bytes(model))

    step()  # warm-up
    count, nbytes = _profile(step)
    grads = sum(p.grad.to_local().nbytes for p in model.parameters() if p.grad is not None)
    return count, nbytes, held[-1], grads


if __name__ == "__main__":
    for mode, world, kw, knob, frozen in CASES:
        count, nbytes, held, grads = run_ranks(_case, world, mode, kw, knob, frozen)[0]
        print(f"{mode} world {world} sync={knob} frozen_attention={frozen}: {count}, "
              f"input bytes {nbytes}, unreduced held {held} B, sharded grads {grads} B")
