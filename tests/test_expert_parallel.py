"""Expert parallelism (parallel/expert.py): EP 2 x FSDP 2 on 4 gloo ranks against a
single-process reference that routes the same tokens to the same experts."""

from __future__ import annotations

import pytest
import torch
from rank_runner import run_ranks
from torch.distributed.tensor import DTensor, Shard
from toy import moe_token_loss, step_summed_over_ranks, token_batches

import simplefsdp as sf
from simplefsdp.mesh import ParallelDims
from simplefsdp.models import moe
from simplefsdp.parallel import expert

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

ARGS = moe.MoEArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16,
                   num_experts=8, top_k=2, moe_hidden_dim=32, shared_hidden_dim=32,
                   load_balance="aux_loss", aux_loss_coef=0.1)
BATCH, SEQ, STEPS, LR = 2, 16, 3, 0.5


def test_source_to_expert_order_by_hand():
    """Received runs (source, expert) of sizes [[1, 2], [3, 1]] sit at rows 0 | 1 2 |
    3 4 5 | 6; by expert then source: expert 0 takes 0 then 3 4 5, expert 1 takes 1 2
    then 6."""
    order = expert._source_to_expert_order(torch.tensor([[1, 2], [3, 1]]))
    assert order.tolist() == [0, 3, 4, 5, 1, 2, 6]
    assert expert._source_to_expert_order(torch.tensor([[0, 0], [0, 2]])).tolist() == [0, 1]


def test_bad_input_refused():
    """Refused before any exchange, naming the size to change."""
    with pytest.raises(ValueError, match="parallel.ep = 3 does not divide the 8 experts"):
        expert.check_expert_split(3, 8, prefix="parallel.")
    expert.check_expert_split(2, 8)  # fine
    with pytest.raises(ValueError, match=r"^parallel\.ep = 4 must divide parallel\.dp_shard = 2 "):
        ParallelDims(dp_shard=2, ep=4, prefix="parallel.")
    ParallelDims(dp_shard=4, ep=2)  # fine
    from simplefsdp.models.llama import ModelArgs, Transformer

    dense = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=8))
    with pytest.raises(ValueError, match="Transformer has no MoE layer"):
        expert.apply_ep(dense, None)


def _expert_mesh_layout(rank: int, world: int):
    from simplefsdp.parallel.tensor import apply_tp

    mesh = sf.make_mesh(dp_shard=2, tp=2)  # ranks [[[[0, 1], [2, 3]]]]: tp inside dp_shard
    experts = ParallelDims.expert_mesh(mesh, 2)
    refused = ""
    try:
        ParallelDims.expert_mesh(mesh, 3)
    except ValueError as e:
        refused = str(e)
    # TP 2 x EP 2 on this mesh: the rows each rank's dispatch sends, then one backward of
    # the trainer's loss (every rank the same batch: no data-parallel reduction needed
    # for the router, whose gradient is the TP ranks' sum)
    torch.manual_seed(0)
    model = moe.MoETransformer(ARGS)
    model.init_weights()
    apply_tp(model, mesh["tp"], SEQ)
    expert.apply_ep(model, experts)
    expert.set_token_group(model, mesh)
    sent = []
    exchange = expert.all_to_all_single_autograd

    def counting(x, recv, send, group, **kwargs):
        sent.append(sum(send))
        return exchange(x, recv, send, group, **kwargs)

    expert.all_to_all_single_autograd = counting
    inputs, targets = _batches(1)[0]
    try:
        moe_token_loss(model, inputs, targets, targets.numel()).backward()
    finally:
        expert.all_to_all_single_autograd = exchange
    # the gradient is a Partial DTensor (data_parallel would reduce it): its sum over TP
    routers = [layer.gate.weight.grad.full_tensor().tolist()
               for layer in moe.moe_layers(model)]
    return (experts.mesh_dim_names, experts.mesh.tolist(),
            sorted(experts["ep"].mesh.tolist()), refused, sent,
            [layer.aux_loss.item() for layer in moe.moe_layers(model)], routers)


