"""``[profiling]``: per-rank Chrome traces of the chosen steps, with their collectives.

2 gloo ranks, FSDP (eager, parameters resharded after forward), 4 steps, steps 2-3
profiled. Each rank's ``rank<r>.json.gz`` must parse as a Chrome trace and hold exactly
the two steps' reduce-scatters: one per parameter and step (the reference: the model's
parameter count, from a plain ``Transformer`` built here), so a trace that missed a step
or ran on past the window shows; and their all-gathers: each parameter gathered for
forward and, resharded, again for backward (between one and two per parameter and step).
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json

import pytest
from rank_runner import run_ranks

from simplefsdp.config.job import load_config
from simplefsdp.errors import ConfigError

TINY = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
        "--model.n_kv_heads", "2", "--training.seq_len", "32", "--training.batch_size", "4",
        "--training.steps", "4", "--metrics.log_every", "4"]
FIRST, STEPS = 2, 2


def _train(rank: int, world: int, argv: list[str]) -> list[str]:
    from simplefsdp.train.__main__ import main

    return main(argv).profile_files


def _parameters() -> int:
    from simplefsdp.models.llama import LLAMA3_PRESETS, Transformer

    args = dataclasses.replace(LLAMA3_PRESETS["debug"], dim=32, n_layers=2, n_heads=4,
                               n_kv_heads=2)
    return len(list(Transformer(args).parameters()))


def test_traces_hold_the_steps_collectives(tmp_path, capfd):
    argv = [*TINY, "--metrics.output_dir", str(tmp_path), "--profiling.enable", "true",
            "--profiling.start_step", str(FIRST), "--profiling.steps", str(STEPS)]
    files = run_ranks(_train, 2, argv)
    folder = tmp_path / "profile" / f"step-{FIRST}"
    assert files == [[str(folder / "rank0.json.gz")], [str(folder / "rank1.json.gz")]]
    assert f"profile of steps 2-3: {folder}/rank<r>.json.gz for ranks 0-1" in capfd.readouterr().out
    n = _parameters()
    for rank in (0, 1):
        trace = json.loads(gzip.open(folder / f"rank{rank}.json.gz").read())
        names = collections.Counter(e.get("name") for e in trace["traceEvents"])
        reduce_scatters = names["_c10d_functional::reduce_scatter_tensor"]
        all_gathers = names["_c10d_functional::all_gather_into_tensor"]
        print(f"rank {rank}: {n} parameters, {all_gathers} all-gathers, "
              f"{reduce_scatters} reduce-scatters in {STEPS} steps")
        assert reduce_scatters == n * STEPS
        assert n * STEPS < all_gathers <= 2 * n * STEPS
        assert names["gloo:all_gather"] == all_gathers  # the backend's own events too


@pytest.mark.parametrize("flags, message", [
    (["--profiling.enable", "true", "--profiling.start_step", "4", "--profiling.steps", "2"],
     r"profiling\.start_step = 4 with profiling\.steps = 2 reaches past the run's "
     r"training\.steps = 4"),
    (["--profiling.enable", "true", "--profiling.memory_snapshot", "true"],
     r"profiling\.memory_snapshot = true records the CUDA allocator, but job\.device = 'cpu'"),
    (["--profiling.start_step", "0"], r"profiling\.start_step = 0 is out of range"),
])
def test_bad_profiling_keys_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*TINY, *flags])
