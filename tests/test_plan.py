"""The planner: real traces of small configs, a measured 2-rank run, the published runs.

Tolerances are stated next to each check; they are what the model reaches, not goals.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from rank_runner import run_ranks

from simplefsdp.config.job import load_config
from simplefsdp.plan import predict

DEBUG = ["--compile.enable", "true", "--compile.backend", "aot_eager",
         "--compile.bucketing", "manual", "--training.batch_size", "4",
         "--training.seq_len", "64"]


def _measured_peak(rank, world, overrides):
    """Model states held between steps + the profiled transient peak of one step."""
    import dataclasses

    import simplefsdp
    from simplefsdp.bench.measure import held_bytes, least_transient
    from simplefsdp.models.llama_family import build_model
    from simplefsdp.optim import build_optimizer
    from simplefsdp.parallel.tensor import token_loss_sum

    cfg = load_config(None, overrides)
    p = cfg.parallel.resolve(world)
    cfg = dataclasses.replace(cfg, parallel=p)
    mesh = simplefsdp.make_mesh(dp_shard=p.dp_shard, device_type="cpu")
    runnable, model = build_model(cfg, mesh, p.dims(), torch.device("cpu"))
    optimizer, _ = build_optimizer(model, cfg)
    t = cfg.training
    x = torch.randint(0, 256, (t.batch_size, t.seq_len))

    def step():
        loss = token_loss_sum(runnable(x), x) / x.numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    step()  # compile, optimizer state
    held = held_bytes(model, optimizer)
    return held + least_transient(step, torch.device("cpu"))


# Eager without AC (batch 4, 64 tokens, 2 ranks) is the benchmark's "simplefsdp-eager"
# job: test_bench_predicted_column_matches_the_measured_peak compares the planner's
# prediction for it with the same measurement (held state + the least transient of the
# profiled steps) under the same 10%, so it is not measured again here.
@pytest.mark.parametrize("ac,compiled", [("none", "true"), ("selective", "true"),
                                         ("full", "false")])
def test_debug_model_memory_matches_a_measured_two_rank_run(planner, ac, compiled):
    # Compiled runs use Inductor, whose code frees each saved activation after its last
    # use in backward, as the planner's liveness does; aot_eager's boxed backward keeps
    # its whole argument list (every saved activation) alive until it returns.
    backend = ["--compile.backend", "inductor"] if compiled == "true" else []
    overrides = DEBUG + ["--activation_checkpoint.mode", ac, "--compile.enable", compiled] \
        + backend
    measured = max(run_ranks(_measured_peak, 2, overrides))
    predicted = planner(predict, load_config(None, overrides), 2, "h100-sxm")
    active = predicted.peak_memory_gib * 2**30
    # 10%: the goal. The profiler sees torch's CPU allocations only (the least
    # of 3 profiled steps: a missed free only adds); the prediction is liveness over the
    # same compiled graphs plus the eager loss, or (eager) the same eager step replayed
    # on fake tensors, eager resharding and the gradients' arrival included. Reached:
    # compiled (Inductor) none -2.2%, selective -9.3%; eager full -1.3% (eager none -1.0%:
    # the benchmark's test).
    # Compiled selective AC is bounded at 15%: Inductor's partitioner chooses what to
    # save on Inductor's own decompositions, the planner's trace uses aot_eager's.
    tolerance = 0.15 if (ac, compiled) == ("selective", "true") else 0.10
    print(f"predicted {active / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB")
    assert abs(active - measured) / measured < tolerance, (active, measured)


# Published runs, Llama 3.1 8B on 8 H100 (96 GB HBM2e), seq 8192, bf16 compute:
# SimpleFSDP paper Table 3 (eager, batch 1) and torchtitan (FSDP, selective AC, batch 2).
PUBLISHED = [  # (ac, batch, compile, tokens/s per GPU, reserved GiB)
    ("none", 1, False, 46936 / 8, 91.91),
    ("full", 1, False, 38504 / 8, 29.80),
    ("selective", 2, False, 5762, 82.4),
    ("selective", 2, True, 6667, 77.0),
]
# Reached (issue goals 20% tokens/s, 15% reserved memory), in PUBLISHED's order:
# tokens/s -7.3%, +0.1%, -7.4%, +9.5%; reserved -1.8%, +1.5%, -3.5%, -0.4% (+5.4% while
# the compiled peaks counted gradients before the step's first backward made any).
# Reserved is the active peak x (1 + predict.ALLOC_OVERHEAD), that one constant fitted
# to these runs: the memory check tests the spread of the four active peaks around one
# ratio and their order, not the constant. The bounds keep a few points over the worst
# so a small cost-model change does not flip them. The compiled selective row counts the
# bf16 casts of the shards its forward saves for backward; torchtitan's FSDP2 run, the
# published figure, saves no such casts (1.625 GiB a rank here).
TOKENS_TOL = 0.12
MEMORY_TOL = 0.08

# torchtitan's graph trainer, Llama 3 8B on 8 H100 (96 GB: 52.44 GiB is 55% there),
# FSDP 8, full recompute, local batch 2 (torchtitan's 8B default), seq 8192 (its
# pytorch/torchtitan#3429): 7,006 tokens/s, 32.07 GiB reserved.
GRAPH_TRAINER_FULL = ("full", 2, True, 7006, 32.07)
# Its memory is not comparable with ours: that trainer compiles the loss with the step,
# ours computes the cross-entropy eagerly in float32 on the compiled model's bf16
# logits: log_softmax, its gradient and the float32 logits' gradient, 12 B per logit,
# 12 x 2 x 8192 x 128,256 B = 23.48 GiB active at this batch (plan.memory.loss_peaks),
# which our prediction (48.84 GiB reserved) holds and the published run does not.


def test_published_runs(planner):
    rows = []
    for ac, batch, compiled, _, _ in PUBLISHED:
        cfg = load_config("configs/llama3_8b.toml", [
            "--activation_checkpoint.mode", ac, "--training.batch_size", str(batch),
            "--compile.enable", str(compiled).lower(), "--compile.bucketing", "manual"])
        rows.append(planner(predict, cfg, 8, "h100-96gb"))
    for (ac, _, compiled, tps, gib), r in zip(PUBLISHED, rows, strict=True):
        assert abs(r.tokens_per_s_per_gpu - tps) / tps < TOKENS_TOL, (ac, compiled, r)
        assert abs(r.reserved_memory_gib - gib) / gib < MEMORY_TOL, (ac, compiled, r)
    # the order of the configurations is kept
    assert rows[0].tokens_per_s_per_gpu > rows[1].tokens_per_s_per_gpu
    assert rows[0].reserved_memory_gib > rows[1].reserved_memory_gib
    assert rows[3].tokens_per_s_per_gpu > rows[2].tokens_per_s_per_gpu
    # The selective rows' memory order as published (compiled 77.0 under eager 82.4 GiB;
    # predicted 76.67 under 79.52). Before the compiled peaks left out the gradients
    # that do not exist yet, the order held only with the casts torchtitan does not save
    # taken out of the compiled row (1.625 GiB by hand).
    assert rows[3].reserved_memory_gib < rows[2].reserved_memory_gib, (rows[2], rows[3])
    # Compiled full recompute (issue 27): tokens/s within the same tolerance (reached
    # -5.6%, the recomputed attention costed), and its reserved memory under the
    # compiled selective row's, as published
    # (32.07 < 77.0 GiB; predicted 48.84 < 76.67); not its GiB (see GRAPH_TRAINER_FULL).
    ac, batch, compiled, tps, _ = GRAPH_TRAINER_FULL
    full = planner(predict, load_config("configs/llama3_8b.toml", [
        "--activation_checkpoint.mode", ac, "--training.batch_size", str(batch),
        "--compile.enable", str(compiled).lower(), "--compile.bucketing", "manual"]),
        8, "h100-96gb")
    assert abs(full.tokens_per_s_per_gpu - tps) / tps < TOKENS_TOL, full
    assert full.reserved_memory_gib < rows[3].reserved_memory_gib, (full, rows[3])
    assert full.fits


def _cli_main(argv: list[str]) -> int:
    from simplefsdp.plan.__main__ import main

    return main(argv)


def test_cli_json_fields(planner, tmp_path):
    """The planner's command line (its ``main``, in the session's planner process: a
    fresh interpreter would import torch again; ``python -m simplefsdp.plan`` itself
    runs in test_cli_bad_input_is_named) writes one JSON row with every field."""
    out = tmp_path / "plan.json"
    code = planner(_cli_main, ["--gpus", "4", "--gpu", "a100-80gb", "--json", str(out),
                               "--parallel.tp", "2", "--training.seq_len", "64"])
    assert code == 0
    (row,) = json.loads(out.read_text())
    for key in ("dp_replicate", "dp_shard", "tp", "pp", "ac", "batch_size", "seq_len",
                "compile", "peak_memory_gib", "reserved_memory_gib", "step_time_s",
                "tokens_per_s_per_gpu", "mfu", "fits"):
        assert key in row
    assert (row["dp_shard"], row["tp"], row["seq_len"]) == (2, 2, 64)
    assert row["fits"] and 0 < row["mfu"] < 1


@pytest.mark.quick
def test_cli_bad_input_is_named():
    run = subprocess.run([sys.executable, "-m", "simplefsdp.plan", "--gpus", "8",
                          "--gpu", "h100"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "h100-sxm" in run.stderr


def _rescaled_vs_traced(overrides):
    from simplefsdp.plan.memory import graph_memory
    from simplefsdp.plan.trace import trace, trace_key

    cfg = load_config(None, overrides)
    two = trace(trace_key(cfg, "full", 2, 4, 1, 2))
    four = trace(trace_key(cfg, "full", 2, 4, 1, 4))
    return vars(graph_memory(two, 4)), vars(graph_memory(four, 4))


@pytest.mark.quick
@pytest.mark.parametrize("compiled", ["false", "true"])
def test_shard_rescaling_matches_a_trace_at_that_size(planner, compiled):
    overrides = ["--compile.enable", compiled, "--compile.bucketing", "manual",
                 "--training.seq_len", "64", "--training.batch_size", "4"]
    rescaled, traced = planner(_rescaled_vs_traced, overrides)
    assert rescaled == traced  # exact: shard sizes divide evenly here


@pytest.mark.quick
def test_layouts_cover_the_gpus():
    from simplefsdp.plan.search import layouts

    cfg = load_config(None, [])
    seen = set()
    for c in [*layouts(cfg, 16, 8), *layouts(cfg, 16, 8, cp=True)]:
        p = c.parallel
        assert p.dp_replicate * p.dp_shard * p.cp_ring * p.cp_ulysses * p.tp * p.pp == 16
        assert p.tp <= 8
        seen.add((p.dp_replicate, p.dp_shard, p.tp, p.pp, p.cp_ring, p.cp_ulysses))
    assert {(1, 16, 1, 1, 1, 1), (1, 2, 8, 1, 1, 1), (2, 8, 1, 1, 1, 1), (1, 1, 4, 4, 1, 1),
            (1, 2, 1, 1, 8, 1), (1, 1, 1, 1, 4, 4), (1, 1, 1, 1, 16, 1)} <= seen
    # the debug model's 4 heads split over Ulysses 4 at most (by tp x Ulysses with tp)
    assert max(u * tp for _, _, tp, _, _, u in seen if u > 1) == 4
    assert max(r * u for *_, r, u in seen) == 16
    # a 24-token sequence splits into 2 x cp chunks for cp 4 at most (not 8: 16 chunks)
    short = load_config(None, ["--training.seq_len", "24"])
    assert max(c.parallel.cp_ring * c.parallel.cp_ulysses
               for c in layouts(short, 16, 8, cp=True)) == 4
    # without cp the sequence is never split, with it always
    assert all(c.parallel.dims().cp == 1 for c in layouts(cfg, 16, 8))
    assert all(c.parallel.dims().cp > 1 for c in layouts(cfg, 16, 8, cp=True))


def test_bench_variants_map_to_trainer_jobs():
    from simplefsdp.plan.bench import bench_job

    model = load_config(None, []).model
    eager = bench_job("simplefsdp-eager", model, 4, 64)
    ordered = bench_job("simplefsdp-reordering", model, 4, 64)
    assert not eager.compile.enable and eager.activation_checkpoint.mode == "none"
    assert (ordered.compile.enable, ordered.compile.bucketing, ordered.compile.reordering) \
        == (True, "manual", True)
    assert (ordered.training.batch_size, ordered.training.seq_len) == (4, 64)
    assert bench_job("fsdp2-eager", model, 4, 64) is None


def test_bench_predicted_column_matches_the_measured_peak(tmp_path):
    """``python -m simplefsdp.bench`` on 2 gloo ranks: its "pred. MiB" column (the
    planner) against its measured "peak MiB" for one variant of the debug model (the
    compiled predictions are checked against a measured run above)."""
    variant = "simplefsdp-eager"
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        env.pop(var, None)
    run = subprocess.run(
        [sys.executable, "-m", "simplefsdp.bench", "--bench.output_dir", str(tmp_path),
         "--world-size", "2", "--training.seq_len", "64", "--training.batch_size", "4",
         "--bench.warmup", "3", "--bench.steps", "1", "--compile.backend", "aot_eager",
         "--variants", variant], cwd=root, env=env, capture_output=True, text=True,
        timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pred. MiB" in run.stdout
    (out,) = tmp_path.iterdir()
    (row,) = json.loads((out / "results.json").read_text())["variants"]
    predicted, measured = row["predicted_peak_mib"], row["peak_mem_mib"]
    # 10%: the goal for the benchmark column (same model, batch and ranks).
    assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


def _tp_pp_last_stage():
    from simplefsdp.plan.eager import eager_memory
    from simplefsdp.plan.trace import trace, trace_key

    cfg = load_config(None, ["--parallel.tp", "2", "--parallel.pp", "2",
                             "--training.seq_len", "32", "--training.batch_size", "2"])
    tr = trace(trace_key(cfg, "last", 1, 2, 1, 2))
    vals = [n.meta.get("val") for n in tr.forward.graph.nodes if n.op == "placeholder"]
    inputs = [v for v in vals if isinstance(v, torch.Tensor) and v.dim() == 3]
    out = next(n for n in tr.forward.graph.nodes if n.op == "output").args[0][0]
    # the eager replay of the same stage takes the same input (its loss needs logits for
    # exactly seq tokens, so a whole-sequence input, gathered to 2 x seq, fails there)
    eager = eager_memory(trace_key(load_config(None, [
        "--parallel.tp", "2", "--parallel.pp", "2", "--training.seq_len", "32",
        "--training.batch_size", "2", "--compile.enable", "false"]), "last", 1, 2, 1, 2))
    return [tuple(v.shape) for v in inputs], tuple(out.meta["val"].shape), \
        cfg.model.model_args().dim, eager.peak


def test_tp_pp_last_stage_takes_sequence_sharded_hidden_states(planner):
    """Under TP + sequence parallel a pipeline stage receives its TP rank's piece of the
    sequence: the last stage of tp 2 x pp 2 is traced on (batch, seq / 2, dim) (traced
    on the whole sequence, its all-gather doubled it: "could not trace" in the search)
    and returns logits for the whole sequence."""
    inputs, logits, dim, eager_peak = planner(_tp_pp_last_stage)
    hidden = [shape for shape in inputs if shape[-1] == dim]  # not the RoPE table
    assert hidden == [(2, 16, dim)], inputs
    assert logits[:2] == (2, 32), logits
    assert eager_peak > 0


def test_eager_reshard_recognises_fake_tensors():
    """The planner replays the eager step on fake tensors: eager resharding must drop a
    saved view of a fake gathered parameter (packed as a re-gather recipe) as it does a
    real one, and keep a fake tensor that is not a gathered copy."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from simplefsdp import eager_reshard

    with FakeTensorMode():
        full, shard, other = torch.empty(8, 4), torch.empty(4, 4), torch.empty(8, 4)
        eager_reshard.start_forward()
        try:
            eager_reshard.note_gathered(full, shard, lambda s: torch.cat([s, s]))
            packed = eager_reshard._pack(full.t())
            kept = eager_reshard._pack(other)
        finally:
            eager_reshard.end_forward()
        assert isinstance(packed, eager_reshard._Regather) and packed.sharded is shard
        assert kept is other
        regathered = eager_reshard._unpack(packed)
        assert regathered.shape == (4, 8) and regathered.stride() == (1, 4)


