"""The planner's search and its exact shortcuts: shard rescaling with bf16 compute (the
casts of the shards saved for backward), and the trace counts of a search.

Each trace costs a few seconds of Dynamo + AOTAutograd, so every check runs in the
session's planner process (``planner`` in conftest.py: its own fake process group, trace
caches emptied per call) and traces as little as it can.
"""

from __future__ import annotations

import functools
import os

import pytest

from simplefsdp.config.job import load_config

# The anomaly's own layout: 405B, tp 8 (sequence parallel), bf16 compute, selective AC,
# batch 2 (fake tensors: tracing costs the same at any width).
LLAMA_405B = ("configs/llama3_405b.toml", [
    "--parallel.tp", "8", "--parallel.dp_replicate", "1", "--parallel.dp_mode",
    "fully_shard", "--activation_checkpoint.mode", "selective", "--compile.bucketing",
    "manual", "--training.batch_size", "2"])


def _rescaled_vs_traced(path, overrides):
    from simplefsdp.plan.memory import graph_memory
    from simplefsdp.plan.trace import trace, trace_key

    cfg = load_config(path, overrides)
    two = trace(trace_key(cfg, "full", 1, 2, 1, 2))
    four = trace(trace_key(cfg, "full", 1, 2, 1, 4))
    return vars(graph_memory(two, 4)), vars(graph_memory(four, 4))


def test_bf16_saved_shard_casts_are_rescaled(planner):
    """With bf16 compute, selective AC saves the bf16 casts of the parameter shards for
    backward. They are shard-sized in the backward graph too, and tp 8's sequence-parallel
    reduce-scatters are not: traced at dp_shard 2 and rescaled to 4, every figure equals
    a trace at 4 (exact: the sizes divide evenly).
    Before the fix the backward counted them at the traced size: the 405B search on
    1024 GPUs (tp 8, dp_shard 128) predicted 121.8 GiB for batch 2 against 41.3 GiB for
    batch 1; with it, 72.3 vs 39.3 GiB (activations 66.0 vs 33.0: twice)."""
    rescaled, traced = planner(_rescaled_vs_traced, *LLAMA_405B)
    assert rescaled == traced


def _saved_slope(path, overrides):
    from simplefsdp.plan.memory import graph_memory
    from simplefsdp.plan.trace import trace, trace_key

    cfg = load_config(path, overrides)
    one, two = (trace(trace_key(cfg, "full", k, 1, 1, 2)) for k in (1, 2))
    return graph_memory(two, 8).saved - graph_memory(one, 8).saved


# One Llama 3 8B block (dim 4096, 32 heads of 128, 8 KV heads, FFN 14336), batch 1 x
# 8192 tokens, bf16 compute, on 8 data-parallel ranks, by hand. torchtitan's selective
# policy (ours too: parallel/activation_checkpoint.py) saves every other matmul's output
# (wq, wv, w1, w2; wk, wo and w3 are recomputed) and attention's output and logsumexp;
# the all-gathers are recomputed from the bf16 casts of the block's parameter shards,
# which are saved.
_TOKENS = 8192
_BLOCK_PARAMS = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096  # 218.1 M
_SAVED_PER_BLOCK = {
    "matmuls wq, wv, w1, w2 (bf16)": _TOKENS * (4096 + 1024 + 14336 + 4096) * 2,  # 368 MiB
    "attention output (bf16)": _TOKENS * 4096 * 2,  # 64 MiB
    "attention logsumexp (fp32, per head)": 32 * _TOKENS * 4,  # 1 MiB
    "bf16 casts of the parameter shards": _BLOCK_PARAMS * 2 // 8,  # 52 MiB
}


def test_saved_bytes_per_block_match_the_selective_policy_by_hand(planner):
    """The 1 -> 2 block growth of the saved bytes is one block's saved tensors, counted by
    hand from 8B's shapes (above: 485.0 MiB). The bf16 casts of the shards are
    shard-sized outputs of the forward, which ``graph_memory`` took for model states and
    left out before (433 MiB a block then)."""
    slope = planner(_saved_slope, "configs/llama3_8b.toml", [
        "--activation_checkpoint.mode", "selective", "--compile.bucketing", "manual"])
    expected = sum(_SAVED_PER_BLOCK.values())
    assert expected == 508_561_408  # 485.0 MiB
    # exact: every saved tensor of the block is one of these, no temporaries counted
    assert slope == expected, (slope, expected, _SAVED_PER_BLOCK)


