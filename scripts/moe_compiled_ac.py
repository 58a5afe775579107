"""Step time and activation memory of a compiled MoE under selective activation
checkpointing (issue 51): ``debug_moe`` (``models.moe.MOE_PRESETS``), EP 2 x FSDP 2 on 2
gloo ranks, eager against compiled (aot_eager or Inductor) with the exact and the padded
dispatch, without AC and with selective AC.

    python scripts/moe_compiled_ac.py [--backend aot_eager] [--steps 5] [--batch 8]

Per configuration: the first step (compilation included), the median of ``--steps``
more, the step's transient memory peak (profiler memory events, the least of 3 profiled
steps: ``bench.measure.least_transient``; what autograd holds between forward and
backward, the activations, is most of it) and the last timed step's loss (rank 0's
part of the token-normalized sum); times and peaks: the max over the 2 ranks.
Built as the trainer builds an MoE (AC, EP, the experts' then the model's data
parallel, ``compile_checkpointed_blocks`` and ``compile_model``); SGD, the trainer's
token-normalized loss. Prints a Markdown table; figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

CONFIGS = [(compiled, dispatch, ac) for compiled, dispatch in
           ((False, "exact"), (True, "exact"), (True, "padded")) for ac in ("none", "selective")]


def _build(compiled: bool, dispatch: str, ac: str, backend_name: str, world: int):
    """``debug_moe`` as the trainer builds an MoE at EP 2 (see the module docstring)."""
    import torch

    import simplefsdp as sf
    from simplefsdp._torch_compat import dynamo_reset
    from simplefsdp.mesh import ParallelDims
    from simplefsdp.models import moe
    from simplefsdp.models.parallelize import compile_model
    from simplefsdp.parallel import activation_checkpoint, expert

    torch.manual_seed(0)
    model = moe.MoETransformer(moe.MOE_PRESETS["debug_moe"])
    model.init_weights()
    activation_checkpoint.apply_ac(model, ac)
    mesh = sf.make_mesh(dp_shard=world)
    experts_mesh = ParallelDims.expert_mesh(mesh, 2)
    expert.apply_ep(model, experts_mesh)
    expert.set_expert_dispatch(model, dispatch, 1.25)
    expert.shard_experts(model, experts_mesh, mode="fully_shard", reduce_op="sum")
    sf.data_parallel(model, mesh, mode="fully_shard", reduce_op="sum")
    if compiled:
        dynamo_reset()
        backend = sf.compile_backend(backend=backend_name, bucketing="manual",
                                     reordering=True)
        activation_checkpoint.compile_checkpointed_blocks(model, backend)
        model = compile_model(model, backend, fullgraph=False)
    return model


def _step(model, opt, data, world: int) -> float:
    from toy import moe_token_loss

    loss = moe_token_loss(model, *data, world * data[1].numel())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _measure(rank: int, world: int, backend_name: str, steps: int, batch: int) -> list:
    import functools

    import torch
    from toy import token_batches

    from simplefsdp.bench.measure import least_transient
    from simplefsdp.models import moe

    data = token_batches(world, batch, 128, moe.MOE_PRESETS["debug_moe"].vocab_size)[rank]
    rows = []
    for compiled, dispatch, ac in CONFIGS:
        model = _build(compiled, dispatch, ac, backend_name, world)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=False)
        step = functools.partial(_step, model, opt, data, world)
        times = []
        for _ in range(1 + steps):
            torch.distributed.barrier()
            start = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - start)
        peak = least_transient(step, torch.device("cpu"))
        rows.append({"compiled": compiled, "dispatch": dispatch, "ac": ac,
                     "first_s": times[0], "median_s": statistics.median(times[1:]),
                     "peak_mib": peak / 2**20, "loss": loss})
    return rows


def main() -> None:
    from rank_runner import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager", choices=("aot_eager", "inductor"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    a = parser.parse_args()
    per_rank = run_ranks(_measure, 2, a.backend, a.steps, a.batch)
    print(f"| run (debug_moe, EP 2 x FSDP 2, batch {a.batch} x 128 per rank) | AC | "
          "step 1 s | median s | transient peak MiB | loss (rank 0 part) |")
    print("|---|---|---:|---:|---:|---:|")
    for i, row in enumerate(per_rank[0]):
        name = f"{a.backend} {row['dispatch']}" if row["compiled"] else "eager exact"
        worst = {k: max(r[i][k] for r in per_rank) for k in ("first_s", "median_s",
                                                             "peak_mib")}
        print(f"| {name} | {row['ac']} | {worst['first_s']:.2f} | {worst['median_s']:.3f} | "
              f"{worst['peak_mib']:.1f} | {row['loss']:.6f} |")


if __name__ == "__main__":
    main()
