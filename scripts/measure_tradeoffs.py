"""Collectives (count and input bytes per group size), host<->device copies and the bytes
kept between forward and backward, per rank, for issue 48's knobs on the debug Llama:
4 gloo ranks, eager, float32, one optimizer step of 4 micro-steps (batch 2 x seq 64).
Prints one line per case and writes them to --out (JSON); figures go in
docs/performance.md.

    PYTHONPATH=$PWD python scripts/measure_tradeoffs.py --out /tmp/tradeoffs.json
    PYTHONPATH=$PWD python scripts/measure_tradeoffs.py --config configs/bench_medium.toml \
        --out /tmp/tradeoffs_medium.json     # a benchmark config's model instead

Cases: reshard after forward (True), reshard to groups of 2, CPU offload (the CPU standing
in for the device: ``offload.cpu_stands_in_for_device``, so the copies are counted, not
timed), gradient sync on the last micro-step only, and a frozen attention.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from rank_runner import run_ranks  # noqa: E402

import simplefsdp as sf  # noqa: E402
from simplefsdp import eager_reshard, offload  # noqa: E402
from simplefsdp.models.llama import LLAMA3_PRESETS, Transformer  # noqa: E402

WORLD, MICRO, BATCH, SEQ = 4, 4, 2, 64
KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
CASES = {"reshard=True": {}, "reshard=2": {"reshard_after_forward": 2},
         "cpu_offload": {"offload_policy": sf.CPUOffloadPolicy()},
         "gradient_sync=last": {"sync": "last"}, "frozen attention": {"frozen": True}}


def _collectives(fn) -> dict:
    """{"op@group size": [count, input bytes]} of the data-parallel collectives."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        fn()
    out = collections.defaultdict(lambda: [0, 0])
    for e in prof.events():
        kind = e.name.removeprefix("_c10d_functional::")
        if kind in KINDS:
            size = int(e.concrete_inputs[2 if kind != "all_gather_into_tensor" else 1])
            out[f"{kind}@{size}"][0] += 1
            out[f"{kind}@{size}"][1] += 4 * int(torch.Size(e.input_shapes[0]).numel())
    return dict(out)


class _KeptBytes:
    """Bytes the eager resharding holds for backward when forward ends (the kept pieces
    of ``reshard_after_forward=<int>``, or the shards ``True`` re-gathers from), counted
    from the recipes its pack hook hands autograd (each storage once)."""

    def __init__(self):
        self.storages: dict[int, int] = {}
        self.pack = eager_reshard._pack

    def __enter__(self):
        def pack(t):
            saved = self.pack(t)
            if isinstance(saved, eager_reshard._Regather):
                held = saved.sharded
                local = held.to_local() if hasattr(held, "to_local") else held
                self.storages[local.untyped_storage()._cdata] = local.untyped_storage().nbytes()
            return saved
        eager_reshard._pack = pack
        return self

    def __exit__(self, *exc):
        eager_reshard._pack = self.pack


def _case(rank: int, world: int, name: str, config: str | None) -> dict:
    with offload.cpu_stands_in_for_device():  # in the rank's own process
        return _measure(rank, name, config)


def _model_args(config: str | None):
    """The debug preset, or the model of ``config`` (a benchmark TOML, e.g.
    configs/bench_medium.toml)."""
    if config is None:
        return LLAMA3_PRESETS["debug"]
    from simplefsdp.bench.config import load_config

    return load_config(config).model_args()


def _measure(rank: int, name: str, config: str | None) -> dict:
    knobs = dict(CASES[name])
    sync, frozen = knobs.pop("sync", "every"), knobs.pop("frozen", False)
    torch.manual_seed(0)
    args = _model_args(config)
    model = Transformer(args)
    if frozen:
        for layer in model.layers.values():
            layer.attention.requires_grad_(False)
    model = sf.data_parallel(model, sf.make_mesh(dp_shard=WORLD), **knobs)
    vocab = args.vocab_size
    kept = _KeptBytes()

    def step() -> None:
        for m in range(MICRO):
            model.set_requires_gradient_sync(sync == "every" or m == MICRO - 1)
            tokens = torch.randint(0, vocab, (BATCH, SEQ + 1),
                                   generator=torch.Generator().manual_seed(10 * m + rank))
            with kept:
                logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                              tokens[:, 1:].flatten()).backward()
    host = offload.offloads(model)
    counts = _collectives(step)
    return {"collectives": counts, "kept_for_backward_bytes": sum(kept.storages.values()),
            "offload_copies": (dict(host[0].copies), dict(host[0].bytes)) if host else None,
            "shard_bytes": sum(p.to_local().nbytes for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default=None, help="a trainer TOML whose model to use")
    args = parser.parse_args()
    results = {}
    for name in CASES:
        results[name] = run_ranks(_case, WORLD, name, args.config)[0]
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