def test_a_gather_region_decides_for_its_ops_inside_a_selective_block():
    """The casts above are saved because the gather's own checkpoint region says so
    (``data_parallel._recompute_gathers``) inside the block's selective region, whose
    policy would recompute them. torch 2.11 let the enclosing region's tag win
    (``_torch_compat.checkpoint``); traced here with ``make_fx``, on every version the
    inner region's decision is the op's tag."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.traceback import preserve_node_meta
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    from simplefsdp._torch_compat.checkpoint import selective_checkpoint_contexts

    def region(contexts, fn):
        return lambda t: checkpoint(fn, t, use_reentrant=False, preserve_rng_state=False,
                                    context_fn=contexts)

    block = functools.partial(create_selective_checkpoint_contexts,
                              lambda *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
    gather = functools.partial(selective_checkpoint_contexts,
                               lambda *a, **k: CheckpointPolicy.MUST_SAVE)
    with preserve_node_meta():
        gm = make_fx(region(block, region(gather, torch.cos)))(
            torch.ones(2, requires_grad=True))
    tags = [n.meta.get("recompute") for n in gm.graph.nodes
            if n.target is torch.ops.aten.cos.default]
    assert tags == [CheckpointPolicy.MUST_SAVE], tags


# Llama 3 8B's width (traces cost the same at any width; compute dominates the step, as
# on the real runs) with 2 blocks, on 4 GPUs of 2 per node: tp 1-2, pp 1-2, hybrid. (8
# blocks added pp 4, 4 more traces of ~2.5 CPU-s each, no property the asserts need.)
SMALL = ("configs/llama3_8b.toml", ["--model.n_layers", "2", "--compile.bucketing", "manual"])


def _keep_vs_exhaustive(path, overrides, gpus, per_node, folder):
    from simplefsdp.hardware import gpu_profile
    from simplefsdp.plan.search import layouts, search, speed_bound
    from simplefsdp.plan.trace import trace

    cfg = load_config(path, overrides)
    pruned_stats, full_stats = {}, {}
    pruned = search(cfg, gpus, "h100-sxm", per_node, keep=1, stats=pruned_stats)
    full = search(cfg, gpus, "h100-sxm", per_node, keep=0, stats=full_stats)
    # the CLI's default, --keep 3 (every graph traced by now: this adds predictions only)
    keep3_stats: dict = {}
    keep3 = search(cfg, gpus, "h100-sxm", per_node, keep=3, stats=keep3_stats)
    traces = trace.cache_info()._asdict()
    # the pruned search narrowed to one layout of each tp (pp 1, no AC, batch 1), here
    # (traced above) and in two worker processes (``_workers_search``)
    narrowed_stats: dict = {}
    narrowed = search(cfg, gpus, "h100-sxm", per_node, keep=1, stats=narrowed_stats,
                      constrain=_one_layout_per_tp)
    workers, workers_stats = _workers_search(cfg, gpus, per_node, folder)
    configs = {(c.parallel.dp_replicate, c.parallel.dp_shard, c.parallel.tp, c.parallel.pp,
                c.activation_checkpoint.mode, c.training.batch_size): c
               for c in layouts(cfg, gpus, per_node)}
    dev = gpu_profile("h100-sxm")
    bounds = [(speed_bound(configs[(r.dp_replicate, r.dp_shard, r.tp, r.pp, r.ac,
                                    r.batch_size)], gpus, dev, per_node), r.tokens_per_s_per_gpu)
              for r in full]
    rows = {"pruned": pruned, "full": full, "keep3": keep3, "narrowed": narrowed,
            "workers": workers}
    return ({k: [r.to_dict() for r in v] for k, v in rows.items()},
            {"pruned": pruned_stats, "full": full_stats, "keep3": keep3_stats,
             "narrowed": narrowed_stats, "workers": workers_stats}, bounds, traces,
            _comm_bound(cfg, dev, next(r for r in full if r.tp == r.pp == 1)),
            _knob_rows_keep(cfg, gpus, per_node),
            _floor_against_predictions(full, configs))


def _one_layout_per_tp(c):
    """``search``'s ``constrain``: pp 1, no AC, batch 1 only (one layout of each tp)."""
    kept = c.parallel.pp == 1 and c.activation_checkpoint.mode == "none" \
        and c.training.batch_size == 1
    return c if kept else None


def _tp2_layout(c):
    """``search``'s ``constrain``: ``_one_layout_per_tp``'s layout of tp 2 only."""
    return c if c.parallel.tp == 2 and _one_layout_per_tp(c) is not None else None


