"""Check a prediction on one real GPU: this rank's shard of an N-GPU layout, run under
a fake process group of N (real local memory and compute; collectives return local
data, so the step time excludes communication).

    python -m simplefsdp.plan.gpu_check --config configs/llama3_8b.toml --gpus 8 \\
        --gpu h100-sxm [--section.key value ...]

Prints measured ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` and the
step time against the planner's active and reserved peaks and its step time less the
exposed communication.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import torch.distributed as dist


def measure(cfg, gpus: int, steps: int = 3) -> dict:
    """Peak memory and median step time of rank 0's shard on ``cuda:0``."""
    from simplefsdp.models.llama_family import build_model
    from simplefsdp.optim import build_optimizer
    from simplefsdp.parallel.tensor import loss_context, token_loss_sum

    from .._torch_compat import fake_store

    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=gpus)
    p = cfg.parallel.resolve(gpus)
    cfg = dataclasses.replace(cfg, parallel=p)
    dims = p.dims()
    mesh = dims.build_mesh("cuda")
    runnable, model = build_model(cfg, mesh, dims, torch.device("cuda", 0))
    optimizer, _ = build_optimizer(model, cfg)
    t = cfg.training
    x = torch.randint(0, cfg.model.model_args().vocab_size, (t.batch_size, t.seq_len),
                      device="cuda")

    def step():
        with loss_context(p.vocab_sharded_loss):  # the trainer's loss, backward included
            loss = token_loss_sum(runnable(x), x) / x.numel()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # optimizer state, compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "step_s": sorted(times)[len(times) // 2], "device": torch.cuda.get_device_name()}


def main(argv: list[str] | None = None) -> None:
    from simplefsdp.config.job import load_config
    from simplefsdp.plan import predict_isolated

    parser = argparse.ArgumentParser(prog="python -m simplefsdp.plan.gpu_check")
    parser.add_argument("--config")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu", default="h100-sxm")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    pred = predict_isolated(cfg, args.gpus, args.gpu)
    got = measure(cfg, args.gpus)
    print(json.dumps({"config": overrides, "measured": got, "predicted": {
        "peak_memory_gib": pred.peak_memory_gib,
        "reserved_memory_gib": pred.reserved_memory_gib,
        "step_time_s": pred.step_time_s,
        "step_time_without_exposed_comm_s": pred.step_time_s - pred.exposed_comm_s}}))


if __name__ == "__main__":
    main()
