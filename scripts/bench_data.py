"""Data at scale, measured (not a test): first-run tokenizing, memory per rank, restart.

For each size (MB) it writes a ``.jsonl`` of random word documents, a 2,000-token BPE
``tokenizer.json`` trained locally on its first 5 MB (``tokenizers``, no network), then
trains ``configs/debug.toml`` for a few steps on 2 ranks, twice:

1. first run: the token cache is built (throughput from its ``meta.json``); peak RSS of
   each rank process while tokenizing (until the cache folder is complete) and while
   training (after);
2. second run (cache hit): seconds from launch to step 1 in ``metrics.csv``.

A shipped-corpus run gives the training RSS of the model and runtime alone, subtracted
for "beyond the model". Results go to ``<out>/bench_data.json`` and a table; generated
corpora and caches are deleted afterwards.

    python scripts/bench_data.py --sizes 100,1000 --out outputs/bench_data
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

WORDS = [f"w{i}" + "abcdefghij"[i % 10] * (i % 7) for i in range(5000)]


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> None:
    rng, target, written = random.Random(seed), megabytes * 10**6, 0
    with open(path, "w") as f:
        while written < target:
            words = rng.choices(WORDS, k=rng.randint(50, 800))
            line = json.dumps({"text": " ".join(words)}) + "\n"
            f.write(line)
            written += len(line)


def train_tokenizer(corpus: Path, path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    def sample():
        with open(corpus) as f:
            for i, line in enumerate(f):
                if i * 2000 > 5 * 10**6:
                    return
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(sample(), trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def rank_pids(launcher: int) -> list[int]:
    """The torchrun launcher's children that run the trainer (the ranks)."""
    try:
        out = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True)
    except OSError:
        return []
    return [int(p) for p in out.stdout.split()]


def run(args: list[str], out: Path, cache: Path | None, steps: int) -> dict:
    """One 2-rank run; peak RSS per rank before/after the cache is complete, seconds
    to step 1."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "-m", "simplefsdp.train", "--config", "configs/debug.toml",
           "--metrics.output_dir", str(out), "--metrics.log_every", "1", *args]
    started = time.perf_counter()
    # Rank 1 waits for rank 0's tokenizing in one collective: give a 1 GB first run an hour.
    env = {"SIMPLEFSDP_PG_TIMEOUT_S": "3600", **os.environ}
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "run.log", "w")  # a file, not a pipe: a full pipe would stall it
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env)
    peaks = {"tokenizing": {}, "training": {}}
    first_step = None
    while proc.poll() is None:
        built = cache is None or (cache.exists() and any(cache.glob("*/meta.json")))
        phase = "training" if built else "tokenizing"
        for i, pid in enumerate(sorted(rank_pids(proc.pid))):
            peaks[phase][i] = max(peaks[phase].get(i, 0.0), rss_mb(pid))
        csv = out / "metrics.csv"
        if first_step is None and csv.is_file() and len(csv.read_text().splitlines()) > 1:
            first_step = time.perf_counter() - started
        time.sleep(0.1)
    log_file.close()
    log = (out / "run.log").read_text()
    csv = out / "metrics.csv"
    rows = len(csv.read_text().splitlines()) - 1 if csv.is_file() else 0
    if proc.returncode and rows < steps:
        raise SystemExit(f"run failed ({proc.returncode}):\n{log[-3000:]}")
    if proc.returncode:  # every step logged, then a rank died on the way out: say so
        print(f"warning: {out.name} logged its {steps} steps, then exited with "
              f"{proc.returncode} (see {out / 'run.log'})", flush=True)
    return {"seconds": time.perf_counter() - started, "seconds_to_step_1": first_step,
            "peak_rss_mb": peaks, "exit_code": proc.returncode}


def bench(size: int, work: Path, steps: int) -> dict:
    corpus, tok, cache = work / f"corpus{size}.jsonl", work / "tokenizer.json", work / "cache"
    free = shutil.disk_usage(work).free
    if free < 2 * size * 10**6:  # the corpus, and its tokens (~0.5 byte a byte) beside it
        raise SystemExit(f"{work}: {free / 1e9:.1f} GB free, {size} MB of corpus needs about "
                         f"{2 * size / 1e3:.1f} GB; free space or pass another --out")
    t = time.perf_counter()
    write_corpus(corpus, size)
    train_tokenizer(corpus, tok)
    print(f"generated {size} MB + tokenizer in {time.perf_counter() - t:.0f} s", flush=True)
    common = ["--data.dataset", str(corpus), "--data.tokenizer", str(tok),
              "--data.cache_dir", str(cache), "--model.vocab_size", "2048",
              "--training.steps", str(steps)]
    first = run(common, work / f"first{size}", cache, steps)
    meta = json.loads(next(cache.glob("*/meta.json")).read_text())
    second = run(common, work / f"second{size}", cache, steps)
    shutil.rmtree(cache)
    corpus.unlink()
    return {"size_mb": size, "tokens": meta["tokens"], "documents": meta["documents"],
            "tokenize_mb_s": meta["mb_per_s"], "tokenize_s": meta["seconds"],
            "tokenize_workers": meta["workers"], "tokenize_threads": meta.get("threads"),
            "tokenize_mb_per_cpu_s": meta.get("mb_per_cpu_s"),
            "tokenize_encoder": meta.get("encoder"),
            "first": first, "second": second}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000", help="corpus sizes in MB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="outputs/bench_data")
    a = parser.parse_args()
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    load = os.getloadavg()
    base = run(["--training.steps", str(a.steps)], out / "baseline", None, a.steps)
    model_rss = max(base["peak_rss_mb"]["training"].values())
    rows = [bench(int(s), out, a.steps) for s in a.sizes.split(",")]
    result = {"load_before": load, "load_after": os.getloadavg(), "cores": os.cpu_count(),
              "baseline_training_rss_mb": model_rss, "runs": rows}
    (out / "bench_data.json").write_text(json.dumps(result, indent=1))
    print(f"{'MB':>6} {'encoder':>12} {'tok MB/s':>9} {'MB/CPU-s':>9} {'RSS tokenizing':>15} "
          f"{'RSS training':>13} {'beyond model':>13} {'2nd run: step 1 s':>18}")
    for r in rows:
        tok = max(r["first"]["peak_rss_mb"]["tokenizing"].values(), default=0.0)
        train = max(r["first"]["peak_rss_mb"]["training"].values(), default=0.0)
        print(f"{r['size_mb']:>6} {r['tokenize_encoder']:>12} {r['tokenize_mb_s']:>9.1f} "
              f"{r['tokenize_mb_per_cpu_s']:>9.2f} {tok:>15.0f} {train:>13.0f} "
              f"{train - model_rss:>13.0f} {r['second']['seconds_to_step_1'] or 0:>18.1f}")
    print(f"(load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after, on "
          f"{os.cpu_count()} cores; the machine is shared)")


if __name__ == "__main__":
    main()