def _workers_search(cfg, gpus, per_node, folder) -> tuple[list, dict]:
    """The search narrowed to one layout of each tp in two worker processes (a task each:
    tp 1 and tp 2), with the planner's disk cache on in ``folder``, which holds tp 2's
    role figures (stored here first, from this process's traces): the tp 2 worker reads
    them back, the tp 1 worker traces its own graphs (not this process's cache). One
    worker tracing proves the work is not done here; the other, that workers read the
    disk cache. tp 1's speed bound is over tp 2's tokens/s (checked by the test), so the
    bar tp 2's row sets never prunes tp 1, whichever worker reports first."""
    from simplefsdp.plan.search import search

    saved = os.environ.get("SIMPLEFSDP_CACHE_DIR")
    os.environ["SIMPLEFSDP_CACHE_DIR"], os.environ["SIMPLEFSDP_PLAN_CACHE"] = folder, "1"
    try:
        search(cfg, gpus, "h100-sxm", per_node, constrain=_tp2_layout)  # stores its figures
        stats: dict = {}
        rows = search(cfg, gpus, "h100-sxm", per_node, keep=1, stats=stats, workers=2,
                      constrain=_one_layout_per_tp)
    finally:
        os.environ["SIMPLEFSDP_PLAN_CACHE"] = "0"
        if saved is None:
            del os.environ["SIMPLEFSDP_CACHE_DIR"]
        else:
            os.environ["SIMPLEFSDP_CACHE_DIR"] = saved
    return rows, stats


def _floor_against_predictions(rows, configs) -> list[tuple[float, float]]:
    """For every pair of the exhaustive search's rows (source, layout): the activation
    floor the search would derive for the layout from the source alone
    (``floors.ActivationFloor``), next to the layout's predicted active bytes."""
    from simplefsdp.hardware import GiB
    from simplefsdp.plan.floors import ActivationFloor

    def config(r):
        return configs[(r.dp_replicate, r.dp_shard, r.tp, r.pp, r.ac, r.batch_size)]

    pairs = []
    for source in rows:
        floor = ActivationFloor()
        floor.record(config(source), source)
        pairs += [(floor.active_bytes(config(r), False), r.peak_memory_gib * GiB)
                  for r in rows if r.ac == source.ac]
    return pairs


def _knob_rows_keep(cfg, gpus, per_node) -> dict:
    """``--tradeoffs`` with ``keep = 1`` against the exhaustive search, with gradient
    accumulation (each layout without PP gets a gradient-sync row), on the traces made."""
    import copy

    from simplefsdp.plan.search import search
    from simplefsdp.plan.trace import trace

    accum = copy.deepcopy(cfg)
    accum.training.grad_accum_steps = 2
    before = trace.cache_info().misses
    stats = {"pruned": {}, "full": {}}
    rows = {name: search(accum, gpus, "h100-sxm", per_node, keep=keep, stats=stats[name],
                         tradeoffs_rows=True)
            for name, keep in (("pruned", 1), ("full", 0))}
    return {"rows": {k: [r.to_dict() for r in v] for k, v in rows.items()}, "stats": stats,
            "new_traces": trace.cache_info().misses - before}


def _comm_bound(cfg, dev, row) -> dict:
    """A layout whose step the data-parallel gathers bound: the searches' best tp 1, pp 1
    row (``row``: its AC mode and batch) on 16 GPUs of one per node (all over
    InfiniBand), from the traces the searches made (dp_shard is traced at 2 and
    rescaled): its speed bound with and without the communication floor, and its
    prediction."""
    import copy

    from simplefsdp.plan.predict import predict
    from simplefsdp.plan.search import speed_bound
    from simplefsdp.plan.trace import trace

    c = copy.deepcopy(cfg)
    c.parallel.tp, c.parallel.dp_shard, c.parallel.dp_replicate = 1, 16, 1
    c.parallel.dp_mode, c.training.batch_size = "fully_shard", row.batch_size
    c.activation_checkpoint.mode = row.ac
    before = trace.cache_info().misses
    row = predict(c, 16, "h100-sxm", 1)
    return {"with_floor": speed_bound(c, 16, dev, 1), "without": speed_bound(c, 16, dev),
            "predicted": row.tokens_per_s_per_gpu,
            "new_traces": trace.cache_info().misses - before}


@pytest.fixture(scope="module")
def searches(planner, tmp_path_factory):
    """The searches of SMALL on 2 GPUs of 2 per node (tp 1 and 2, pp 1 and 2), in one
    planner call: keep 1, exhaustive, keep 3, and keep 1 in two worker processes."""
    return planner(_keep_vs_exhaustive, *SMALL, 2, 2, str(tmp_path_factory.mktemp("figures")))