def test_expert_mesh_layout():
    """The experts' mesh over 4 gloo ranks laid out (dp_shard 2, tp 2), against the layout
    by hand: dp_shard x tp (4 ranks, the TP ranks routing different tokens) splits into
    (4 / ep = 2, ep = 2), ep inside: the ep groups are the TP pairs {0, 1} and {2, 3}, the
    experts' dp_shard pairs {0, 2} and {1, 3}. And with TP 2 x EP 2 on it, each rank's
    all-to-all sends only its own sequence shard's slots: each MoE layer's dispatch (the
    first of its two exchanges) sends batch 2 x seq 16 / tp 2 x top-2 = 32 rows (the
    whole sequence's 64 if TP ranks routed the gathered sequence). Each layer's balance
    loss and its router's gradient after one backward equal a single process on the same
    batch: the loss's statistics gathered over TP (whole sequence), the router's gradient
    summed over TP, the balance loss's not counted twice (each TP rank adds it). Balance
    losses within 1e-6 relative; router gradients within 1e-8 absolute + 1e-5 relative
    (float32: TP's split matmuls add in another order; measured worst 1.9e-9 absolute, on
    elements whose terms cancel; the largest are ~4e-3, and a missing TP sum halves each,
    a doubled balance term moves them by its share)."""
    results = run_ranks(_expert_mesh_layout, 4)
    torch.manual_seed(0)
    reference = moe.MoETransformer(ARGS)
    reference.init_weights()
    inputs, targets = _batches(1)[0]
    moe_token_loss(reference, inputs, targets, targets.numel()).backward()
    layers = moe.moe_layers(reference)
    for _, _, _, _, _, aux, routers in results:
        assert aux == pytest.approx([layer.aux_loss.item() for layer in layers], rel=1e-6)
        for got, layer in zip(routers, layers, strict=True):
            torch.testing.assert_close(torch.tensor(got), layer.gate.weight.grad, rtol=1e-5,
                                       atol=1e-8)
    names, ranks, _, refused, _, _, _ = results[0]
    assert names == ("pp", "dp_replicate", "dp_shard", "ep", "cp_ring", "cp_ulysses", "tp")
    assert ranks == [[[[[[[0]]], [[[1]]]], [[[[2]]], [[[3]]]]]]]  # (1, 1, 2, 2, 1, 1, 1)
    assert [r[2] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert refused == "ep = 3 must divide dp_shard * tp = 4 (the expert-parallel groups " \
                      "are carved out of those ranks)"
    slots = BATCH * SEQ // 2 * ARGS.top_k
    assert all(len(r[4]) == 2 * ARGS.n_layers for r in results)
    assert [r[4][::2] for r in results] == [[slots] * ARGS.n_layers] * 4


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return token_batches(STEPS * world, BATCH, SEQ, ARGS.vocab_size)


def _reference(world: int):
    """One process, the same initial weights; each step runs every rank's batch as its
    own forward (so each layer routes, and computes its balance loss, on the same tokens
    as that rank) and sums the gradients, then one SGD step."""
    torch.manual_seed(0)
    model = moe.MoETransformer(ARGS)
    model.init_weights()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batches, losses = _batches(world), []
    for step in range(STEPS):
        step_loss = 0.0
        for rank in range(world):
            inputs, targets = batches[step * world + rank]
            loss = moe_token_loss(model, inputs, targets, world * targets.numel())
            loss.backward()
            step_loss += loss.item()
        losses.append(step_loss)
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _ep_fsdp(rank: int, world: int, ep: int):
    torch.manual_seed(0)
    model = moe.MoETransformer(ARGS)
    model.init_weights()
    mesh = sf.make_mesh(dp_shard=world)
    experts_mesh = ParallelDims.expert_mesh(mesh, ep)
    expert.apply_ep(model, experts_mesh)
    expert.shard_experts(model, experts_mesh, mode="fully_shard", reduce_op="sum")
    sf.data_parallel(model, mesh, mode="fully_shard", reduce_op="sum")
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    batches, losses = _batches(world), []
    for step in range(STEPS):
        inputs, targets = batches[step * world + rank]
        loss = moe_token_loss(model, inputs, targets, world * targets.numel())
        losses.append(step_summed_over_ranks(loss, opt))
    placements = {n: (tuple(p.device_mesh.mesh_dim_names), tuple(p.placements),
                      tuple(p.to_local().shape)) for n, p in model.named_parameters()}
    # Plain lists: tensors would travel as shared memory that dies with this process.
    full = {n: p.detach().full_tensor().tolist() for n, p in model.named_parameters()
            if isinstance(p, DTensor)}
    return losses, full, placements


def test_ep2_fsdp2_matches_single_process():
    """EP 2 x FSDP 2 (4 ranks): each rank holds 4 of the 8 experts per layer, split over
    the 2 ranks of its experts' dp_shard; attention, router and shared expert are sharded
    over all 4. Losses of 3 SGD steps and every parameter after them equal the reference
    within 1e-6 absolute (float32; the sums over ranks, and each expert's rows gathered
    from two ranks into one matmul, change the reduction order: a few ulps of values up
    to ~4; SGD keeps parameter differences linear in gradient differences, where Adam's
    normalization would magnify rounding on near-zero gradients)."""
    world, ep = 4, 2
    ref_losses, ref_params = _reference(world)
    results = run_ranks(_ep_fsdp, world, ep)
    losses, full, placements = results[0]
    assert losses == pytest.approx(ref_losses, rel=0, abs=1e-6)
    assert set(full) == set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(torch.tensor(full[name]), value, rtol=0, atol=1e-6,
                                   msg=name)
    # The layout: experts Shard(0) over ep (4 experts each), then dim 0 again over the
    # experts' dp_shard (2 each); the rest Shard(0) over the 4 ranks of dp_shard.
    mesh_names, places, local = placements["layers.1.feed_forward.experts.gate_up_proj"]
    assert mesh_names == ("dp_shard", "ep") and local == (2, 64, 64)
    assert [type(p).__name__ for p in places] == ["_StridedShard", "Shard"]
    assert placements["layers.1.feed_forward.gate.weight"][:2] == (("dp_shard",), (Shard(0),))


# An idle expert and an EP rank that receives no rows: 6 experts, top-2, on EP 2 (rank 0
# holds experts 0-2, rank 1 experts 3-5). The router's weights send every token to
# experts 0 and 2 (``_forced_routing``): expert 1 idles next to busy ones, and EP rank 1
# holds only idle experts and receives zero rows.
IDLE_ARGS = moe.MoEArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64,
                        num_experts=6, top_k=2, moe_hidden_dim=32, load_balance="none")
