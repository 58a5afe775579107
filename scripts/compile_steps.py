"""Step time of the debug Llama on gloo ranks: eager vs compiled vs +bucketing vs +reordering.

    torchrun --standalone --nproc_per_node=2 scripts/compile_steps.py [--steps 12]

Prints, per variant: median step time of the measured steps, compile time (first step),
the time our passes took, and collective counts before/after in forward and backward.
A quick measurement for the compiler issue; the full side-by-side lives in the benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import simplefsdp as sf
from simplefsdp.models.llama import LLAMA3_PRESETS, Transformer


def build(mesh):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(LLAMA3_PRESETS["debug"])
    sf.data_parallel(model, mesh)
    model.to_empty(device="cpu")
    with sf.disable_active_parametrization():
        torch.manual_seed(0)
        model.init_weights()
    return model


def run(variant, mesh, steps, batch, seq):
    model = build(mesh)
    backend = None
    if variant != "eager":
        bucketing, reordering = {"compiled": ("none", False), "+bucketing": ("manual", False),
                                 "+reordering": ("manual", True)}[variant]
        backend = sf.compile_backend(backend="inductor", bucketing=bucketing,
                                     reordering=reordering)
        torch._dynamo.reset()
        model = torch.compile(model, fullgraph=True, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    times, losses = [], []
    for _ in range(steps + 1):
        tokens = torch.randint(0, 256, (batch, seq + 1), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    out = {"variant": variant, "first_step_s": times[0],
           "median_step_s": statistics.median(times[1:]), "final_loss": losses[-1]}
    if backend is not None:
        out["pass_s"] = sum(r.pass_seconds for r in backend.reports)
        out["collectives"] = {r.graph: (r.collectives_before, r.collectives_after)
                              for r in backend.reports}
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    mesh = sf.make_mesh(dp_shard=dist.get_world_size())
    results = [run(v, mesh, args.steps, args.batch, args.seq)
               for v in ("eager", "compiled", "+bucketing", "+reordering")]
    if dist.get_rank() == 0:
        for r in results:
            print(json.dumps(r))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
