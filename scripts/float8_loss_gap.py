"""Float8 against bf16 on the debug config: the per-step loss gap, step time and peak memory.

    python scripts/float8_loss_gap.py                  # 200 steps, 2 ranks, eager
    python scripts/float8_loss_gap.py --steps 50 --compile

Runs the trainer twice from one seed (bf16 parameters, fp32 reductions; then the same with
``--float8.enable true``), reads both ``metrics.csv`` (one row per step) and prints the
largest |loss difference|, the largest difference of 10-step means, and each run's median
step time and peak RSS. Not a test (minutes of CPU); ``tests/test_float8.py`` tests the
bound it measures, over fewer steps. Figures go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(out: Path, steps: int, nproc: int, float8: bool, compile_: bool) -> list[dict]:
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "-m", "simplefsdp.train", "--training.steps", str(steps), "--metrics.log_every", "1",
            "--training.mixed_precision_param", "bfloat16", "--metrics.output_dir", str(out),
            "--float8.enable", str(float8).lower(), "--compile.enable", str(compile_).lower(),
            "--compile.backend", "aot_eager"]
    subprocess.run(argv, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL)
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: run(Path(tmp) / name, args.steps, args.nproc, name == "float8",
                          args.compile) for name in ("bf16", "float8")}
    loss = {k: [float(r["loss"]) for r in v] for k, v in rows.items()}
    gaps = [abs(a - b) for a, b in zip(loss["bf16"], loss["float8"], strict=True)]
    means = [abs(sum(loss["bf16"][i:i + 10]) - sum(loss["float8"][i:i + 10])) / 10
             for i in range(0, len(gaps) - 9, 10)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    print(f"steps {args.steps}, {args.nproc} ranks, compile={args.compile}")
    print(f"max |loss gap| {max(gaps):.4f} at step {worst + 1} "
          f"(bf16 {loss['bf16'][worst]:.4f}, float8 {loss['float8'][worst]:.4f})")
    print(f"max |gap of 10-step means| {max(means):.4f}; final loss bf16 "
          f"{loss['bf16'][-1]:.4f}, float8 {loss['float8'][-1]:.4f}")
    for name, r in rows.items():
        times = [float(x["step_time_s"]) for x in r[2:]]  # past the first steps' warm-up
        print(f"{name}: median step {statistics.median(times):.3f} s, peak RSS "
              f"{max(float(x['max_rss_gib']) for x in r):.3f} GiB")
    for step in (1, 10, 50, 100, 150, 200):
        if step <= len(gaps):
            print(f"  step {step}: bf16 {loss['bf16'][step - 1]:.4f} "
                  f"float8 {loss['float8'][step - 1]:.4f} gap {gaps[step - 1]:.4f}")


if __name__ == "__main__":
    main()
