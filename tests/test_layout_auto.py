"""``parallel.layout = "auto"``: the trainer trains the layout the planner's search ranks
first, keeps the keys the user fixed, respects the memory limit, writes a ``layout.toml``
that repeats the run, and refuses (exit 78) when nothing fits.

Every search here is for one small model (the debug preset with 2 blocks and one KV
head, so tp 2 does not divide it: tp 1 only, pp 1 or 2) on 4 ranks of the ``cpu``
profile, named explicitly (``parallel.hardware = "cpu"``, a fixed memory limit): the
answer depends on the planner's figures, never on this machine's load or calibration.
The planner's own calls run in the session's planner process (conftest.py); the answer
cache of the trainer's runs lives in a folder of this file's own.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
from rank_runner import run_ranks

from simplefsdp.config.job import load_config
from simplefsdp.errors import ConfigError

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

WORLD = 4
# two micro-steps a step: the search's gradient-sync row (sync on the last micro-step,
# one reduction a step instead of two) is a candidate, and the fastest that fits
MODEL = ["--model.n_layers", "2", "--model.n_kv_heads", "1", "--training.seq_len", "64",
         "--training.grad_accum_steps", "2"]
# the device the searches plan for: 4 ranks of the cpu profile on one host, 2 GB each
PLAN = ["--parallel.hardware", "cpu", "--parallel.memory_limit_gb", "2"]
PROFILE = "cpu@2GB"  # the same description for the planner's command line
LAYOUT_KEYS = ("dp_replicate", "dp_shard", "tp", "pp", "ep", "cp_ring", "cp_ulysses")


def _argv(out: Path, *extra: str) -> list[str]:
    return [*MODEL, *PLAN, "--training.steps", "2", "--metrics.log_every", "1",
            "--metrics.output_dir", str(out), "--parallel.layout", "auto", *extra]


def _train(rank: int, world: int, argv: list[str]) -> dict:
    """A run's losses and gradient norms, and the gradient-sync settings its parameters
    were given (``GradientSyncControl.set_sync``: False while a micro-step accumulates
    without reducing, issue 48's knob at work)."""
    from simplefsdp.gradient_sync import GradientSyncControl
    from simplefsdp.train.__main__ import main

    settings, set_sync = set(), GradientSyncControl.set_sync

    def recorded(self, sharded, gradient_sync, all_reduce):
        settings.add(gradient_sync)
        return set_sync(self, sharded, gradient_sync, all_reduce)

    GradientSyncControl.set_sync = recorded
    try:
        result = main(argv)
    finally:
        GradientSyncControl.set_sync = set_sync
    return {"losses": result.losses, "grad_norms": result.grad_norms,
            "sync_settings": sorted(settings)}


def _cli_search(out: str, cache: str) -> dict:
    """``python -m simplefsdp.plan --search --tradeoffs`` for the same job and device (the
    search ``layout = "auto"`` runs): its first row."""
    import json

    from simplefsdp.plan.__main__ import main

    # the figures the trainer's search stored (``plan.disk_cache``; they are what a fresh
    # trace gives: tests/test_plan_search.py): the search here traces nothing again
    os.environ["SIMPLEFSDP_CACHE_DIR"], os.environ["SIMPLEFSDP_PLAN_CACHE"] = cache, "1"
    path = os.path.join(out, "plan.json")
    code = main(["--gpus", str(WORLD), "--gpus-per-node", str(WORLD), "--gpu", PROFILE,
                 "--search", "--tradeoffs", "--keep", "1", "--workers", "1", "--json", path,
                 *MODEL])
    assert code == 0
    with open(path) as f:
        return json.load(f)[0]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """The trainer's answer cache for this file: empty at the start, so the first auto
    run searches."""
    return tmp_path_factory.mktemp("layout_cache")


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory, cache_dir):
    """One 4-rank auto run of 2 steps, and the planner's command line's top row."""
    out = tmp_path_factory.mktemp("auto")
    os.environ["SIMPLEFSDP_CACHE_DIR"] = str(cache_dir)  # the ranks copy the environment
    try:
        result = run_ranks(_train, WORLD, _argv(out / "run"))[0]
    finally:
        del os.environ["SIMPLEFSDP_CACHE_DIR"]
    return out / "run", result


