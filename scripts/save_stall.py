"""Training time lost per checkpoint save: ``checkpoint.async_mode`` sync against async.

    python scripts/save_stall.py        # one process, ~100M parameters, 1.13 GiB saved

A stack of 24 Linear(2048, 2048) layers (100.7M parameters) with AdamW state (weights
+ two moments: 12 bytes per parameter) is saved twice per mode through the trainer's
``CheckpointManager``. "blocked" is how long ``save`` kept the training thread (sync:
the whole write; async: the staging copy); "to manifest" adds waiting for the write
and ``finish`` (the rename and the checksums, which run on the training thread in every
mode). Not part of CI; figures in README ("Asynchronous saves").
"""

from __future__ import annotations

import tempfile
import time

import torch

from simplefsdp.train.checkpoint import CheckpointManager, TrainerState


class _Loader:
    def state_dict(self):
        return {"position": 0}

    def load_state_dict(self, state):
        pass


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(24)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()
    n = sum(p.numel() for p in model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    for mode in ("sync", "async", "async_pinned"):
        with tempfile.TemporaryDirectory() as folder:
            manager = CheckpointManager(folder, model, optimizer,
                                        TrainerState(scheduler, _Loader()), 1, 0,
                                        async_mode=mode)
            for step in (1, 2):
                started = time.perf_counter()
                manager.save(step)
                blocked = time.perf_counter() - started
                manager.finish()
                total = time.perf_counter() - started
                print(f"{mode} save {step}: {n / 1e6:.1f}M params, {n * 12 / 2**30:.2f} GiB: "
                      f"blocked {blocked:.2f} s, to manifest {total:.2f} s", flush=True)
            manager.writer.close()


if __name__ == "__main__":
    main()