def test_search_keep_prunes_by_speed_bound_and_traces_each_graph_once(searches):
    """``keep = 1`` skips the layouts whose speed bound (compute FLOPs at the roofline)
    cannot beat the best found, and gives the exhaustive search's best row; ``keep = 3``
    (the CLI's default) gives its first 3 rows; the bound holds for every layout
    predicted; layouts sharing graphs (data-parallel sizes, pipeline depth, batch sizes
    under PP) trace them once."""
    rows, stats, bounds, traces = searches[:4]
    pruned, full, keep3 = rows["pruned"], rows["full"], rows["keep3"]
    pruned_stats, full_stats, keep3_stats = stats["pruned"], stats["full"], stats["keep3"]
    # whole rows (layout, memory, speed) equal; 3 fitting rows to compare
    assert keep3[:3] == full[:3] and all(r["fits"] for r in full[:3])
    assert keep3_stats["bound"] > 0 and keep3_stats["traces"] == 0
    assert pruned[0] == full[0] and full[0]["fits"]
    assert pruned_stats["bound"] > 0 and pruned_stats["predicted"] < full_stats["predicted"]
    # the exhaustive search traced only what the pruned one skipped: sharing within and
    # across the two searches, nothing traced twice
    assert full_stats["traces"] > 0 and pruned_stats["traces"] > 0
    assert traces["misses"] == pruned_stats["traces"] + full_stats["traces"]
    assert traces["currsize"] == traces["misses"] and traces["hits"] > 0
    # every prediction asks for 2 traces (1 and 2 blocks) per pipeline role
    assert traces["hits"] + traces["misses"] >= 2 * (pruned_stats["predicted"]
                                                     + full_stats["predicted"])
    assert all(bound >= tps for bound, tps in bounds), bounds
    assert full_stats["memory"] + full_stats["fits_with_less_ac"] > 0
    # whole sequences fit here: the search never splits them (no context-parallel pass)
    assert all((r["cp_ring"], r["cp_ulysses"]) == (1, 1) for r in full + pruned), full


def test_speed_bound_counts_the_data_parallel_communication(searches):
    """Where the gathers and reductions over InfiniBand take longer than the FLOPs, the
    speed bound is their floor's (lower than the FLOPs' bound) and still holds over the
    prediction (the simulation waits for every collective), from traces already made."""
    comm = searches[4]
    assert comm["new_traces"] == 0, comm
    assert comm["with_floor"] < 0.8 * comm["without"], comm  # the floor binds here
    assert comm["predicted"] <= comm["with_floor"], comm


def test_knob_rows_keep_the_best_row_exact(searches):
    """With the knob rows (``--tradeoffs``, what ``layout = "auto"`` searches) the pruned
    search's best row, knob or not, is the exhaustive one's, and fitting knob rows raise
    the bar: fewer rows predicted."""
    got = searches[5]
    pruned, full = got["rows"]["pruned"], got["rows"]["full"]
    assert got["new_traces"] == 0
    assert any(r["knobs"] == "sync=last" for r in full), full
    assert pruned[0] == full[0] and full[0]["fits"]
    assert len(pruned) < len(full) and got["stats"]["pruned"]["bound"] > 0


def test_activation_floor_never_exceeds_a_prediction(searches):
    """The memory floor the search skips untraced layouts by (a traced layout's saved
    bytes per block, scaled down to another layout's tokens and TP ranks, on its gradless
    model states) stays under every prediction of the exhaustive search (tp 1-2, pp 1-2,
    batch 1-2, each AC mode: every source and layout of one mode), and is not empty:
    some floors reach most of the layout's prediction. Exact arithmetic on the same
    figures, so no tolerance."""
    pairs = searches[6]
    assert len(pairs) > 20, pairs
    assert all(floor <= active for floor, active in pairs), \
        [p for p in pairs if p[0] > p[1]]
    assert max(floor / active for floor, active in pairs) > 0.5, pairs


def test_activation_floor_scales_by_hand():
    """The floor's rule on one recorded block of B = 1 GiB (8B's width, 4 blocks, 8,192
    tokens a rank, tp 1, selective): a layout with twice the tokens and tp 2 keeps at
    least B x 1 x 1/2; with half the tokens (the sequence split over 2 ranks of a ring)
    B / 2; another AC mode nothing known (0). A split-sequence source bounds no
    whole-sequence layout (its gathered K/V are not sized by a rank's tokens). A stage
    holds the floor for its blocks but one, on its model states without gradients
    (12 B a parameter), or less the gradients where the states may leave the device."""
    from simplefsdp.plan import memory
    from simplefsdp.plan.floors import ActivationFloor
    from simplefsdp.plan.predict import Prediction

    def config(*extra):
        cfg = load_config("configs/llama3_8b.toml", [
            "--model.n_layers", "4", "--training.batch_size", "1", "--parallel.dp_shard", "8",
            "--activation_checkpoint.mode", "selective", *extra])
        return cfg

    def row(c, block):
        p = c.parallel
        return Prediction(p.dp_replicate, p.dp_shard, p.tp, p.pp, "selective", 1, 8192, True,
                          1, 1, 1, 1, 0.1, True, detail={"full": {
                              "block_saved_floor_bytes": block}})

    source = config()
    floor = ActivationFloor()
    floor.record(source, row(source, 2**30))
    wider = config("--training.batch_size", "2", "--parallel.tp", "2", "--parallel.dp_shard", "4")
    ring = config("--parallel.cp_ring", "2", "--parallel.dp_shard", "4")
    assert floor.block_bytes(wider) == 2**30 / 2
    assert floor.block_bytes(ring) == 2**30 / 2
    assert floor.block_bytes(config("--activation_checkpoint.mode", "full")) == 0
    split = ActivationFloor()
    split.record(ring, row(ring, 2**30))
    assert split.block_bytes(source) == 0 and split.block_bytes(ring) == 2**30
    args = source.model.model_args()
    params = memory.rank_params(args, "full", list(range(4)), source.parallel.dims(),
                                "fully_shard")
    assert floor.active_bytes(source, False) == pytest.approx(12 * params + 3 * 2**30)
    assert floor.active_bytes(source, True) == pytest.approx(-4 * params + 3 * 2**30)