@pytest.mark.quick
def test_auto_trains_what_the_search_ranks_first(auto_run, planner, tmp_path, cache_dir):
    out, result = auto_run
    top = planner(_cli_search, str(tmp_path), str(cache_dir))
    assert top["fits"]
    chosen = load_config(out / "layout.toml", [])
    p = chosen.parallel
    assert p.layout == "manual"  # the file repeats the run without searching
    assert {k: getattr(p, k) for k in LAYOUT_KEYS} == {k: top[k] for k in LAYOUT_KEYS}
    assert (chosen.activation_checkpoint.mode, chosen.training.batch_size) == \
        (top["ac"], top["batch_size"])
    from simplefsdp.plan.tradeoffs import knob_label

    assert knob_label(chosen) == top["knobs"]  # the search's knob rows are candidates too
    # here the gradient-sync row wins (one reduction of two saved, room for the full-size
    # accumulator), and the ranks trained with it: their first micro-step did not reduce
    assert top["knobs"] == "sync=last", top
    assert chosen.training.gradient_sync == "last_microstep"
    assert result["sync_settings"] == [False, True], result
    # the start line (the file's header) names the layout and its prediction
    header = (out / "layout.toml").read_text().splitlines()[0]
    assert f"tokens/s ({top['tokens_per_s_per_gpu']:.0f} per rank)" in header, header
    assert f"predicted step {top['step_time_s']:.3g} s" in header, header
    # everything else is the command line's: the model, steps, device profile
    assert (chosen.model.n_layers, chosen.training.steps, chosen.parallel.hardware,
            chosen.training.grad_accum_steps) == (2, 2, "cpu", 2)


def test_layout_toml_repeats_the_run_bitwise(auto_run, tmp_path):
    """The written config, trained again without the search (another output folder),
    gives the same losses and gradient norms bit for bit (same layout, seed, data)."""
    out, first = auto_run
    again = run_ranks(_train, WORLD, ["--config", str(out / "layout.toml"),
                                       "--metrics.output_dir", str(tmp_path)])[0]
    assert len(first["losses"]) == 2
    assert again == first
    assert not (tmp_path / "layout.toml").exists()  # no search, nothing written


# Deeper and longer than MODEL, so that activations, not the one block's recomputation,
# decide the peaks: 8 blocks of 256 tokens (the same cost to trace).
LONG_MODEL = ["--model.n_layers", "8", "--model.n_kv_heads", "1", "--training.seq_len", "256"]


def _choices(cache: str) -> dict:
    """In the planner process: the needs of the three AC modes on the only layout a fixed
    batch of 1 leaves (dp_shard 4; PP needs 2 microbatches), a choice under a limit only
    full AC meets, and the error under one nothing meets."""
    # the planner's disk cache on, in this call's folder: the answer under one limit
    # must not answer the search under the other (the limit is in the answer's key)
    os.environ["SIMPLEFSDP_CACHE_DIR"], os.environ["SIMPLEFSDP_PLAN_CACHE"] = cache, "1"
    from simplefsdp.hardware import GB, GiB
    from simplefsdp.plan import auto_layout
    from simplefsdp.plan.predict import CONTEXT_BYTES, predict

    cfg = load_config(None, LONG_MODEL)
    needs = {}
    for ac in ("none", "selective", "full"):
        c = copy.deepcopy(cfg)
        c.parallel.dp_shard, c.training.batch_size, c.activation_checkpoint.mode = 4, 1, ac
        needs[ac] = predict(c, WORLD, "cpu", WORLD).reserved_memory_gib * GiB + CONTEXT_BYTES
    # whole sequences only: split, they would fit without recomputing
    fixed = {"training.batch_size": 1, "parallel.cp_ring": 1, "parallel.cp_ulysses": 1}
    between = (needs["full"] + min(needs["none"], needs["selective"])) / 2 / GB
    chosen = auto_layout.choose(cfg, WORLD, f"cpu@{between!r}GB", WORLD, fixed, False)
    below = (needs["full"] - 1000) / GB
    try:
        auto_layout.choose(cfg, WORLD, f"cpu@{below!r}GB", WORLD, fixed, False)
        refused = None
    except ConfigError as e:
        refused = str(e)
    return {"needs": needs, "chosen": chosen, "refused": refused,
            **_knob_choices(cfg, fixed, below)}


