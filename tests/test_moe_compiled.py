"""Compiled MoE (issue 51): the exact expert dispatch traced into the blocks' graphs, and
the padded dispatch (``parallel.expert_dispatch``). EP 2 x FSDP 2 on 2 gloo ranks, a
debug-size MoE, 3 SGD steps, aot_eager; every variant runs in the same two processes
(one ``run_ranks``), the eager exact run being the reference of the others."""

from __future__ import annotations

import math

import pytest
import torch
from rank_runner import run_ranks
from toy import moe_token_loss, step_summed_over_ranks, token_batches

import simplefsdp as sf
from simplefsdp._torch_compat import dynamo_counters, dynamo_reset
from simplefsdp.config.job import load_config
from simplefsdp.errors import ConfigError
from simplefsdp.mesh import ParallelDims
from simplefsdp.models import moe
from simplefsdp.models.parallelize import compile_model
from simplefsdp.parallel import expert

ARGS = moe.MoEArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32,
                   num_experts=8, top_k=2, moe_hidden_dim=32, load_balance="aux_loss",
                   aux_loss_coef=0.1)
BATCH, SEQ, STEPS, LR = 2, 32, 3, 0.5
# (name, compiled, capacity factor or None for exact). A factor of num_experts gives each
# expert a capacity of all of a rank's slots: nothing can drop. 0.6 drops plenty, and its
# capacity, 0.6 x 128 slots / 8 experts = 9.6, tells ceil from floor.
VARIANTS = [("eager", False, None), ("compiled", True, None),
            ("padded_nodrop", False, float(ARGS.num_experts)), ("padded_drop", False, 0.6),
            ("padded_drop_compiled", True, 0.6)]


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(STEPS * world, BATCH, SEQ, ARGS.vocab_size)


def _model(factor: float | None):
    torch.manual_seed(0)
    model = moe.MoETransformer(ARGS)
    model.init_weights()
    mesh = sf.make_mesh(dp_shard=2)
    experts_mesh = ParallelDims.expert_mesh(mesh, 2)
    expert.apply_ep(model, experts_mesh)
    expert.set_expert_dispatch(model, "exact" if factor is None else "padded",
                               1.0 if factor is None else factor)
    expert.shard_experts(model, experts_mesh, mode="fully_shard", reduce_op="sum")
    sf.data_parallel(model, mesh, mode="fully_shard", reduce_op="sum")
    return model


def _hand_dropped(ids: torch.Tensor, factor: float) -> int:
    """Slots the padded dispatch must drop for one layer's router choices ``ids``
    (tokens, k), counted here from the definition: each expert keeps ceil(factor x this
    rank's slots / experts) of its slots."""
    capacity = max(1, math.ceil(factor * ids.numel() / ARGS.num_experts))
    per_expert = torch.bincount(ids.flatten(), minlength=ARGS.num_experts).tolist()
    return sum(max(0, n - capacity) for n in per_expert)


def _variant(rank: int, world: int, compiled: bool, factor: float | None) -> dict:
    model = _model(factor)
    choices: list[torch.Tensor] = []
    if not compiled:  # the router's choices, for the hand count (eager: hooks run as is)
        for layer in moe.moe_layers(model):
            layer.gate.register_forward_hook(lambda m, i, out: choices.append(out[2].clone()))
    backend = None
    if compiled:
        dynamo_reset()
        dynamo_counters().clear()
        backend = sf.compile_backend(backend="aot_eager", bucketing="manual", reordering=True)
        model = compile_model(model, backend, fullgraph=False)  # as the MoE family does
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    losses, dropped, hand, graphs_after_first = [], [], [], None
    for step, (inputs, targets) in enumerate(_batches(world)[rank::world]):
        loss = moe_token_loss(model, inputs, targets, world * targets.numel())
        losses.append(step_summed_over_ranks(loss, opt))
        layers = moe.moe_layers(model)
        dropped.append(int(sum(layer.tokens_dropped.item() for layer in layers)))
        for layer in layers:
            layer.tokens_dropped.zero_()
        if factor is not None and choices:
            hand.append(sum(_hand_dropped(ids, factor) for ids in choices))
        choices.clear()
        if compiled and step == 0:
            graphs_after_first = dynamo_counters()["stats"]["unique_graphs"]
    out = {"losses": losses, "dropped": dropped, "hand": hand}
    if compiled:
        counters = dynamo_counters()
        out.update(breaks=dict(counters["graph_break"]),
                   graphs=(graphs_after_first, counters["stats"]["unique_graphs"]),
                   all_to_alls={r.graph: 0 for r in backend.reports})
        for report in backend.reports:
            out["all_to_alls"][report.graph] += report.all_to_alls
    return out


def _all_variants(rank: int, world: int) -> dict:
    return {name: _variant(rank, world, compiled, factor)
            for name, compiled, factor in VARIANTS}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """Every variant's figures on each of the 2 ranks (one spawn for the whole file)."""
    return run_ranks(_all_variants, 2)


