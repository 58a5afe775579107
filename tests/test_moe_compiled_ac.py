"""Selective activation checkpointing inside compiled MoE blocks (issue 51, item 4): a
routed block's checkpoint is traced into the model's graph with the dense blocks' op-level
policy, which there also keeps the token exchanges and the experts' matmuls.

EP 2 x FSDP 2 on 2 gloo ranks, aot_eager, a debug-size MoE of one dense block then one
routed block (DeepSeek's layout), 2 SGD steps, both dispatches; every variant runs in
the same two processes (one ``run_ranks``). What the policy decided is read where it
decides (each checkpointed call's decisions, recorded around ``_selective_policy``) and
where it matters (the compiled backward graph's matmuls and all-to-alls)."""

from __future__ import annotations

import collections

import pytest
import torch
from rank_runner import run_ranks
from toy import moe_token_loss, step_summed_over_ranks, token_batches

import simplefsdp as sf
from simplefsdp._torch_compat import dynamo_counters, dynamo_reset
from simplefsdp.compiler.collectives import ALL_TO_ALL
from simplefsdp.mesh import ParallelDims
from simplefsdp.models import moe
from simplefsdp.models.parallelize import compile_model
from simplefsdp.parallel import activation_checkpoint, expert

ARGS = moe.MoEArgs(dim=64, n_layers=2, n_dense_layers=1, n_heads=4, n_kv_heads=2,
                   vocab_size=64, max_seq_len=32, num_experts=8, top_k=2, moe_hidden_dim=32,
                   load_balance="aux_loss", aux_loss_coef=0.1)
BATCH, SEQ, STEPS, LR, EP = 2, 32, 2, 0.5, 2
LOCAL_EXPERTS = ARGS.num_experts // EP
# A capacity factor of num_experts: no expert can overflow, so the padded dispatch moves
# every slot (and nothing is dropped) with static shapes.
DISPATCHES = {"exact": None, "padded": float(ARGS.num_experts)}
# (name, activation checkpointing, compiled, dispatch)
VARIANTS = [("eager", "none", False, "exact"),
            *[(f"{ac}_{d}", ac, True, d) for d in DISPATCHES for ac in ("none", "selective")]]
OPS = {torch.ops.aten.mm.default: "mm", torch.ops.simplefsdp.expert_linear.default: "expert_linear",
       ALL_TO_ALL: "all_to_all"}


def _model(ac: str, dispatch: str):
    torch.manual_seed(0)
    model = moe.MoETransformer(ARGS)
    model.init_weights()
    activation_checkpoint.apply_ac(model, ac)  # before EP and data parallel, as parallelize
    mesh = sf.make_mesh(dp_shard=2)
    experts_mesh = ParallelDims.expert_mesh(mesh, EP)
    expert.apply_ep(model, experts_mesh)
    expert.set_expert_dispatch(model, dispatch, DISPATCHES[dispatch] or 1.0)
    expert.shard_experts(model, experts_mesh, mode="fully_shard", reduce_op="sum")
    sf.data_parallel(model, mesh, mode="fully_shard", reduce_op="sum")
    return model


def _recording_policy(calls: list[collections.Counter]):
    """``_selective_policy`` that also counts each checkpointed call's decisions on the
    ops it is about (a new Counter per call: each call has its own ``mm_calls``)."""
    policy = activation_checkpoint._selective_policy

    def record(saved, mm_calls, ctx, func, *args, **kwargs):
        if "recorded" not in mm_calls:  # this call's first op
            mm_calls["recorded"] = 1
            calls.append(collections.Counter())
        decision = policy(saved, mm_calls, ctx, func, *args, **kwargs)
        name = OPS.get(func, "attention" if func in activation_checkpoint.attention_ops()
                       else None)
        if name is not None:
            calls[-1][name, decision.name] += 1
        return decision
    return record


def _graph_ops(backend) -> dict[str, collections.Counter]:
    """Wrap ``backend.run_passes`` to count :data:`OPS` in each compiled forward and
    backward graph (summed over graphs of a kind)."""
    found = {"forward": collections.Counter(), "backward": collections.Counter()}
    run_passes = backend.run_passes

    def counted(graph, *args, **kwargs):
        report = run_passes(graph, *args, **kwargs)
        found[report.graph].update(OPS[n.target] for n in graph.nodes
                                   if n.op == "call_function" and n.target in OPS)
        return report
    backend.run_passes = counted
    return found


def _variant(rank: int, world: int, ac: str, compiled: bool, dispatch: str) -> dict:
    model = _model(ac, dispatch)
    out: dict = {}
    if compiled:
        dynamo_reset()
        dynamo_counters().clear()
        backend = sf.compile_backend(backend="aot_eager", bucketing="manual", reordering=True)
        out["graph_ops"] = _graph_ops(backend)
        activation_checkpoint.compile_checkpointed_blocks(model, backend)
        model = compile_model(model, backend, fullgraph=False)  # as the MoE family does
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    losses, loads = [], []
    batches = token_batches(STEPS * world, BATCH, SEQ, ARGS.vocab_size)
    for inputs, targets in batches[rank::world]:
        loss = moe_token_loss(model, inputs, targets, world * targets.numel())
        losses.append(step_summed_over_ranks(loss, opt))
        for layer in moe.moe_layers(model):
            loads.append(layer.tokens_per_expert.tolist())
            layer.tokens_per_expert.zero_()
    out.update(losses=losses, loads=loads)
    if compiled:
        counters = dynamo_counters()
        out["breaks"] = sum(counters["graph_break"].values())
        out["graphs"] = counters["stats"]["unique_graphs"]
    return out