def test_keep_bar_is_the_kth_best_fitting_speed():
    """The bar ``--keep K`` prunes by: the K-th best tokens/s added so far (0 until K
    rows fit), so a layout whose bound beats the K-th best is still predicted."""
    from simplefsdp.plan.search import _Bar

    bar = _Bar(3)
    for tps in (10.0, 6.0):
        bar.add(tps)
    assert not bar.beaten(1.0)  # 2 rows: any bound can still make the top 3
    bar.add(8.0)
    bar.add(3.0)  # below the 3rd: changes nothing
    assert (bar.beaten(5.9), bar.beaten(6.0), bar.beaten(7.0)) == (True, False, False)
    bar.add(9.0)  # the 3rd best is now 8
    assert (bar.beaten(7.9), bar.beaten(8.0)) == (True, False)
    assert not _Bar(0).beaten(0.0)  # keep 0: exhaustive, nothing pruned
    # seeded with rows found before (the CP pass starts from the whole-sequence rows')
    seeded = _Bar(2, seed=(5.0, 7.0, 1.0))
    assert (seeded.beaten(4.9), seeded.beaten(5.0)) == (True, False)


def test_fitting_knob_row_raises_the_bar(monkeypatch):
    """The bar ``keep = 1`` prunes by counts a fitting knob row like a layout's row: of two
    layouts (8B's width, 2 blocks, 2 GPUs a node, 2 micro-steps, a GPU job), the first
    one's own row is slower than the second's speed bound, its gradient-sync row faster;
    so the second is pruned, untraced. Without the knob row in the bar it would be
    predicted. The search's bookkeeping alone: real layouts, bounds and knob variants;
    the rows' speeds are set here (no trace), each at most its layout's bound."""
    from simplefsdp.hardware import gpu_profile
    from simplefsdp.plan import search as search_module
    from simplefsdp.plan import tradeoffs
    from simplefsdp.plan.predict import Prediction

    cfg = load_config(SMALL[0], [*SMALL[1], "--training.grad_accum_steps", "2",
                                 "--job.device", "cuda"])
    dev = gpu_profile("h100-sxm")
    pair = [c for c in search_module.layouts(cfg, 2, 2) if c.training.batch_size == 1
            and c.activation_checkpoint.mode == "none" and c.parallel.pp == 1
            and c.parallel.dp_replicate == 1]
    bounds = [search_module._prune_bound(c, 2, dev, 2, True) for c in pair]
    first, second = sorted(zip(bounds, pair, strict=True), key=lambda x: -x[0])
    assert first[0] > second[0], bounds  # tp 1 and tp 2: the second's bound is lower
    speeds = {"": 0.9 * second[0], "sync=last": (first[0] + second[0]) / 2}

    def predicted(c, gpus, gpu, gpus_per_node):
        p, knobs = c.parallel, tradeoffs.knob_label(c)
        return Prediction(p.dp_replicate, p.dp_shard, p.tp, p.pp,
                          c.activation_checkpoint.mode, c.training.batch_size,
                          c.training.seq_len, True, 1.0, 1.2, 1.0, speeds[knobs], 0.5, True,
                          knobs=knobs)

    monkeypatch.setattr(search_module, "predict", predicted)
    rows, failures, stats = search_module._search_groups(
        [[first[1]], [second[1]]], 2, "h100-sxm", 2, search_module._Bar(1),
        tradeoffs_rows=True)
    assert not failures
    assert [(r.tp, r.knobs) for r in rows] == [(first[1].parallel.tp, ""),
                                               (first[1].parallel.tp, "sync=last")], rows
    assert stats["bound"] == 1 and stats["predicted"] == 1, stats


