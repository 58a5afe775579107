"""The planner's view of issue 48's knobs on one model: the layout's row, then one row per
knob (the trainer's keys), from one trace (the knobs are closed-form terms,
``plan/tradeoffs.py``). Prints the planner's table and writes JSON.

    PYTHONPATH=$PWD python scripts/plan_tradeoffs.py --config configs/llama3_8b.toml \\
        --gpus 16 --out /tmp/plan_8b.json [--gpu h100-sxm] [trainer overrides ...]

Same as ``python -m simplefsdp.plan`` once per knob, without tracing again each time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simplefsdp.config.job import load_config  # noqa: E402
from simplefsdp.plan import report  # noqa: E402
from simplefsdp.plan.predict import predict  # noqa: E402

KNOBS = {"none": [],
         "reshard to a node": ["--parallel.reshard_after_forward", "8"],
         "gradient sync on the last micro-step": ["--training.gradient_sync", "last_microstep"],
         "CPU offload": ["--training.cpu_offload", "true"],
         "LoRA (frozen base)": ["--lora.enable", "true"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu", default="h100-sxm")
    parser.add_argument("--out", required=True)
    args, overrides = parser.parse_known_args()
    rows = []
    for name, flags in KNOBS.items():
        cfg = load_config(args.config, ["--job.device", "cuda", *overrides, *flags],
                          world_size=args.gpus)
        rows.append(predict(cfg, args.gpus, args.gpu))
        print(f"{name}: {rows[-1].reserved_memory_gib:.2f} GiB reserved, "
              f"{rows[-1].tokens_per_s_per_gpu:.0f} tok/s/GPU", file=sys.stderr, flush=True)
    print(report.table(rows))
    report.write_json(rows, args.out)


if __name__ == "__main__":
    main()