ROUTED_TO, IDLE_TOKENS = (0, 2), 12


def _forced_routing(path: str):
    """The MoE block (seed 0), its router weights set so that every token's top 2 are
    experts 0 and 2, and ``world`` ranks' inputs: feature 0 is 4 on every token, where
    the chosen experts' router rows have +1 and the others -1 (logits 8 apart, beyond the
    other features' +-0.1 router weights). ``path``: "loop" turns the grouped matmul off."""
    torch.manual_seed(0)
    block = moe.MoE(IDLE_ARGS)
    block.init_weights(0.02)
    with torch.no_grad():
        block.gate.weight.uniform_(-0.1, 0.1)
        block.gate.weight[:, 0] = -1.0
        block.gate.weight[list(ROUTED_TO), 0] = 1.0
    if path == "loop":
        moe.grouped_mm = lambda device, dtype: None
    inputs = torch.randn(2, IDLE_TOKENS, IDLE_ARGS.dim)
    inputs[..., 0] = 4.0
    return block, inputs, torch.randn(IDLE_ARGS.dim)


def _idle_loss(block, x, projection) -> torch.Tensor:
    return (block(x.unsqueeze(0)) * projection).sum()


def _idle_ep(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    block, inputs, projection = _forced_routing(path)
    holder = torch.nn.ModuleDict({"moe": block})
    expert.apply_ep(holder, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    received = []
    original = expert.expert_ffn
    expert.expert_ffn = lambda x, counts, *w: received.append(counts) or original(x, counts, *w)
    loss = _idle_loss(block, inputs[rank], projection)
    loss.backward()
    grads = {n: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
             for n, p in block.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "received": received,
            "grads": {n: g.tolist() for n, g in grads.items()},
            "no_grad": [n for n, p in block.named_parameters() if p.grad is None]}


@pytest.mark.parametrize("path", ["grouped", "loop"])
def test_idle_experts_and_a_rank_without_rows(path):
    """EP 2 on 2 gloo ranks with routing forced through the router's weights: EP rank 1
    receives zero rows (its 3 experts idle) and rank 0's expert 1 idles between busy
    ones, on the grouped-matmul path (dim 32: 16-byte strides; rank 1's empty batch takes
    the loop) and on the loop path, against one process running each rank's tokens
    through the unsplit block: the same finite losses and gradients (within 1e-6: each
    expert's rows from both ranks in one matmul, rounding differs by the rows' place,
    ``test_hf_moe.test_blas_rounding_depends_on_where_the_rows_start``), every expert's
    gradient present, exactly zero for the 4 idle experts (nonzero for the busy ones)."""
    from simplefsdp._torch_compat import grouped_mm

    if path == "grouped":  # the grouped path is real here: torch has the kernel on CPU
        assert grouped_mm(torch.device("cpu"), torch.float32) is not None
    results = run_ranks(_idle_ep, 2, path)
    import simplefsdp.models.moe as moe_module

    saved = moe_module.grouped_mm
    try:
        block, inputs, projection = _forced_routing(path)
        want = [_idle_loss(block, inputs[r], projection) for r in range(2)]
        for loss in want:
            loss.backward()
    finally:
        moe_module.grouped_mm = saved
    # what each EP rank's experts received: rank 0 both ranks' 2 x 12 slots for experts 0
    # and 2, none for 1; rank 1 none at all
    assert results[0]["received"] == [[2 * IDLE_TOKENS, 0, 2 * IDLE_TOKENS]]
    assert results[1]["received"] == [[0, 0, 0]]
    for rank, got in enumerate(results):
        assert got["no_grad"] == [] and torch.isfinite(torch.tensor(got["loss"]))
        assert got["loss"] == pytest.approx(want[rank].item(), rel=1e-6)
        local = slice(3 * rank, 3 * rank + 3)
        for name in ("gate_up_proj", "down_proj"):
            mine = torch.tensor(got["grads"][f"experts.{name}"])
            whole = getattr(block.experts, name).grad[local]
            torch.testing.assert_close(mine, whole, rtol=0, atol=1e-6)
            for e in range(3):
                idle = 3 * rank + e not in ROUTED_TO
                assert (mine[e] == 0).all() == idle, (rank, e, name)
    # the router: each rank's gradient from its own tokens (no data-parallel sum here),
    # together the reference's over both ranks' tokens
    router = sum(torch.tensor(got["grads"]["gate.weight"]) for got in results)
    torch.testing.assert_close(router, block.gate.weight.grad, rtol=0, atol=1e-6)