def test_search_workers_split_by_tp(searches):
    """Two worker processes (tp 1 tracing its own graphs, tp 2 reading its figures from
    the disk cache: ``_workers_search``) find the same best row as one process, and
    report their traces; the search narrowed to one layout of each tp (a worker's trace
    costs what one in this process does, and a worker starts by importing torch)."""
    rows, stats, bounds = searches[:3]
    assert rows["narrowed"][0] == rows["workers"][0]
    assert all((r["pp"], r["ac"], r["batch_size"]) == (1, "none", 1)
               for r in rows["narrowed"] + rows["workers"]) and rows["workers"][0]["fits"]
    # tp 1's bound is over tp 2's tokens/s: the bar tp 2's row sets never prunes tp 1,
    # whichever worker takes which task first
    narrowed = {r["tp"]: (b, r["tokens_per_s_per_gpu"])
                for (b, _), r in zip(bounds, rows["full"], strict=True)
                if (r["pp"], r["ac"], r["batch_size"]) == (1, "none", 1)}
    assert narrowed[1][0] >= narrowed[2][1], narrowed
    # tp 1's 1- and 2-block graphs, traced in its worker; none for tp 2 (from disk)
    assert stats["narrowed"]["traces"] == 0 and stats["workers"]["traces"] == 2
    for name in ("pruned", "narrowed", "workers"):
        assert stats[name]["predicted"] == len(rows[name]), name

# Long sequences: the debug model (dim 128, 4 heads of 32, 2 KV heads, FFN 352) with a
# 65,536-token vocabulary at 65,536 tokens, bf16 compute, compiled, on A100s of 1 per
# node. A trace depends on neither the depth (1 and 2 blocks are traced) nor the device,
# so the searches below share their traces in one planner call (``long_searches``).
LONG_SEQUENCE = ["--model.vocab_size", "65536", "--training.seq_len", "65536",
                 "--model.max_seq_len", "65536", "--compile.enable", "true",
                 "--compile.bucketing", "manual", "--training.mixed_precision_param",
                 "bfloat16"]

# DEEP: 256 blocks on 2 A100 80 GB. By hand, per rank holding the whole sequence: the
# loss's backward holds 12 B per logit, 12 x 65,536 x 65,536 = 48 GiB; selective AC saves
# wq, wv, w1, w2 outputs and attention's (128 + 64 + 352 + 128 + 128 = 800 bf16 values a
# token a block: 25 GiB), no AC at least that plus wk, w3 (+ 64 + 352 values: 38 GiB),
# full AC each block's input (128 values: 4 GiB). Reserved (active x 1.2) + 1 GiB against
# 79.2 GiB: no AC and selective AC do not fit ((48 + 25) x 1.2 = 88 GiB), full AC does
# ((48 + 4) x 1.2 = 62 GiB, plus a block's recompute). Ring or Ulysses 2 halve the tokens
# per rank: the loss 24 GiB, no AC at least 19 GiB: it fits without recomputing anything.
DEEP = ["--model.n_layers", "256", *LONG_SEQUENCE]

# LONG: 2 blocks on 2 A100s with 40 GB usable (``a100-80gb@40GB``: 37.25 GiB). Its loss
# alone, by hand, needs the bf16 logits, their float32 copy and float32 log_softmax,
# 10 B x 65,536 x 65,536 = 40 GiB on a rank holding the whole sequence, over the 37.25
# GiB; split over 2 context-parallel ranks 20 GiB, and the backward's 12 B per logit
# 24 GiB (x 1.2 + 1 GiB: 29.8 GiB, and two blocks' activations, a few hundred MiB).
LONG = ["--model.n_layers", "2", *LONG_SEQUENCE]
LONG_GPU = "a100-80gb@40GB"


def _long_search() -> tuple[list[dict], dict, list[tuple[float, float]]]:
    from simplefsdp.hardware import gpu_profile
    from simplefsdp.plan.search import layouts, search, speed_bound

    stats: dict = {}
    cfg = load_config(None, LONG)
    rows = search(cfg, 2, LONG_GPU, 1, keep=1, stats=stats, constrain=_gathered_kv_only)
    # each row's speed bound (which ``keep`` prunes by) must hold over its prediction
    by_layout = {(c.parallel.dp_shard, c.parallel.cp_ring, c.parallel.cp_ulysses,
                  c.parallel.cp_rotate, c.activation_checkpoint.mode,
                  c.training.batch_size): c for c in layouts(cfg, 2, 1, cp=True)}
    bounds = [(speed_bound(by_layout[(r.dp_shard, r.cp_ring, r.cp_ulysses, r.cp_rotate,
                                      r.ac, r.batch_size)], 2, gpu_profile(LONG_GPU)),
               r.tokens_per_s_per_gpu) for r in rows]
    return [r.to_dict() for r in rows], stats, bounds


