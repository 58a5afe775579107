"""Expert parallelism (parallel/expert.py): EP 2 x FSDP 2 on 4 gloo ranks against a
single-process reference that routes the same tokens to the same experts."""

from __future__ import annotations

import pytest
import torch
from rank_runner import run_ranks
from torch.distributed.tensor import DTensor, Shard

import simplefsdp as sf
from simplefsdp.mesh import ParallelDims
from simplefsdp.models import moe
from simplefsdp.parallel import expert

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
        expert.check_ep(3, num_experts=8, prefix="parallel.")
    with pytest.raises(ValueError, match="parallel.ep = 4 does not divide parallel.dp_shard = 2"):
        expert.check_ep(4, num_experts=8, dp_shard=2, prefix="parallel.")
    expert.check_ep(2, num_experts=8, dp_shard=4)  # fine
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
        _loss(model, inputs, targets, targets.numel()).backward()
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
    _loss(reference, inputs, targets, targets.numel()).backward()
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
    assert refused == "ep = 3 does not divide dp_shard * tp = 4 (the expert-parallel " \
                      "groups are carved out of dp_shard * tp)"
    slots = BATCH * SEQ // 2 * ARGS.top_k
    assert all(len(r[4]) == 2 * ARGS.n_layers for r in results)
    assert [r[4][::2] for r in results] == [[slots] * ARGS.n_layers] * 4


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS * world):
        tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _loss(model, inputs, targets, total_tokens: int) -> torch.Tensor:
    """The trainer's token-normalized loss: this forward's token-loss sum over the step's
    tokens, plus the balance loss weighted by this forward's share of the tokens."""
    logits = model(inputs)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                           reduction="sum")
    return (ce + moe.aux_loss(model) * targets.numel()) / total_tokens


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
            loss = _loss(model, inputs, targets, world * targets.numel())
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
        loss = _loss(model, inputs, targets, world * targets.numel())
        loss.backward()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item())
        opt.step()
        opt.zero_grad()
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
