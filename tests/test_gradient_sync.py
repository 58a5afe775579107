"""Gradient sync control on real gloo process groups: ``set_requires_gradient_sync`` and
``set_requires_all_reduce`` (FSDP2's names), eager and compiled.

Each case trains the toy for 2 optimizer steps of 3 micro-steps twice from one seed:
the reference reduces every micro-step's gradient (sync on throughout); the run under
test turns sync off for micro-steps 1-2 and on for the 3rd, so each optimizer step
reduces the sum of 3 micro-steps' gradients once. The collectives of every optimizer
step are counted from the profiler's ``_c10d_functional`` events (compiled: every step
after the first, which traces and is run without the profiler).

Tolerance. The reference computes ``sum_m avg_r g[m, r]``, the run under test
``avg_r sum_m g[m, r]``: the same terms added in another order, so float32 rounding
differs (a few ulp of the gradients, which are O(1) here). We allow 2e-6 absolute
on gradients and parameters after 2 AdamW steps (AdamW divides by sqrt(v): an ulp-level
gradient difference moves a parameter by at most ~lr * ulp / |g|).
"""

from __future__ import annotations

import collections
import gzip
import json

import pytest
import torch
from rank_runner import run_ranks
from torch.distributed.tensor import DTensor
from toy import Toy, global_batch, loss_fn

import simplefsdp as sf

OPT_STEPS, MICRO = 2, 3  # an odd count: 'once' is not 'every other micro-step'
TOL = 2e-6  # see the module docstring: reordered float32 sums of O(1) gradients
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
MESHES = {"fully_shard": dict(dp_shard=2), "replicate": dict(dp_replicate=2, dp_shard=1),
          "hybrid_shard": dict(dp_replicate=2, dp_shard=2)}  # worlds 2, 2 and 4


