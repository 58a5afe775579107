"""The float8 all-gather (``simplefsdp/float8_gather.py``) with tensor parallelism, and on Inductor.

* FSDP 2 x TP 2 (4 gloo ranks): a column-wise then a row-wise float8 linear, and a last
  one TP leaves whole, their weights gathered in float8 over the data-parallel dim. Each
  weight's scale is agreed over every rank holding a piece of it (the DP and the TP
  group; DP alone for the last), so a rank's float8
  shard is exactly that slice of the whole weight's cast: the run equals the same run
  gathering high precision **bitwise** (the same float8 operands reach the same
  matmuls; the gradients' reduce-scatter sums two ranks and halves, exact), and equals
  one process within ``test_float8.TP_TOL`` (the row-wise layer's two-piece sum). The
  gathers move the float8 bytes: counted from the collectives eager mode issues and
  from the compiled graphs.
* Inductor: the compiled float8 gather (2 ranks, the toy, ``test_float8``'s parity run)
  against aot_eager.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from rank_runner import run_ranks
from test_float8 import (
    STEPS,
    TP_HIDDEN,
    TP_IN,
    TP_OUT,
    TP_TOL,
    _capturing_backend,
    _CollectiveLog,
    _full,
    _parity_runs,
    _tp_train,
)

import simplefsdp as sf

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

DP, TP = 2, 2
# (float8 all_gather, backend): the high-precision gather (the run to equal), the float8
# gather eager and compiled
TP_CASES = ((False, None), (True, None), (True, "aot_eager"))


def _tp_model(all_gather: bool) -> torch.nn.Sequential:
    """``test_float8._tp_model`` (same seed, shapes and conversion) with ``all_gather``,
    plus a last float8 linear that TP leaves whole (sharded over DP only): its amax is
    agreed over DP alone, next to the TP-split weights agreed over both groups."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(TP_IN, TP_HIDDEN, bias=False),
                                torch.nn.Tanh(),
                                torch.nn.Linear(TP_HIDDEN, TP_OUT, bias=False),
                                torch.nn.Linear(TP_OUT, TP_OUT, bias=False))
    return sf.convert_to_float8(model, recipe="tensorwise", all_gather=all_gather, exclude=[])


def _tp_reference() -> tuple[list[float], dict]:
    """One process, every DP part's batch in turn (``test_float8._tp_reference``'s
    scheme), on one thread as the ranks run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _tp_model(False)  # all_gather acts only under data_parallel
        losses = _tp_train(model, model, list(range(DP)), DP)
        return losses, {k: _full(v) for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _graph_gathers(graphs) -> dict[str, dict[torch.dtype, int]]:
    """All-gather bytes (full tensors) by dtype of each compiled graph."""
    out: dict[str, dict[torch.dtype, int]] = {}
    for name, collectives in graphs:
        by_dtype = out.setdefault(name, {})
        for c in collectives:
            if c["kind"] == "all_gather":
                by_dtype[c["dtype"]] = by_dtype.get(c["dtype"], 0) + c["bytes"]
    return out


def _tp_gather_runs(rank: int, world: int) -> list[dict]:
    """Each of TP_CASES on FSDP 2 x TP 2: losses, whole state, the collectives of the
    eager runs (kind, dtype, bytes) and the compiled graphs' all-gather bytes."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = sf.make_mesh(dp_shard=DP, tp=TP)
    out = []
    for all_gather, backend in TP_CASES:
        model = parallelize_module(_tp_model(all_gather), mesh["tp"],
                                   {"0": ColwiseParallel(), "2": RowwiseParallel()})
        sf.data_parallel(model, mesh["dp_shard"])
        forward, graphs, log = model, [], _CollectiveLog()
        if backend is not None:  # a dispatch-mode log cannot run under compile
            torch._dynamo.reset()
            compiler, graphs = _capturing_backend()
            forward = torch.compile(model, fullgraph=True, backend=compiler)
            log = contextlib.nullcontext()
        with log:
            losses = _tp_train(model, forward, [mesh["dp_shard"].get_local_rank()], 1)
        loss = torch.tensor(losses) / DP
        torch.distributed.all_reduce(loss, group=mesh["dp_shard"].get_group())
        out.append({"losses": loss.tolist(),
                    "state": {k: _full(v) for k, v in model.state_dict().items()},
                    "eager": getattr(log, "records", None), "graphs": _graph_gathers(graphs)})
    return out