def _whole_then_split() -> tuple[list[dict], dict]:
    """DEEP without AC, batch 1, on 2 GPUs through the search's loop: dp_shard 2 (whole
    sequences), then ring 2 (all-gathered K/V) on the same 2 sharded ranks."""
    from simplefsdp.plan.search import _Bar, _search_groups, layouts

    cfg = load_config(None, DEEP)

    def pick(cp: bool):
        return next(c for c in layouts(cfg, 2, 1, cp=cp, ac_modes=("none",))
                    if c.training.batch_size == 1 and c.parallel.pp == 1
                    and c.parallel.dp_replicate == 1 and c.parallel.cp_ulysses == 1
                    and c.parallel.cp_rotate == "allgather")
    rows, _, stats = _search_groups([[pick(False)], [pick(True)]], 2, "a100-80gb", 1,
                                    _Bar(0))
    return [r.to_dict() for r in rows], stats


def _sharded_only(c):
    """``search``'s ``constrain`` for DEEP: dp_shard and the sequence's splits only, the
    ring's K/V all-gathered (pp 2's two stages, a replicated layout and the ring pass's
    rotation trace graphs of their own, and the asserts need none of them: the CP pass's
    AC modes follow the fitting whole-sequence rows, whichever; the search's choice
    between the two rotations is tested in tests/test_plan_context.py)."""
    return c if c.parallel.pp == 1 and c.parallel.dp_replicate == 1 \
        and c.parallel.cp_rotate == "allgather" else None


def _gathered_kv_only(c):
    """``search``'s ``constrain`` for LONG: the ring's K/V all-gathered, as DEEP's search
    traced them (the ring pass's graphs would be new traces)."""
    return c if c.parallel.cp_rotate == "allgather" else None


def _long_searches() -> dict:
    """DEEP's search (keep 1, 2 A100 80 GB of 1 per node, ``_sharded_only``), the too-big
    skip's case on DEEP's layouts, and LONG's search, in that order in one process: the
    later two reuse DEEP's traces (each one's count of new traces is returned with it)."""
    from simplefsdp.plan.search import search
    from simplefsdp.plan.trace import trace

    stats: dict = {}
    rows = search(load_config(None, DEEP), 2, "a100-80gb", 1, keep=1, stats=stats,
                  constrain=_sharded_only)
    out = {"deep": ([r.to_dict() for r in rows], stats)}
    for name, fn in (("too_big", _whole_then_split), ("long", _long_search)):
        before = trace.cache_info().misses
        out[name] = (*fn(), trace.cache_info().misses - before)
    return out


@pytest.fixture(scope="module")
def long_searches(planner):
    return planner(_long_searches)


def test_search_splits_a_sequence_that_fits_no_rank_whole(long_searches):
    """LONG: nothing with cp = 1 fits (the loss by hand, above): the search runs again
    over the CP layouts and picks cp 2 (ring or Ulysses); the cp = 1 layouts are refused
    untraced by their model states + loss floor, so every row predicted has cp 2."""
    from simplefsdp.hardware import gpu_profile

    rows, stats, bounds, _ = long_searches["long"]
    assert all(bound >= tps for bound, tps in bounds), bounds
    gib = 2**30
    # cp = 1: the loss alone over the device
    assert 10 * 65536 * 65536 == 40 * gib > gpu_profile(LONG_GPU).memory_bytes == 40e9
    best = rows[0]
    assert best["fits"] and best["cp_ring"] * best["cp_ulysses"] == 2, best
    assert all(r["cp_ring"] * r["cp_ulysses"] == 2 for r in rows), rows
    # the row holds at least its loss's backward, 12 B x 32,768 x 65,536 = 24 GiB
    assert best["peak_memory_gib"] * gib >= 12 * 32768 * 65536, best
    assert stats["memory"] > 0 and stats["predicted"] == len(rows)