def _knob_choices(cfg, fixed: dict, below: float) -> dict:
    """Issue 48's knobs in the choice, for a GPU job (``job.device = "cuda"``) on the same
    profile: under the limit nothing fits on the device (``below``), only CPU offload
    makes it fit; with ``reshard_after_forward = false`` (not a key the user fixed here),
    no AC (under full AC the blocks' gathers are recomputed anyway, and a reshard to a
    group only adds its part) and CPU offload fixed off, on 2 GPUs a node, a limit
    between the need of an int reshard (a node: 2) and that of keeping the gathered
    parameters, the int reshard."""
    from simplefsdp.hardware import GB, GiB
    from simplefsdp.plan import auto_layout
    from simplefsdp.plan.predict import CONTEXT_BYTES, predict

    gpu_job = copy.deepcopy(cfg)
    gpu_job.job.device = "cuda"
    offload = auto_layout.choose(gpu_job, WORLD, f"cpu@{below!r}GB", WORLD, fixed, False)
    kept = copy.deepcopy(gpu_job)
    kept.parallel.reshard_after_forward = False
    kept.parallel.dp_shard, kept.training.batch_size, kept.activation_checkpoint.mode = 4, 1, "none"
    by_group = copy.deepcopy(kept)
    by_group.parallel.reshard_after_forward = 2
    need = {name: predict(c, WORLD, "cpu", 2).reserved_memory_gib * GiB + CONTEXT_BYTES
            for name, c in (("kept", kept), ("group", by_group))}
    limit = (need["kept"] + need["group"]) / 2 / GB
    reshard = auto_layout.choose(kept, WORLD, f"cpu@{limit!r}GB", 2,
                                 {**fixed, "activation_checkpoint.mode": "none",
                                  "training.cpu_offload": False}, False)
    return {"offload": offload, "reshard": reshard, "reshard_needs": need}


def test_memory_limit_only_full_ac_meets_and_fixed_batch(planner, tmp_path):
    """Under a limit between full AC's need and the others' (their predictions), the
    choice is full AC; the fixed batch (1; the free search picks 2) is kept; below full
    AC's need, the error names it as the smallest peak. Issue 48's knobs: under that
    limit a GPU job is offloaded to the CPU; an int reshard is chosen where only it fits
    (``_knob_choices``)."""
    got = planner(_choices, str(tmp_path))
    needs, chosen = got["needs"], got["chosen"]
    assert needs["full"] < min(needs["none"], needs["selective"]), needs
    assert chosen["layout"]["activation_checkpoint.mode"] == "full", chosen
    assert chosen["layout"]["training.batch_size"] == 1
    assert chosen["layout"]["parallel.pp"] == 1 and chosen["layout"]["parallel.dp_shard"] == 4
    refused = got["refused"]
    assert refused is not None and "no layout fits" in refused, refused
    assert f"smallest predicted peak is {needs['full'] / 1e9:.4f} GB" in refused, refused
    assert "ac=full" in refused and "activation_checkpoint.mode = 'full'" in refused
    # the same limit for a GPU job: CPU offload fits (a CPU job cannot offload: refused)
    offload = got["offload"]
    assert offload["layout"]["training.cpu_offload"] is True, offload
    assert offload["prediction"]["knobs"] == "offload" and offload["prediction"]["fits"]
    # reshard to a node of 2: holds half the gathered parameters a rank would keep
    need, reshard = got["reshard_needs"], got["reshard"]
    assert need["group"] < need["kept"], need
    assert reshard["layout"]["parallel.reshard_after_forward"] == 2, reshard
    assert reshard["prediction"]["knobs"] == "reshard=2"