def count_collectives(fn) -> collections.Counter:
    """How many of each data-parallel collective ``fn()`` issues (eager or compiled)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = collections.Counter(e.name for e in prof.events())
    return collections.Counter({c: names[f"_c10d_functional::{c}"] for c in COLLECTIVES})


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(model, rank: int, world: int, sync_every_microstep: bool, all_reduce_only=False):
    """OPT_STEPS optimizer steps of MICRO micro-steps. Returns (per step: full gradients
    and collective counts, final full parameters)."""
    forward = model
    if getattr(model, "_compile", False):
        torch._dynamo.reset()  # each model's graphs from scratch (the recompile limit)
        forward = torch.compile(model, fullgraph=True, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    steps = []
    for step in range(OPT_STEPS):
        def micro_steps(step=step):
            for m in range(MICRO):
                sync = sync_every_microstep or m == MICRO - 1
                if all_reduce_only:
                    model.set_requires_all_reduce(sync)
                else:
                    model.set_requires_gradient_sync(sync)
                tokens = global_batch(step * MICRO + m, world)[2 * rank:2 * (rank + 1)]
                loss_fn(forward, tokens).backward()
        if forward is not model and step == 0:
            micro_steps()  # traces and compiles: its counts are not compared (_check_counts)
            counts = collections.Counter()
        else:
            counts = count_collectives(micro_steps)
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        steps.append((grads, counts))
        opt.step()
        opt.zero_grad()
    return steps, {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _model(mode: str, compiled: bool):
    torch.manual_seed(0)
    model = sf.data_parallel(Toy(n_layers=1), sf.make_mesh(**MESHES[mode]), mode=mode)
    model._compile = compiled
    return model


def _compare(ref, test) -> float:
    (ref_steps, ref_params), (test_steps, test_params) = ref, test
    worst = 0.0
    for (ref_grads, _), (grads, _) in zip(ref_steps, test_steps, strict=True):
        assert ref_grads.keys() == grads.keys()
        for name in ref_grads:
            worst = max(worst, (ref_grads[name] - grads[name]).abs().max().item())
    for name in ref_params:
        worst = max(worst, (ref_params[name] - test_params[name]).abs().max().item())
    return worst


def _check_counts(ref, test, compiled: bool, all_reduce_only: bool) -> None:
    """Per optimizer step after warm-up (compiled: the first step also traces, and the
    profiler sees the traced ops): the gathers are unchanged (backward still re-gathers
    what forward freed) and each skipped reduction runs once instead of MICRO times."""
    warm = 1 if compiled else 0
    for (_, ref_count), (_, count) in zip(ref[0][warm:], test[0][warm:], strict=True):
        assert count["all_gather_into_tensor"] == ref_count["all_gather_into_tensor"], \
            (count, ref_count)
        assert count["all_reduce"] * MICRO == ref_count["all_reduce"], (count, ref_count)
        skipped = 1 if all_reduce_only else MICRO  # the all-reduce alone keeps the scatter
        assert count["reduce_scatter_tensor"] * skipped == ref_count["reduce_scatter_tensor"], \
            (count, ref_count)


def _sync_off_parity(rank: int, world: int, cases: tuple[tuple[str, bool], ...],
                     compiled: bool):
    """``cases``: (mode, all_reduce_only). Returns {case: (max diff, reference's and the
    test's collective counts per optimizer step)}."""
    report, refs = {}, {}
    for mode, all_reduce_only in cases:
        if mode not in refs:  # one reference per mode
            refs[mode] = _train(_model(mode, compiled), rank, world, sync_every_microstep=True)
        ref = refs[mode]
        test = _train(_model(mode, compiled), rank, world, sync_every_microstep=False,
                      all_reduce_only=all_reduce_only)
        diff = _compare(ref, test)
        assert diff <= TOL, (mode, compiled, diff)
        _check_counts(ref, test, compiled, all_reduce_only)
        report[mode, all_reduce_only] = (diff, dict(ref[0][-1][1]), dict(test[0][-1][1]))
    return report


CASES = {2: (("fully_shard", False), ("replicate", False)),
         4: (("hybrid_shard", False), ("hybrid_shard", True))}


@pytest.mark.parametrize("world, compiled", [
    pytest.param(2, False, id="2-eager", marks=pytest.mark.quick),
    pytest.param(2, True, id="2-compiled"),
    pytest.param(4, False, id="4-eager", marks=pytest.mark.many_ranks),
    pytest.param(4, True, id="4-compiled", marks=pytest.mark.many_ranks),
])
def test_sync_off_accumulates_and_reduces_once(world, compiled):
    report = run_ranks(_sync_off_parity, world, CASES[world], compiled)[0]
    for (mode, all_reduce_only), (diff, ref_counts, counts) in report.items():
        knob = "set_requires_all_reduce" if all_reduce_only else "set_requires_gradient_sync"
        print(f"{mode} {knob} {'compiled' if compiled else 'eager'}: max diff {diff:.2e}; "
              f"per optimizer step, sync every micro-step {ref_counts}, last only {counts}")


# --- The trainer: [training] gradient_sync --------------------------------------------
TINY = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
        "--model.n_kv_heads", "2", "--training.seq_len", "32", "--training.batch_size", "2",
        "--training.steps", "2", "--training.grad_accum_steps", str(MICRO),
        "--metrics.log_every", "2", "--profiling.enable", "true", "--profiling.start_step",
        "2", "--profiling.steps", "1"]


def _trainer_run(rank: int, world: int, argv: list[str]):
    from simplefsdp.train.__main__ import main

    result = main(argv)
    trace = json.loads(gzip.open(result.profile_files[0]).read())
    names = collections.Counter(e.get("name") for e in trace["traceEvents"])
    return result.losses, {c: names[f"_c10d_functional::{c}"] for c in COLLECTIVES}


def test_trainer_last_microstep_reduces_once_per_step(tmp_path):
    runs = {}
    for sync in ("every_microstep", "last_microstep"):
        argv = [*TINY, "--training.gradient_sync", sync,
                "--metrics.output_dir", str(tmp_path / sync)]
        runs[sync] = run_ranks(_trainer_run, 2, argv)[0]
    (ref_losses, ref_counts), (losses, counts) = runs["every_microstep"], runs["last_microstep"]
    print(f"profiled step, {MICRO} micro-steps: every_microstep {ref_counts}, "
          f"last_microstep {counts}; losses {ref_losses} vs {losses}")
    assert counts["reduce_scatter_tensor"] * MICRO == ref_counts["reduce_scatter_tensor"] > 0
    assert counts["all_gather_into_tensor"] == ref_counts["all_gather_into_tensor"]
    # The first step's loss precedes any update: bitwise. The second follows one AdamW
    # step from gradients summed in another order (module docstring): relative 1e-5.
    assert losses[0] == ref_losses[0]
    assert losses[1] == pytest.approx(ref_losses[1], rel=1e-5)


@pytest.mark.parametrize("flags, message", [
    (["--training.gradient_sync", "last"], r"training\.gradient_sync"),
    (["--training.gradient_sync", "last_microstep", "--parallel.pp", "2"],
     r"training\.gradient_sync = 'last_microstep' is not supported with parallel\.pp = 2"),
])
def test_bad_gradient_sync_refused(flags, message):
    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, flags).validate(2)
