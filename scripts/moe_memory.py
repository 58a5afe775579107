"""Expert memory per rank with and without expert parallelism, on 4 gloo ranks.

    python scripts/moe_memory.py [--out outputs/moe_memory.json]

``configs/debug_moe.toml`` (8 experts per MoE block), built by the trainer for each
``dp_mode`` at ``parallel.ep`` 1, 2 and 4, one step (forward, backward, AdamW). Per rank,
the routed experts' (``*.experts.*``) resident bytes: parameter shards, gradient shards
after the step's reduction, AdamW state (two moments; the step counter left out); and the
experts' gathered working copy (one MoE block's local experts as forward sees them after
the all-gather). Max over ranks. Not part of CI; figures in README ("Mixture of experts").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {  # dp_mode -> its flags on 4 ranks
    "fully_shard": [],
    "hybrid_shard": ["--parallel.dp_mode", "hybrid_shard", "--parallel.dp_replicate", "2",
                     "--parallel.dp_shard", "2"],
    "replicate": ["--parallel.dp_mode", "replicate", "--parallel.dp_replicate", "4",
                  "--parallel.dp_shard", "1"],
}


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _measure(rank: int, world: int, out: str) -> list[dict]:
    from simplefsdp.config.job import load_config
    from simplefsdp.train import trainer
    from simplefsdp.train.step import forward_backward, global_tokens

    rows = []
    for mode, flags in LAYOUTS.items():
        for ep in (1, 2, 4):
            if mode == "hybrid_shard" and ep == 4:
                continue  # ep divides dp_shard = 2
            cfg = load_config(str(ROOT / "configs/debug_moe.toml"),
                              [*flags, "--parallel.ep", str(ep), "--training.steps", "1",
                               "--metrics.output_dir", f"{out}/{mode}_ep{ep}"])
            cfg = dataclasses.replace(cfg, parallel=cfg.parallel.resolve(world))
            s = trainer.setup(cfg, None)
            experts = {n: p for n, p in s.model.named_parameters() if ".experts." in n}
            gathered = []
            block = s.model.layers["0"].feed_forward.experts
            block.register_forward_pre_hook(lambda m, a, into=gathered: into.append(
                _local_bytes(m.gate_up_proj) + _local_bytes(m.down_proj)))
            batches = [next(s.loader)]
            forward_backward(s, batches, global_tokens(s, batches))
            grads = sum(_local_bytes(p.grad) for p in experts.values())
            s.optimizer.step()
            state = sum(_local_bytes(v) for p in experts.values()
                        for k, v in s.optimizer.state[p].items() if k != "step")
            figures = torch.tensor([sum(_local_bytes(p) for p in experts.values()), grads,
                                    state, gathered[0]], dtype=torch.float64)
            dist.all_reduce(figures, op=dist.ReduceOp.MAX)
            s.metrics.close()
            params, grads, state, working = (int(x) for x in figures.tolist())
            rows.append({"dp_mode": mode, "ep": ep, "param_bytes": params,
                         "grad_bytes": grads, "optimizer_bytes": state,
                         "resident_bytes": params + grads + state,
                         "gathered_block_bytes": working})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/moe_memory.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    import tempfile

    from rank_runner import run_ranks

    with tempfile.TemporaryDirectory() as scratch:
        rows = run_ranks(_measure, 4, scratch)[0]
    print(f"{'dp_mode':<13} {'ep':>2} {'params':>9} {'grads':>9} {'AdamW':>9} "
          f"{'resident':>9} {'gathered/block':>14}   (bytes per rank, experts only)")
    for r in rows:
        print(f"{r['dp_mode']:<13} {r['ep']:>2} {r['param_bytes']:>9} {r['grad_bytes']:>9} "
              f"{r['optimizer_bytes']:>9} {r['resident_bytes']:>9} "
              f"{r['gathered_block_bytes']:>14}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