def _all_variants(rank: int, world: int) -> dict:
    calls: list[collections.Counter] = []
    activation_checkpoint._selective_policy = _recording_policy(calls)
    found = {}
    for name, ac, compiled, dispatch in VARIANTS:
        calls.clear()
        found[name] = _variant(rank, world, ac, compiled, dispatch)
        found[name]["policy_calls"] = [dict(c) for c in calls]
    return found


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """Every variant's figures on each of the 2 ranks (one spawn for the whole file)."""
    return run_ranks(_all_variants, 2)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_selective_moe_block_is_one_graph_equal_to_no_ac(runs, dispatch):
    """Compiled under selective AC: no graph break (the routed block's dispatch ran
    eagerly between its graphs before, a break per block) and one graph for the whole
    model. The losses equal no-AC's bitwise, compiled and eager: the recomputation runs
    the forward's ops on the same inputs, and every kept tensor is the forward's own.
    The load counters are counted once per forward (the recomputation does not add the
    routed slots again)."""
    for rank in runs:
        selective, none = rank[f"selective_{dispatch}"], rank[f"none_{dispatch}"]
        assert selective["breaks"] == 0
        assert selective["graphs"] == 1
        assert selective["losses"] == none["losses"] == rank["eager"]["losses"]
        assert selective["loads"] == none["loads"]
        assert all(sum(load) == BATCH * SEQ * ARGS.top_k for load in selective["loads"])


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_selective_policy_keeps_exchanges_and_expert_matmuls(runs, dispatch):
    """The policy's decisions in each traced checkpointed call, counted by hand.

    Dense block: 7 matmuls (wq, wk, wv, wo, w1, w3, w2), every other kept: 4 kept, 3
    recomputed; attention kept. Routed block: 5 matmuls counted (4 of attention and the
    router): 3 kept (wq, wv, router), 2 recomputed (wk, wo); the experts' matmuls (2 per
    local expert: gate_up and down, ``expert_linear`` traced in float32) all kept and not counted;
    the token exchanges kept: counts, dispatch and combine (exact), dispatch and combine
    (padded: static capacity, no counts' exchange)."""
    exchanges = 3 if dispatch == "exact" else 2
    dense = {("mm", "MUST_SAVE"): 4, ("mm", "PREFER_RECOMPUTE"): 3,
             ("attention", "MUST_SAVE"): 1}
    routed = {("mm", "MUST_SAVE"): 3, ("mm", "PREFER_RECOMPUTE"): 2,
              ("attention", "MUST_SAVE"): 1, ("expert_linear", "MUST_SAVE"): 2 * LOCAL_EXPERTS,
              ("all_to_all", "MUST_SAVE"): exchanges}
    for rank in runs:
        calls = rank[f"selective_{dispatch}"]["policy_calls"]
        assert calls and all(c in (dense, routed) for c in calls), calls
        assert dense in calls and routed in calls


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_backward_recomputes_what_the_policy_says(runs, dispatch):
    """Counted in the compiled graphs, selective against no AC: the backward holds 3 + 2
    more matmuls (the dense block's wk, wo, w3 and the routed block's wk, wo, recomputed),
    no more expert matmuls (kept) and no more all-to-alls (the exchanges kept: the
    backward's are the reverse exchanges only, dispatch's and combine's). The forwards are
    the same ops."""
    for rank in runs:
        selective = rank[f"selective_{dispatch}"]["graph_ops"]
        none = rank[f"none_{dispatch}"]["graph_ops"]
        assert selective["forward"] == none["forward"]
        assert none["backward"]["all_to_all"] == 2
        extra = selective["backward"].copy()
        extra.subtract(none["backward"])
        assert {op: n for op, n in extra.items() if n} == {"mm": 3 + 2}


@pytest.mark.quick
def test_routed_policy_and_expert_linear_by_hand():
    """One process, no compile. The compiled routed block's policy (a fresh one per call,
    as the checkpoint makes it) keeps the all-to-all, the grouped matmul and
    ``expert_linear`` every time, without counting them: the block's matmuls are still
    kept, recomputed, kept (1st, 2nd, 3rd). ``expert_linear`` is ``F.linear``: the same
    output and gradients, bitwise (the same matmuls)."""
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    from simplefsdp._torch_compat.unbacked import grouped_mm_op

    saved = frozenset(activation_checkpoint._saved_ops()
                      | activation_checkpoint._routed_saved_ops())
    calls, ctx = collections.Counter(), SelectiveCheckpointContext(is_recompute=False)
    kept = [ALL_TO_ALL, torch.ops.simplefsdp.expert_linear.default]
    kept += [grouped_mm_op()] if grouped_mm_op() is not None else []
    decisions = []
    for op in (torch.ops.aten.mm.default, *kept, torch.ops.aten.mm.default, *kept,
               torch.ops.aten.mm.default, torch.ops.aten.silu.default):
        decisions.append(activation_checkpoint._selective_policy(saved, calls, ctx, op))
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert decisions == [save, *[save] * len(kept), again, *[save] * len(kept), save, again]
    rows = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(6, 8, requires_grad=True)
    ours, theirs = moe.expert_linear(rows, weight), torch.nn.functional.linear(rows, weight)
    grad = torch.randn(5, 6)
    assert torch.equal(ours, theirs)
    ours_grads = torch.autograd.grad(ours, (rows, weight), grad)
    assert all(torch.equal(a, b) for a, b in zip(
        ours_grads, torch.autograd.grad(theirs, (rows, weight), grad), strict=True))