def test_compiled_exact_dispatch_one_graph_no_recompile(runs):
    """Compiled (aot_eager, as the trainer compiles an MoE: ``fullgraph=False``): no graph
    break anywhere (the old dispatch broke once per MoE block) and no graph compiled after
    step 1 (the old frames recompiled per block on a hook guard). The losses equal eager's
    bitwise: the graph runs eager's ops in eager's order; traced, the experts run one
    ``F.linear`` per expert where eager runs torch's CPU grouped matmul (whose fake kernel
    takes only bfloat16), and on CPU float32 the two give the same sums (a GPU's grouped
    kernel need not: there a tolerance of a few ulps would be the honest check)."""
    for rank in runs:
        compiled = rank["compiled"]
        assert compiled["breaks"] == {}
        first, last = compiled["graphs"]
        assert first == last >= 1
        assert compiled["losses"] == rank["eager"]["losses"]


def test_all_to_alls_are_in_the_compiled_graphs(runs):
    """Each MoE block's three exchanges (the counts', the tokens' there and back) are
    functional collectives in the forward graph our passes see; backward holds the
    tokens' reverse exchanges (two per block; the counts carry no gradient)."""
    for rank in runs:
        assert rank["compiled"]["all_to_alls"] == {"forward": 3 * ARGS.n_layers,
                                                  "backward": 2 * ARGS.n_layers}
        # padded: no counts' exchange (static capacity); the same two token exchanges
        assert rank["padded_drop_compiled"]["all_to_alls"] == {
            "forward": 2 * ARGS.n_layers, "backward": 2 * ARGS.n_layers}


def test_padded_without_drops_equals_exact(runs):
    """A capacity no expert can overflow: nothing dropped, and the losses are the exact
    dispatch's bitwise (the same rows meet the same matmuls; padding rows are zeros whose
    outputs are discarded)."""
    for rank in runs:
        assert rank["padded_nodrop"]["dropped"] == [0] * STEPS
        assert rank["padded_nodrop"]["losses"] == rank["eager"]["losses"]


def test_padded_drops_match_hand_count(runs):
    """Capacity factor 0.6: the dropped slots of each step equal the hand count from the
    router's choices on every rank, eager and compiled; compiled runs one graph per
    step too, and its losses equal padded eager's bitwise (as above); dropping changes
    the model's output (losses differ from exact)."""
    for rank in runs:
        eager, compiled = rank["padded_drop"], rank["padded_drop_compiled"]
        assert eager["dropped"] == eager["hand"]
        assert all(n > 0 for n in eager["dropped"])
        # the first step's routing is the same weights' on the same tokens: same drops
        assert compiled["dropped"][0] == eager["dropped"][0]
        assert compiled["breaks"] == {}
        first, last = compiled["graphs"]
        assert first == last >= 1
        assert compiled["losses"] == eager["losses"]
        assert eager["losses"][0] != rank["eager"]["losses"][0]


@pytest.mark.quick
def test_padded_experts_by_hand():
    """One process, no exchange: 2 experts, capacity 2, slots grouped by expert with
    counts [3, 1]. Expert 0's third slot is dropped (its output 0); the others equal
    ``expert_ffn`` on the same rows; ``dropped_slots`` counts 1."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    gate_up, down = torch.randn(2, 12, 8), torch.randn(2, 8, 6)
    counts = torch.tensor([3, 1])
    out = moe.padded_experts(x, counts, gate_up, down, capacity=2)
    full = moe.expert_ffn(x, [3, 1], gate_up, down)
    assert torch.equal(out[2], torch.zeros(8))
    torch.testing.assert_close(out[[0, 1, 3]], full[[0, 1, 3]], rtol=1e-6, atol=1e-6)
    assert int(moe.dropped_slots(counts, 2)) == 1
    assert moe.expert_capacity(16, 8, 1.25) == 3  # ceil(1.25 * 16 / 8)


def test_bad_dispatch_keys_refused():
    """A capacity factor that is not a finite number > 0 (inf: the reader's refusal, the
    others ours), or the padded dispatch on a model without our routed layers, is refused
    at config load, naming the key."""
    for bad in ("0", "-1", "inf"):
        with pytest.raises(ConfigError, match=r"parallel\.expert_capacity_factor"):
            load_config(None, ["--model.name", "debug_moe", "--parallel.expert_dispatch",
                               "padded", "--parallel.expert_capacity_factor", bad]).validate(1)
    with pytest.raises(ConfigError, match=r"parallel\.expert_dispatch = 'padded' needs "
                                          r"model\.family = 'moe'"):
        load_config(None, ["--parallel.expert_dispatch", "padded"]).validate(1)
    with pytest.raises(ConfigError, match="expert_dispatch"):
        load_config(None, ["--parallel.expert_dispatch", "dropless"])
