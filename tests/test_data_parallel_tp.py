"""FSDP over tensor-parallel shards with fewer rows than data-parallel ranks.

A TP shard is sharded again on dim 0 over the data-parallel ranks, as ``Shard(0)``
splits: ``torch.chunk`` pieces, then empty pieces for the ranks it leaves out. A
column-wise layer with 3 output rows on TP 2 gives TP rank 1 a shard of 1 row; over
2 DP ranks that is 1 + 0 rows. ``torch.chunk`` alone returns one piece there, and
indexing it for DP rank 1 raised IndexError before the fix.

Tolerance: the sharded model computes the same float32 math as one process on the
global batch, but sums are split differently (row-wise TP partial sums, the DP
average), so losses and parameters agree to 1e-6 (float32 rounding is ~1e-7 per op; 3
SGD steps on a 4 -> 3 -> 2 model stay far below that).
"""

from __future__ import annotations

import pytest
import torch
from rank_runner import run_ranks
from torch import nn

import simplefsdp as sf

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

STEPS = 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _train(model: nn.Module, rows: slice) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _tp_fsdp(rank: int, world: int) -> dict:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = sf.make_mesh(dp_shard=2, tp=2)
    model = parallelize_module(_model(), mesh["tp"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    sf.data_parallel(model, mesh["dp_shard"])
    local_rows = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
    dp = mesh["dp_shard"].get_local_rank()
    losses = _train(model, slice(4 * dp, 4 * dp + 4))  # each DP rank: half the batch
    full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return {"losses": losses, "full": full, "local_rows": local_rows}


def test_tp_shard_with_fewer_rows_than_dp_ranks_trains_like_one_process():
    results = run_ranks(_tp_fsdp, 4)
    # mesh (dp_shard 2, tp 2): rank = 2 * dp + tp. "0.weight" has 3 rows: TP rank 0
    # holds 2 (1 per DP rank), TP rank 1 holds 1 (DP rank 0: 1 row, DP rank 1: none).
    assert [r["local_rows"]["0.weight"] for r in results] == [1, 1, 1, 0]
    assert [r["local_rows"]["0.bias"] for r in results] == [1, 1, 1, 0]
    reference = _model()
    # The global loss is the mean of the two DP halves' losses (equal sizes).
    losses = _train(reference, slice(0, 8))
    halves = [(a + b) / 2 for a, b in zip(results[0]["losses"], results[2]["losses"],
                                             strict=True)]  # DP ranks 0 and 1
    torch.testing.assert_close(halves, losses, rtol=1e-6, atol=1e-6)
    for r in results:
        for name, param in reference.named_parameters():
            torch.testing.assert_close(r["full"][name], param.detach(), rtol=1e-6, atol=1e-6,
                                       msg=name)


def test_dim0_rows_is_shard0_split():
    """``dim0_rows`` (used for sharding and for loading weights) gives the rows that
    ``Shard(0)`` gives each rank: ``torch.chunk`` pieces, then empty ones."""
    from simplefsdp.mesh import dim0_rows
    for rows in range(12):
        for parts in range(1, 6):
            pieces = torch.chunk(torch.arange(rows), parts) if rows else ()
            for index in range(parts):
                start, stop = dim0_rows(rows, parts, index)
                expected = pieces[index] if index < len(pieces) else torch.arange(0)
                assert torch.equal(torch.arange(rows)[start:stop], expected), \
                    (rows, parts, index)