def test_search_weighs_cp_layouts_that_fit_with_less_recomputation(long_searches):
    """DEEP (dp_shard or the sequence split, ``_sharded_only``): whole sequences fit only
    with recomputation (above, by hand), so the search's context-parallel pass runs with
    the AC modes that recompute less than every fitting whole-sequence row: cp 2 without
    AC does the forward once (full AC runs it twice: matmuls 4 passes instead of 3,
    attention's forward again) for the ring's K/V in transit (16 MiB a block over
    InfiniBand), and is the best row. CP rows recompute less than any fitting
    whole-sequence row (the same AC would only add communication)."""
    rows, stats = long_searches["deep"]
    order = {"none": 0, "selective": 1, "full": 2}
    whole = [r for r in rows if r["fits"] and r["cp_ring"] * r["cp_ulysses"] == 1]
    split = [r for r in rows if r["cp_ring"] * r["cp_ulysses"] > 1]
    assert whole and all(r["ac"] != "none" for r in whole), whole
    assert split and all(order[r["ac"]] < min(order[w["ac"]] for w in whole)
                         for r in split), split
    best = rows[0]
    assert best["fits"] and best["cp_ring"] * best["cp_ulysses"] == 2 and best["ac"] == "none"
    assert best["tokens_per_s_per_gpu"] > max(r["tokens_per_s_per_gpu"] for r in whole)
    # the loss alone by hand: whole sequence 48 GiB, half of it at cp 2
    gib = 2**30
    assert all(r["peak_memory_gib"] * gib >= 12 * 65536**2 for r in whole), whole
    assert best["peak_memory_gib"] * gib >= 12 * 32768 * 65536, best
    assert stats["predicted"] == len(rows)


def test_too_big_skip_keeps_layouts_splitting_the_sequence_more_ways(long_searches):
    """DEEP without AC, batch 1, on 2 GPUs: dp_shard 2 holds whole sequences on its 2
    sharded ranks (the loss 48 GiB + at least 38 GiB of activations: does not fit, above);
    ring 2 has the same 2 sharded ranks but 32,768 tokens a rank (24 + at least 19 GiB,
    x 1.2 + 1 GiB under 79.2 GiB: fits). The too-big skip (same tp, pp, AC and K/V
    rotation, no smaller batch, no more sharded ranks) must not skip ring 2 after
    dp_shard 2 failed: it splits the sequence more ways. Both layouts were traced by
    DEEP's search (no new trace)."""
    rows, stats, new_traces = long_searches["too_big"]
    assert [(r["dp_shard"], r["cp_ring"], r["fits"]) for r in rows] == [
        (2, 1, False), (1, 2, True)], rows
    assert stats["memory"] == 0 and stats["predicted"] == 2
    assert new_traces == 0


# A small job whose traces are cheap: the debug model's 2 blocks, 64 tokens, on 2 GPUs,
# compiled (an eager job's figures also replay its step, once per shard count).
TINY = ["--model.n_layers", "2", "--training.seq_len", "64", "--job.device", "cuda",
        "--compile.enable", "true"]


def _figures_from_disk(folder: str) -> dict:
    """Predictions with the planner's disk cache on (in ``folder``): the first one traces
    and stores its role figures; predictions that differ in one input of the figures
    (the node size, the device, the GPU count: the traces are shared, the figures not)
    with the cache on and off; the first one again with the traces forgotten (read back
    from disk) and with another memory limit (the figures do not depend on it)."""
    from simplefsdp.plan.predict import predict
    from simplefsdp.plan.trace import trace

    os.environ["SIMPLEFSDP_CACHE_DIR"] = folder
    cfg = load_config(None, TINY)

    def run(gpus, gpu, per_node, cached=True):
        os.environ["SIMPLEFSDP_PLAN_CACHE"] = "1" if cached else "0"
        before = trace.cache_info().misses
        row = predict(cfg, gpus, gpu, per_node).to_dict()
        return row, trace.cache_info().misses - before

    out = {"cold": run(2, "h100-sxm", 2)}
    for name, inputs in {"node": (2, "h100-sxm", 1), "device": (2, "a100-80gb", 2),
                         "gpus": (4, "h100-sxm", 2)}.items():
        out[name] = (run(*inputs), run(*inputs, cached=False))
    trace.cache_clear()
    out["warm"] = run(2, "h100-sxm", 2)
    out["limit"] = run(2, "h100-sxm@1GB", 2)
    return out


def test_role_figures_come_back_from_disk_for_the_same_inputs_only(planner, tmp_path):
    """The disk cache gives a prediction back bit for bit without tracing; an input of
    the figures that changes (node size, device speeds, the layout's sizes) is a miss,
    computed afresh (equal to the prediction with the cache off, unlike the first)."""
    got = planner(_figures_from_disk, str(tmp_path))
    cold, traces = got["cold"]
    assert traces == 2  # one role, 1 and 2 blocks
    for name in ("node", "device", "gpus"):
        (cached, _), (fresh, _) = got[name]
        assert cached == fresh, name
        assert (cached["step_time_s"], cached["peak_memory_gib"]) != \
            (cold["step_time_s"], cold["peak_memory_gib"]), name
    warm, traces = got["warm"]
    assert traces == 0 and warm == cold
    limit, traces = got["limit"]
    assert traces == 0 and not limit["fits"] and cold["fits"]
    assert {**limit, "fits": True, "gpu": "h100-sxm"} == cold
    assert len(list((tmp_path / "figures").glob("*.json"))) == 4  # cold, node, device, gpus
