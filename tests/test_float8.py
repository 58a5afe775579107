"""Float8 training (``simplefsdp/float8.py``) on real gloo process groups.

* Parity: 2 ranks training the toy in float8 equal one process running the same recipe
  on the same micro-batches, **bitwise**. Dynamic scales depend on the whole tensor, so
  the reference runs each rank's micro-batch on its own (loss / 2 each, gradients
  accumulated): every float8 cast then sees the same values as on that rank (a weight
  shard cast with the agreed scale is exactly that slice of the whole cast), and halving
  a loss halves every gradient exactly (amax, scales and products scale by a power of
  two), so avg(g0, g1) and g0/2 + g1/2 round alike. The toy is untied here: a tied
  weight's two gradients would be added in another order.
* Bytes: a converted weight's all-gather moves float8 bytes (a ``uint8`` view), half the
  bf16 run's, plus one float32 amax per weight (all-reduced once per forward); counted
  from the compiled graphs and from the collectives eager mode issues, against a count
  by hand.
* Buckets never mix dtypes; a float8 run's checkpoint loads into a bf16 run and back;
  the export holds the high-precision weights; the refusals; the loss against bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
from rank_runner import run_ranks
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from toy import DIM, HIDDEN, Toy, global_batch, loss_fn

import simplefsdp as sf
from simplefsdp.compiler.collectives import ALL_GATHER, KINDS, is_data_parallel

STEPS = 3
# (recipe, all_gather, backend): eager and compiled float8 all-gathers, and rowwise
# (high-precision gather, the weight cast per matmul)
PARITY_CASES = (("tensorwise", True, None), ("tensorwise", True, "aot_eager"),
                ("rowwise", False, None))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _reference(recipe: str, all_gather: bool) -> tuple[list[float], dict]:
    """One process, the same float8 recipe, each rank's micro-batch on its own."""
    torch.manual_seed(0)
    model = sf.convert_to_float8(Toy(tie=False), recipe=recipe, all_gather=all_gather)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    losses = []
    for step in range(STEPS):
        tokens, total = global_batch(step, 2), 0.0
        for rank in range(2):
            loss = loss_fn(model, tokens[2 * rank:2 * rank + 2]) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: _full(v) for k, v in model.state_dict().items()}