def _full_ac_saved() -> list[int]:
    from simplefsdp.plan.memory import graph_memory
    from simplefsdp.plan.trace import trace, trace_key

    cfg = load_config(None, ["--compile.enable", "true", "--compile.bucketing", "manual",
                             "--activation_checkpoint.mode", "full",
                             "--training.seq_len", "64", "--training.batch_size", "4"])
    return [graph_memory(trace(trace_key(cfg, "full", k, 4, 1, 2)), 2).saved for k in (1, 2)]


def test_compiled_full_ac_saves_only_block_inputs(planner):
    """Issue 27: the planner's compiled full-AC trace recomputes. Per block, its forward
    saves for backward exactly the block's input: batch 4 x seq 64 x dim 128 x 4 B
    (float32) = 131,072 B, by hand (without AC the same trace saves 2,136,064 B per
    block). The saved bytes grow by that from the 1- to the 2-block trace."""
    saved = planner(_full_ac_saved)
    assert saved[1] - saved[0] == 4 * 64 * 128 * 4, saved


def _loss_time_bytes() -> dict:
    """The eager tracker (``plan.eager``) on the trainer's loss over real bf16 logits of
    2 x 32 tokens x 1,000 vocabulary columns (under loss parallel a TP 2 rank's 500, a
    DTensor made by ``from_local`` as the vocabulary-parallel output projection makes it):
    {loss parallel: (forward peak, step peak, planner's loss_peaks, local logits)}."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from simplefsdp.parallel.tensor import loss_context, token_loss_sum
    from simplefsdp.plan.eager import _Tracker, peak_of
    from simplefsdp.plan.memory import loss_peaks
    from simplefsdp.plan.trace import ensure_fake_world

    ensure_fake_world()
    mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size() // 2, 2),
                                             mesh_dim_names=("dp", "tp"))["tp"]
    out = {}
    for sharded in (True, False):
        vocab = 1000 // 2 if sharded else 1000
        hidden = torch.randn(64, 16, dtype=torch.bfloat16)
        head = torch.randn(16, vocab, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, vocab, (2, 32))
        tracker = _Tracker(set(), set())
        with tracker, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
                loss_context(sharded):
            logits = (hidden @ head).view(2, 32, vocab)
            if sharded:
                logits = DTensor.from_local(logits, mesh, [Shard(-1)])
            loss = token_loss_sum(logits, targets)
            del logits  # the trainer drops the logits with the loss's forward
            forward_end = len(tracker.events)
            loss.backward()
            del loss
        forward = peak_of(tracker.events[:forward_end], set())[0]
        out[sharded] = (forward, peak_of(tracker.events, set())[0],
                        loss_peaks(64, vocab, 2, sharded), 64 * vocab)
    return out


def test_loss_time_peak_by_hand(planner):
    """Issue 27's compiled transient is the eager cross-entropy on bf16 logits; its bytes
    per logit, counted by hand from the ops torch runs (``aten`` kernels without loss
    parallel; torch's DTensor handlers in ``tensor/parallel/loss.py`` with it):
    plain: forward logits 2 + float32 copy 4 + log_softmax 4 = 10, backward log_softmax 4
    + nll_loss_backward 4 + _log_softmax_backward_data 4 = 12; loss parallel: forward
    2 + 4 + the shifted logits 4 + their exp 4 = 14, backward the saved log_softmax x 4 +
    zeros_like(x) 4 + exp(x) or the sum 4 + the product by the gradient 4 = 16 (the same
    as torch.profiler's CPU allocator events on these ops, checked once). Both the eager
    replay's tracker (which counted 8 in backward before: DTensor's handlers ran out of
    its sight) and the compiled prediction's ``loss_peaks`` (12 before) must give them.
    Tolerance: the per-token vectors (targets, aranges, masks, maxima, sums) sit on top of
    the logit terms, under 64 B per token (4 KiB here; one logit term is 32 or 64 KB)."""
    got = planner(_loss_time_bytes)
    for sharded, (forward, backward) in {True: (14, 16), False: (10, 12)}.items():
        measured_fw, measured, planned, n = got[sharded]
        assert planned == (forward * n, backward * n), (sharded, planned, n)
        assert 0 <= measured_fw - forward * n < 64 * 64, (sharded, measured_fw / n)
        assert 0 <= measured - backward * n < 64 * 64, (sharded, measured / n)