def _refused(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    from simplefsdp.train.__main__ import main, run

    code = run(argv)
    with pytest.raises(ConfigError) as e:  # again: the answer now comes from the cache
        main(argv)
    return code, str(e.value)


def test_nothing_fits_is_a_config_error(tmp_path, monkeypatch):
    """1 GB a rank is under the 1 GiB (1.074 GB) of device context the planner reserves
    beside torch's memory: no layout fits, none is worth tracing. Exit status 78 on every
    rank before any work; the message names the floor, the knobs and the batch the
    command line fixed."""
    monkeypatch.setenv("SIMPLEFSDP_CACHE_DIR", str(tmp_path / "cache"))
    argv = [*_argv(tmp_path / "run", "--training.batch_size", "2")]
    argv[argv.index("--parallel.memory_limit_gb") + 1] = "1"
    results = run_ranks(_refused, 2, argv)
    for code, message in results:
        assert code == 78
        assert "no layout fits 2 ranks of cpu@1.0GB" in message, message
        assert "smallest predicted peak is over 1.07" in message, message
        for knob in ("more GPUs", "activation_checkpoint.mode = 'full'",
                     "a smaller training.batch_size", "training.batch_size = 2"):
            assert knob in message, (knob, message)
    assert not (tmp_path / "run" / "metrics.csv").exists()  # nothing was trained


def test_nothing_planned_names_the_failed_trace_and_the_fixed_keys():
    """When no candidate could be predicted although its memory floor is far under the
    limit (here: the debug model on a 141 GB profile), the error says the planner failed
    and why, and which keys the search kept, instead of blaming memory. With a floor over
    the limit the memory reading stays."""
    from simplefsdp.plan.auto_layout import _nothing_fits

    cfg = load_config(None, ["--parallel.dp_shard", "8"])  # a candidate: sizes resolved
    failure = "tp=8 pp=1 ac=full: RuntimeError: a trace failed"
    error = _nothing_fits([], [cfg], 8, "h200", {"parallel.dp_shard": 16}, [failure])
    assert "could be planned" in str(error) and failure in str(error), error
    assert "parallel.dp_shard = 16" in str(error) and "parallel.dp_shard = -1" in str(error)
    over = _nothing_fits([], [cfg], 8, "cpu@0.001GB", {}, [failure])
    assert "exceed it" in str(over) and "could be planned" not in str(over), over


def _traced_tp8_ring4() -> dict:
    """A model small enough to trace quickly, laid out on 2 x 2 x ring 4 x TP 8 = 128
    ranks of the planner's fake world (the 405B preset's TP 8 with CP 4)."""
    from simplefsdp.plan import predict

    cfg = load_config(None, ["--model.dim", "64", "--model.n_heads", "8", "--model.n_kv_heads",
                             "8", "--training.seq_len", "64", "--training.batch_size", "1",
                             "--parallel.dp_replicate", "2", "--parallel.dp_mode",
                             "hybrid_shard", "--parallel.tp", "8", "--parallel.cp_ring", "4",
                             "--compile.enable", "true", "--compile.backend", "aot_eager"])
    return predict(cfg, 128, "h100-sxm").to_dict()


def test_planner_traces_tp8_with_ring4(planner):
    """Traced meshes hold 2 replicas x 2 shards x CP x TP ranks: TP 8 with CP 4 needs 128
    fake ranks (the planner's fake world had 64, and such layouts failed to trace)."""
    row = planner(_traced_tp8_ring4)
    assert (row["tp"], row["cp_ring"], row["dp_replicate"]) == (8, 4, 2), row
    assert row["peak_memory_gib"] > 0 and row["tokens_per_s_per_gpu"] > 0, row