# This rank's TP pieces, gathered whole over DP: the column-wise weight's (TP_HIDDEN / 2,
# TP_IN) = (16, 16), the row-wise weight's (TP_OUT, TP_HIDDEN / 2) = (8, 16) and the
# whole last weight (8, 8): 448 elements, one byte each in float8, four in float32.
LAST = TP_OUT * TP_OUT
TP_PIECES = TP_HIDDEN // TP * TP_IN + TP_OUT * TP_HIDDEN // TP + LAST


@pytest.mark.quick
def test_float8_gather_with_tp_equals_the_bf16_gather_and_one_process():
    runs = run_ranks(_tp_gather_runs, DP * TP)
    ref_losses, ref_state = _tp_reference()
    assert TP_PIECES == 448
    for rank_runs in runs:
        plain, eager8, compiled8 = rank_runs
        for name, run in (("eager", eager8), ("aot_eager", compiled8)):
            # the same scale and the same float8 operands as the high-precision gather
            assert run["losses"] == plain["losses"], name
            for key, value in plain["state"].items():
                assert torch.equal(run["state"][key], value), f"{name}: {key}"
            torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses),
                                       rtol=TP_TOL, atol=TP_TOL, msg=name)
            for key, value in ref_state.items():
                torch.testing.assert_close(run["state"][key], value, rtol=TP_TOL, atol=TP_TOL,
                                           msg=f"{name}: {key}")
        # eager: the float8 gather runs in forward and again in backward (the matmul
        # saves the gathered float8 weight, freed after forward); the float32 gather
        # only in forward (its matmul saves its own float8 cast, not the gathered weight)
        gathers8 = [(d, b) for k, d, b in eager8["eager"] if k == "all_gather"]
        gathers32 = [(d, b) for k, d, b in plain["eager"] if k == "all_gather"]
        assert sum(b for _, b in gathers8) == STEPS * 2 * TP_PIECES
        assert {d for d, _ in gathers8} == {torch.uint8}
        assert sum(b for _, b in gathers32) == STEPS * 4 * TP_PIECES
        # the step's first collectives: the 3 weights' amaxes, stacked, agreed over the
        # DP group (3 float32), then the 2 TP-split ones' over the TP group (2 float32)
        reduces = [(k, b) for k, _, b in eager8["eager"] if k != "all_gather"]
        assert reduces[:2] == [("all_reduce", 12), ("all_reduce", 8)], reduces[:4]
        # compiled: forward's gathers and backward's recomputed ones, float8 bytes only.
        # Backward needs the row-wise piece (8 x 16) and the last weight for dX; the
        # column-wise layer's input is the model input (no dX): not gathered again
        graphs = compiled8["graphs"]
        assert graphs["forward"] == {torch.uint8: TP_PIECES}, graphs
        assert graphs["backward"] == {torch.uint8: TP_OUT * TP_HIDDEN // TP + LAST}, graphs


def test_config_accepts_the_float8_gather_with_tp():
    """``float8.all_gather = true`` with ``parallel.tp = 2`` (refused before it was built)."""
    from simplefsdp.config.job import load_config

    cfg = load_config(None, ["--float8.enable", "true", "--parallel.tp", "2",
                             "--parallel.dp_shard", "2"], world_size=4)
    cfg.validate(world_size=4)
    assert cfg.float8.all_gather and cfg.parallel.tp == 2


# ---------------------------------------------------------------------------------------
# Inductor: the compiled float8 gather against aot_eager.
# ---------------------------------------------------------------------------------------
INDUCTOR_CASES = (("tensorwise", True, "aot_eager"), ("tensorwise", True, "inductor"))
# Tolerance: the float8 operands are cast identically (the same scales; a cast is
# elementwise), and torch._scaled_mm runs the same kernel under both, but Inductor fuses
# the float32 ops around it (norms, softmax, the AdamW update) and may sum them in
# another order: a few ulps of the O(1) states per step (a smoke run: 3e-8). 1e-6 over 3
# steps leaves room for that; a float8 cast flipped by it would move a weight by a
# float8 step (1/16 relative, far over the bound), as would a wrong scale.
INDUCTOR_TOL = 1e-6


def test_inductor_float8_gather_matches_aot_eager():
    (aot, inductor), _ = run_ranks(_parity_runs, 2, INDUCTOR_CASES)
    (aot_losses, aot_state), (ind_losses, ind_state) = aot, inductor
    assert ind_losses == pytest.approx(aot_losses, rel=0, abs=INDUCTOR_TOL)
    assert aot_state.keys() == ind_state.keys() and "layers.0.up.weight" in aot_state
    for key, value in aot_state.items():
        torch.testing.assert_close(ind_state[key], value, rtol=0, atol=INDUCTOR_TOL, msg=key)


# ---------------------------------------------------------------------------------------
# The planner traces the float8 gather with TP (the 70B Float8 row's layout, in small).
# ---------------------------------------------------------------------------------------
def _planner_tp_trace() -> dict:
    """In the planner's process: the debug Llama's one-block trace on FSDP 2 x TP 2,
    compiled, manual buckets, bf16 parameters, float8 with the float8 all-gather: the
    all-gather bytes by dtype of each graph and the prologue's all-reduces."""
    from simplefsdp.compiler.collectives import KINDS, full_value
    from simplefsdp.config.job import load_config
    from simplefsdp.plan.trace import trace, trace_key

    cfg = load_config(None, ["--float8.enable", "true", "--compile.enable", "true",
                             "--compile.bucketing", "manual", "--parallel.tp", "2",
                             "--training.mixed_precision_param", "bfloat16"], world_size=4)
    tr = trace(trace_key(cfg, "full", 1, 1, 1, 2))
    out: dict = {}
    for name, gm in (("forward", tr.forward), ("backward", tr.backward)):
        gathered = out.setdefault(name, {})
        for node in gm.graph.nodes:
            if node.target in KINDS and KINDS[node.target].value == "all_gather":
                val = full_value(node)
                gathered[str(val.dtype)] = gathered.get(str(val.dtype), 0) + \
                    val.numel() * val.element_size()
    out["prologue"] = [(KINDS[n.target].value, str(n.args[0].meta["val"].dtype),
                        tuple(n.args[0].meta["val"].shape), n.args[-1])
                       for g in tr.prologue for n in g.graph.nodes if n.target in KINDS]
    return out


def test_planner_traces_the_float8_gather_with_tp(planner):
    """By hand: the debug block's 7 converted linears hold 184,320 weights
    (``test_float8.test_planner_traces_a_float8_step``); TP 2 splits each in two, so a
    rank gathers its 92,160-weight pieces over FSDP 2 as 92,160 uint8 bytes in forward and
    again in backward (the recomputed gather). The prologue agrees the 7 amaxes twice,
    over the data-parallel group and over the TP group: two all-reduces of 7 float32 on
    two different groups."""
    out = planner(_planner_tp_trace)
    assert out["forward"]["torch.uint8"] == out["backward"]["torch.uint8"] == 92_160, out
    (kind1, dtype1, shape1, group1), (kind2, dtype2, shape2, group2) = out["prologue"]
    assert (kind1, dtype1, shape1) == (kind2, dtype2, shape2) == (
        "all_reduce", "torch.float32", (7,)), out
    assert group1 != group2, out


def _uneven_answers(rank: int, world: int) -> list[bool]:
    from torch.distributed.tensor import DTensor, Shard

    from simplefsdp._torch_compat import StridedShard
    from simplefsdp.compiler.backend import uneven_dtensor_inputs

    flat = sf.make_mesh(dp_shard=world, device_type="cpu")["dp_shard"]
    grid = sf.make_mesh(dp_shard=2, tp=2, device_type="cpu")["dp_shard", "tp"] \
        if world == 4 else None

    def sharded(rows: int, mesh, placements) -> DTensor:
        local = torch.zeros(-(-rows // mesh.size()), 4)
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=(rows, 4), stride=(4, 1))

    answers = [uneven_dtensor_inputs([torch.zeros(7, 4), sharded(7, flat, (Shard(0),))]),
               uneven_dtensor_inputs([sharded(8, flat, (Shard(0),))])]
    if grid is not None:  # DP within TP's row split (a column-wise weight): 4 ways
        strided = (StridedShard(0, split_factor=2), Shard(0))
        answers += [uneven_dtensor_inputs([sharded(6, grid, strided)]),
                    uneven_dtensor_inputs([sharded(12, grid, strided)])]
    # every rank done creating groups before any tears the process group down: rank 0
    # hosts the store the others create theirs through (rank 3 once lost it: broken pipe)
    torch.distributed.barrier()
    return answers


def test_uneven_shards_are_compiled_without_the_caches():
    """AOTAutograd's cache keys a DTensor input by its global shape: with uneven shards
    (the toy's 7-row weights on 2 ranks) the ranks' graphs share a key, and with a warm
    cache a rank ran another's graph (``test_inductor_...`` failed on its second run on
    one cache: "expected size 3==4"). Such graphs compile with that cache off (Inductor's
    FX graph cache, keyed by the local tensors, stays on: test_auto_wrap's warm
    compiles); which ones, by the global shapes (the same answer on every rank)."""
    assert run_ranks(_uneven_answers, 4)[0] == [True, False, True, False]