def _parity_runs(rank: int, world: int, cases) -> list[tuple[list[float], dict]]:
    out = []
    mesh = sf.make_mesh(dp_shard=world, device_type="cpu")
    for recipe, all_gather, backend in cases:
        torch.manual_seed(0)
        model = sf.convert_to_float8(Toy(tie=False), recipe=recipe, all_gather=all_gather)
        model = sf.data_parallel(model, mesh)
        forward = model
        if backend is not None:
            torch._dynamo.reset()
            forward = torch.compile(model, fullgraph=True, backend=sf.compile_backend(
                backend=backend, bucketing="manual"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        losses = []
        for step in range(STEPS):
            loss = loss_fn(forward, global_batch(step, world)[2 * rank:2 * rank + 2])
            loss.backward()  # gradients averaged over the ranks (reduce_op="avg")
            opt.step()
            opt.zero_grad()
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss)
            losses.append(loss.item() / world)
        out.append((losses, {k: _full(v) for k, v in model.state_dict().items()}))
    return out


def test_two_ranks_equal_one_process():
    runs = run_ranks(_parity_runs, 2, PARITY_CASES)[0]
    for (recipe, all_gather, backend), (losses, state) in zip(PARITY_CASES, runs, strict=True):
        ref_losses, ref_state = _reference(recipe, all_gather)
        case = f"{recipe}, all_gather={all_gather}, {backend or 'eager'}"
        assert losses == pytest.approx(ref_losses, abs=1e-6), case  # float32 vs a double sum
        for name, value in ref_state.items():
            assert torch.equal(state[name], value), f"{case}: {name}"


# ---------------------------------------------------------------------------------------
# Bytes on the wire, and buckets.
# ---------------------------------------------------------------------------------------
class _CollectiveLog(TorchDispatchMode):
    """Every functional collective eager mode issues: (kind, dtype, full bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in KINDS:
            kind = KINDS[func].value
            full = out if kind == "all_gather" else args[0]
            self.records.append((kind, full.dtype, full.numel() * full.element_size()))
        return out


def _graph_collectives(graph) -> list[dict]:
    """Each collective start of a graph after our passes: its kind, dtype, full bytes,
    whether it is a data-parallel one, and its bucket members' (dtype, shard shape)."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in KINDS:
            continue
        kind = KINDS[node.target].value
        full = node.meta["val"] if node.target == ALL_GATHER else node.args[0].meta["val"]
        source = node.args[0]
        members = [source]
        if source.target == torch.ops.aten.cat.default:  # a bucket: its members' shards
            members = [m.args[0] if m.target == torch.ops.aten.reshape.default else m
                       for m in source.args[0]]
        found.append({"kind": kind, "dtype": full.dtype, "bytes": full.numel() *
                      full.element_size(), "ours": is_data_parallel(node),
                      "members": [(m.meta["val"].dtype, tuple(m.meta["val"].shape))
                                  for m in members]})
    return found


def _capturing_backend():
    backend = sf.compile_backend(backend="aot_eager", bucketing="manual")
    graphs, run_passes = [], backend.run_passes

    def capture(graph, cached=(None, None)):
        report = run_passes(graph, cached)
        graphs.append((report.graph, _graph_collectives(graph)))
        return report

    backend.run_passes = capture
    return backend, graphs


def _bytes_runs(rank: int, world: int) -> dict:
    """For the bf16 run and the float8 run: the collectives of one eager step and the
    compiled graphs' collectives."""
    mesh = sf.make_mesh(dp_shard=world, device_type="cpu")
    tokens = global_batch(0, world)[2 * rank:2 * rank + 2]
    out = {}
    for float8 in (False, True):
        model = Toy(tie=False)
        if float8:
            sf.convert_to_float8(model, all_gather=True)
        model = sf.data_parallel(model, mesh, mp_policy=sf.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        with _CollectiveLog() as log:
            loss_fn(model, tokens).backward()
        torch._dynamo.reset()
        backend, graphs = _capturing_backend()
        loss_fn(torch.compile(model, fullgraph=True, backend=backend), tokens).backward()
        out[float8] = (log.records, graphs)
    return out


def _converted_bytes_by_hand(element_size: int, world: int = 2) -> int:
    """All-gather bytes of the toy's converted weights (``up`` (7, 8) and ``down``
    (8, 7) in each of 2 blocks): each gathered as ``world`` pieces of
    ``ceil(rows / world)`` rows (uneven shards are padded)."""
    shapes = [(HIDDEN, DIM), (DIM, HIDDEN)] * 2
    return sum(math.ceil(r / world) * world * c * element_size for r, c in shapes)


@pytest.fixture(scope="module")
def bytes_runs():
    return run_ranks(_bytes_runs, 2)[0]


@pytest.mark.quick
def test_float8_gather_moves_half_the_bytes(bytes_runs):
    fp8, bf16 = _converted_bytes_by_hand(1), _converted_bytes_by_hand(2)
    assert fp8 == 240 and bf16 == 2 * fp8  # by hand: (8*8 + 8*7) * 2 blocks
    scales = 4 * 4  # one float32 amax per converted weight, all-reduced once per forward
    eager8, graphs8 = bytes_runs[True]
    eager16, graphs16 = bytes_runs[False]
    # eager: forward gathers, then backward gathers again (reshard after forward); the
    # backward's gathers agree their amax weight by weight (4 all-reduces of 4 bytes)
    assert sum(b for k, d, b in eager8 if d == torch.uint8) == 2 * fp8
    assert [b for k, d, b in eager8 if k == "all_reduce"] == [scales] + [4] * 4
    assert sum(b for k, d, b in eager16 if k == "all_gather") - \
        sum(b for k, d, b in eager8 if k == "all_gather" and d != torch.uint8) == 2 * bf16
    for name in ("forward", "backward"):  # the compiled graphs: the recompute gathers too
        g8 = [c for graph, cs in graphs8 if graph == name for c in cs]
        g16 = [c for graph, cs in graphs16 if graph == name for c in cs]
        assert _gathered(g8, torch.uint8) == fp8, name
        assert _gathered(g16, torch.bfloat16) == bf16, name
        assert _gathered(g8, torch.bfloat16) == 0, name  # none gathered in bf16 as well
        amax = [c["bytes"] for c in g8 if c["kind"] == "all_reduce"]
        assert amax == ([scales] if name == "forward" else []), name


def _gathered(collectives: list[dict], dtype: torch.dtype, world: int = 2) -> int:
    """Bytes all-gathered in ``dtype`` for the converted weights' shards ((4, 8): ``up``,
    (4, 7): ``down``; no other toy parameter has those shard shapes), bucketed or not."""
    shards = {(math.ceil(HIDDEN / world), DIM), (math.ceil(DIM / world), HIDDEN)}
    return sum(math.prod(shape) * dtype.itemsize * world for c in collectives
               if c["kind"] == "all_gather" for d, shape in c["members"]
               if d == dtype and shape in shards)


def test_buckets_never_mix_dtypes(bytes_runs):
    _, graphs8 = bytes_runs[True]
    gathers = [c for _, cs in graphs8 for c in cs if c["kind"] == "all_gather" and c["ours"]]
    # not vacuous: float8 and bf16 gathers in one graph, and some bucket merged several
    assert {c["dtype"] for c in gathers} == {torch.uint8, torch.bfloat16}
    assert any(len(c["members"]) > 1 and c["dtype"] == torch.uint8 for c in gathers)
    for c in gathers:
        assert {d for d, _ in c["members"]} == {c["dtype"]}, c
