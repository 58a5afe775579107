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
from toy import DIM, HIDDEN, OpCalls, Toy, global_batch, loss_fn

import simplefsdp as sf
from simplefsdp.compiler.collectives import ALL_GATHER, KINDS, find_collectives, is_data_parallel
from simplefsdp.float8 import Float8Linear

STEPS = 3
# (recipe, all_gather, backend): eager and compiled float8 all-gathers, and rowwise
# (high-precision gather, the weight cast per matmul)
PARITY_CASES = (("tensorwise", True, None), ("tensorwise", True, "aot_eager"),
                ("rowwise", False, None))


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _reference(recipe: str, all_gather: bool) -> tuple[list[float], dict]:
    """One process, the same float8 recipe, each rank's micro-batch on its own; on one
    thread, as the ranks run (rank_runner): a CPU matmul may split its sums differently
    with another thread count, and the comparison is bitwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _one_process(recipe, all_gather)
    finally:
        torch.set_num_threads(threads)


def _one_process(recipe: str, all_gather: bool) -> tuple[list[float], dict]:
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
    whether it is a data-parallel one, the bytes our passes' cost model counts for it
    (``Collective.nbytes``), and its bucket members' (dtype, shard shape)."""
    found, costed = [], {c.start: c.nbytes for c in find_collectives(graph)}
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
                      "costed": costed.get(node),  # what bucketing's cost model reads
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
    # eager: forward gathers, then backward gathers again (reshard after forward), with
    # the scales the forward agreed (the shards are unchanged): no all-reduce of its own
    assert sum(b for k, d, b in eager8 if d == torch.uint8) == 2 * fp8
    assert [b for k, d, b in eager8 if k == "all_reduce"] == [scales]
    assert sum(b for k, d, b in eager16 if k == "all_gather") - \
        sum(b for k, d, b in eager8 if k == "all_gather" and d != torch.uint8) == 2 * bf16
    for name in ("forward", "backward"):  # the compiled graphs: the recompute gathers too
        g8 = [c for graph, cs in graphs8 if graph == name for c in cs]
        g16 = [c for graph, cs in graphs16 if graph == name for c in cs]
        assert _gathered(g8, torch.uint8) == fp8, name
        assert _gathered(g16, torch.bfloat16) == bf16, name
        assert _gathered(g8, torch.bfloat16) == 0, name  # none gathered in bf16 as well
        # the auto-wrap cost model and bucket reports count the bytes moved: uint8's
        assert all(c["costed"] == c["bytes"] for c in g8 if c["ours"]), name
        amax = [c["bytes"] for c in g8 if c["kind"] == "all_reduce"]
        assert amax == ([scales] if name == "forward" else []), name
    # gradients stay high precision: every reduce-scatter runs in the reduce dtype
    scatters = [c["dtype"] for _, cs in graphs8 for c in cs if c["kind"] == "reduce_scatter"]
    scatters += [d for k, d, _ in eager8 if k == "reduce_scatter"]
    assert len(scatters) > 8 and set(scatters) == {torch.float32}


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


# ---------------------------------------------------------------------------------------
# Checkpoints and export: float8 is a compute and communication format.
# ---------------------------------------------------------------------------------------
def _toy(rank: int, world: int, float8: bool):
    torch.manual_seed(rank + 10 * float8)  # different starting values: loading must move them
    model = Toy()
    if float8:
        sf.convert_to_float8(model, all_gather=True)
    mp = sf.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return sf.data_parallel(model, sf.make_mesh(dp_shard=world, device_type="cpu"),
                            mp_policy=mp)


def _step(model, rank: int, world: int, step: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn(model, global_batch(step, world)[2 * rank:2 * rank + 2]).backward()
    opt.step()


def _same_state(a, b) -> bool:
    return all(torch.equal(_full(x), _full(y)) for x, y in
               zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def _replicate_refused(world: int) -> str:
    """The float8 all-gather under ``mode="replicate"``: refused by data_parallel."""
    model = sf.convert_to_float8(Toy(), all_gather=True)
    try:
        sf.data_parallel(model, sf.make_mesh(dp_replicate=world, dp_shard=1,
                                             device_type="cpu"), mode="replicate")
    except ValueError as err:
        return str(err)
    return "accepted"


def _checkpoint_round_trip(rank: int, world: int, folder: str) -> dict:
    from safetensors.torch import load_file
    from transformers import PretrainedConfig

    from simplefsdp.hf.export import export_hf

    refused = _replicate_refused(world)
    f8, bf16 = _toy(rank, world, True), _toy(rank, world, False)
    assert list(f8.state_dict()) == list(bf16.state_dict())  # the same names, no extras
    _step(f8, rank, world, 0)
    sf.save_checkpoint(f"{folder}/float8", {"model": f8.state_dict()})
    sf.load_checkpoint(f"{folder}/float8", {"model": bf16.state_dict()})
    into_bf16 = _same_state(f8, bf16)
    _step(bf16, rank, world, 1)  # the bf16 run trains on, then hands back to float8
    sf.save_checkpoint(f"{folder}/bf16", {"model": bf16.state_dict()})
    sf.load_checkpoint(f"{folder}/bf16", {"model": f8.state_dict()})
    back = _same_state(f8, bf16)
    _step(f8, rank, world, 2)  # and the float8 model still trains from it
    export_hf(f8, f"{folder}/hf", PretrainedConfig())
    full = {k: _full(v) for k, v in f8.state_dict().items()}
    if rank != 0:
        return {}
    files = load_file(f"{folder}/hf/model.safetensors")
    exported = all(torch.equal(files[k], full[k]) for k in files)
    return {"refused": refused, "into_bf16": into_bf16, "back": back, "exported": exported,
            "dtypes": {str(t.dtype) for t in files.values()}, "names": sorted(files)}


def test_checkpoint_loads_into_bf16_and_back(tmp_path):
    report = run_ranks(_checkpoint_round_trip, 2, str(tmp_path))[0]
    assert report["into_bf16"] and report["back"] and report["exported"], report
    assert report["dtypes"] == {"torch.float32"}  # the master weights, never float8
    assert "layers.0.up.weight" in report["names"]
    assert "mode='fully_shard'" in report["refused"]  # the float8 gather outside fully_shard


# ---------------------------------------------------------------------------------------
# Refusals: before any work, naming the key or argument and the fix.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--float8.recipe", "blockwise"], "float8.recipe"),
    (["--float8.recipe", "rowwise"], "float8.all_gather = true needs float8.recipe"),
    (["--parallel.dp_mode", "replicate", "--parallel.dp_shard", "1",
      "--parallel.dp_replicate", "2"], "float8.all_gather = true gathers fully_shard"),
    (["--parallel.tp", "2", "--float8.all_gather", "false", "--float8.recipe", "rowwise"],
     "float8.recipe = 'rowwise' with parallel.tp = 2: .* set float8.recipe = 'tensorwise'"),
    (["--lora.enable", "true"], "float8.enable = true with lora.enable = true"),
])
def test_config_refusals(flags, message):
    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        cfg = load_config(None, ["--float8.enable", "true", *flags])
        cfg.validate(world_size=2)


def test_config_refuses_the_float8_gather_with_a_reshard_group():
    """An int reshard reads its weights through its own gathers (reshard_group.py), which
    the float8 hook does not take: refused, not silently gathered in bf16."""
    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError

    argv = ["--float8.enable", "true", "--parallel.reshard_after_forward", "2"]
    with pytest.raises(ConfigError, match=r"float8\.all_gather = true is not built with an "
                                          r"int parallel\.reshard_after_forward \(2\)"):
        load_config(None, argv, world_size=4).validate(world_size=4)
    load_config(None, [*argv, "--float8.all_gather", "false"],
                world_size=4).validate(world_size=4)  # fine: no float8 gather


def test_api_refusals(monkeypatch):
    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError

    with pytest.raises(ValueError, match="recipe 'blockwise' is unknown"):
        sf.convert_to_float8(Toy(), recipe="blockwise")
    with pytest.raises(ValueError, match="needs recipe='tensorwise'"):
        sf.convert_to_float8(Toy(), recipe="rowwise", all_gather=True)
    model = sf.convert_to_float8(Toy(), exclude=[])
    assert model.float8_modules == ["layers.0.up", "layers.0.down", "layers.1.up",
                                    "layers.1.down"]  # the output head is tied: left out
    monkeypatch.delattr(torch, "_scaled_mm")
    with pytest.raises(RuntimeError, match="has no _scaled_mm"):
        sf.convert_to_float8(Toy())
    with pytest.raises(ConfigError, match="float8.enable = true needs torch._scaled_mm"):
        load_config(None, ["--float8.enable", "true"]).validate(world_size=1)




# ---------------------------------------------------------------------------------------
# Loss against bf16 on the debug config.
# ---------------------------------------------------------------------------------------
# |float8 loss - bf16 loss| per step, both from one seed, bf16 parameters and fp32
# reductions, 2 ranks. scripts/float8_loss_gap.py measured it over 200 steps (the largest
# gap and the date: docs/performance.md); the bound leaves ~30% over that for rounding
# that differs with thread counts and machines. The test runs the first steps only: the
# first forward (float8 casts of the initial weights), then two steps on weights the
# float8 gradients and updates moved; the long comparison is the script's.
LOSS_GAP = 0.025
GAP_STEPS = 3


def _losses(rank: int, world: int, out: str) -> dict[str, list[float]]:
    from simplefsdp.train.__main__ import main

    runs = {}
    for name in ("bf16", "float8"):
        result = main(["--training.steps", str(GAP_STEPS), "--metrics.log_every", "1",
                       "--training.mixed_precision_param", "bfloat16",
                       "--float8.enable", str(name == "float8").lower(),
                       "--metrics.output_dir", f"{out}/{name}"])
        runs[name] = list(result.losses)
    return runs


def test_float8_loss_stays_near_bf16(tmp_path):
    runs = run_ranks(_losses, 2, str(tmp_path))[0]
    assert len(runs["bf16"]) == len(runs["float8"]) == GAP_STEPS
    gaps = [abs(a - b) for a, b in zip(runs["bf16"], runs["float8"], strict=True)]
    assert max(gaps) <= LOSS_GAP, gaps
    assert runs["float8"] != runs["bf16"]  # float8 did run: its rounding shows


# ---------------------------------------------------------------------------------------
# The planner: float8 matmuls at the float8 tensor cores' rate.
# ---------------------------------------------------------------------------------------
def test_planner_prices_float8_matmuls_at_the_float8_peak():
    """One float8 matmul of a traced step, (8192 x 4096) @ (4096 x 4096), on the H100 of
    the published runs, by hand: 2 x 8192 x 4096^2 = 2.749e11 FLOPs at 60% (the matmul
    efficiency) of 1,979 TFLOP/s dense float8 = 0.2315 ms, FLOP-bound (its 32 + 16 MiB
    of operands and 64 MiB of output take 0.07 ms at 70% of 2.4 TB/s), plus the compiled
    kernel floor (3 us); bf16 takes the 989 TFLOP/s peak. A GPU without float8 tensor
    cores (A100) is refused. Relative tolerance 1e-9: float rounding of the same sums."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from simplefsdp.hardware import GPU_PROFILES
    from simplefsdp.plan.timing import _flops, node_seconds

    graph = torch.fx.Graph()
    with FakeTensorMode():
        vals = {"a": torch.empty(8192, 4096, dtype=torch.float8_e4m3fn),
                "b": torch.empty(4096, 4096, dtype=torch.float8_e4m3fn).t(),
                "sa": torch.empty(()), "sb": torch.empty(()),
                "out": torch.empty(8192, 4096, dtype=torch.bfloat16),
                "a16": torch.empty(8192, 4096, dtype=torch.bfloat16),
                "b16": torch.empty(4096, 4096, dtype=torch.bfloat16).t()}
    nodes = {}
    for name, value in vals.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = value
    fp8 = graph.call_function(torch.ops.aten._scaled_mm.default,
                              tuple(nodes[n] for n in ("a", "b", "sa", "sb")),
                              {"out_dtype": torch.bfloat16})
    bf16 = graph.call_function(torch.ops.aten.mm.default, (nodes["a16"], nodes["b16"]))
    fp8.meta["val"] = bf16.meta["val"] = vals["out"]
    flops = 2 * 8192 * 4096 * 4096
    assert _flops(fp8) == _flops(bf16) == ("matmul", flops)
    dev = GPU_PROFILES["h100-96gb"]
    assert node_seconds(fp8, dev, compiled=True) == pytest.approx(
        flops / (1979e12 * 0.60) + 3e-6, rel=1e-9)
    assert node_seconds(bf16, dev, compiled=True) == pytest.approx(
        flops / (989e12 * 0.60) + 3e-6, rel=1e-9)
    with pytest.raises(ValueError, match="no float8 tensor cores"):
        node_seconds(fp8, GPU_PROFILES["a100-80gb"], compiled=True)


def _planner_trace(float8: bool) -> dict:
    """In the planner's process: the debug Llama's one-block trace (FSDP 2, compiled,
    manual buckets, bf16 parameters), summarized: the float8 matmuls of each graph, the
    all-gather bytes by dtype, the prologue's collectives, and the step's prediction on
    8 H100 with and without float8's own rate."""
    from simplefsdp.compiler.collectives import full_value
    from simplefsdp.config.job import load_config
    from simplefsdp.plan.trace import trace, trace_key

    cfg = load_config(None, ["--float8.enable", str(float8).lower(), "--compile.enable",
                             "true", "--compile.bucketing", "manual",
                             "--training.mixed_precision_param", "bfloat16"])
    tr = trace(trace_key(cfg, "full", 1, 1, 1, 2))

    def summary(gm) -> dict:
        gathered: dict[str, int] = {}
        for node in gm.graph.nodes:
            if node.target in KINDS and KINDS[node.target].value == "all_gather":
                val = full_value(node)
                key = str(val.dtype)
                gathered[key] = gathered.get(key, 0) + val.numel() * val.element_size()
        scaled = sum(n.target == torch.ops.aten._scaled_mm.default for n in gm.graph.nodes)
        return {"scaled_mm": scaled, "gathered": gathered}

    prologue = [(KINDS[n.target].value, str(n.args[0].meta["val"].dtype),
                 tuple(n.args[0].meta["val"].shape))
                for g in tr.prologue for n in g.graph.nodes if n.target in KINDS]
    return {"forward": summary(tr.forward), "backward": summary(tr.backward),
            "prologue": prologue}


def test_planner_traces_a_float8_step(planner):
    """The planner traces ``[float8]`` as the trainer runs it (it refused it before:
    the root's scale-agreeing pre-hook compiles as its own inference graph, and the
    capture took it for the forward). One block of the debug Llama (dim 128, 4 heads,
    2 KV heads, FFN 352) on FSDP 2, by hand: its 7 converted linears (wq, wo 128 x 128;
    wk, wv 64 x 128; w1, w3 352 x 128; w2 128 x 352: 184,320 weights) run 7 float8
    matmuls forward and 14 backward; their all-gathers move 184,320 uint8 bytes where
    the bf16 trace moves them as 368,640 bf16 bytes (the rest, norms, embedding and
    head, is bf16 in both); the prologue all-reduces the 7 weights' float32 amaxes."""
    f8, bf16 = planner(_planner_trace, True), planner(_planner_trace, False)
    converted = 2 * 128 * 128 + 2 * 64 * 128 + 3 * 352 * 128
    assert (f8["forward"]["scaled_mm"], f8["backward"]["scaled_mm"]) == (7, 14), f8
    assert (bf16["forward"]["scaled_mm"], bf16["backward"]["scaled_mm"]) == (0, 0), bf16
    assert f8["forward"]["gathered"]["torch.uint8"] == converted, f8
    assert bf16["forward"]["gathered"]["torch.bfloat16"] \
        - f8["forward"]["gathered"]["torch.bfloat16"] == 2 * converted, (f8, bf16)
    assert f8["prologue"] == [("all_reduce", "torch.float32", (7,))], f8
    assert bf16["prologue"] == [], bf16


# ---------------------------------------------------------------------------------------
# Tensor parallelism (tensorwise): the amax of each split operand agreed over TP.
# ---------------------------------------------------------------------------------------
TP_IN, TP_HIDDEN, TP_OUT = 16, 32, 8


def _tp_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(TP_IN, TP_HIDDEN, bias=False),
                                torch.nn.Tanh(),
                                torch.nn.Linear(TP_HIDDEN, TP_OUT, bias=False))
    return sf.convert_to_float8(model, recipe="tensorwise", exclude=[])


def _tp_batch(step: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel part ``part`` of step ``step``'s batch (TP ranks share theirs)."""
    g = torch.Generator().manual_seed(100 * step + part)
    return torch.randn(2, 6, TP_IN, generator=g) * 3, torch.randn(2, 6, TP_OUT, generator=g)


def _tp_train(model, forward, dp_parts: list[int], divisor: int) -> list[float]:
    """SGD steps on the data-parallel parts' losses / ``divisor`` (one process: every
    part in turn, divided by their count, gradients accumulated; ranks: their own part,
    whose gradients data_parallel averages)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for part in dp_parts:
            x, y = _tp_batch(step, part)
            loss = torch.nn.functional.mse_loss(forward(x), y) / divisor
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _tp_reference(dp: int) -> tuple[list[float], dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run
    try:
        model = _tp_model()
        losses = _tp_train(model, model, list(range(dp)), dp)
        return losses, {k: _full(v) for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _tp_runs(rank: int, world: int, backends) -> list[tuple[list[float], dict]]:
    """TP 2 (x FSDP over the rest): the first Linear column-wise, the second row-wise."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dp = world // 2
    mesh = sf.make_mesh(dp_shard=dp, tp=2)
    out = []
    for backend in backends:
        model = parallelize_module(_tp_model(), mesh["tp"],
                                   {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if dp > 1:
            sf.data_parallel(model, mesh["dp_shard"])
        forward = model
        if backend is not None:
            torch._dynamo.reset()
            forward = torch.compile(model, fullgraph=True, backend=sf.compile_backend(
                backend=backend, bucketing="manual"))
        dp_rank = mesh["dp_shard"].get_local_rank()
        loss = torch.tensor(_tp_train(model, forward, [dp_rank], 1)) / dp
        torch.distributed.all_reduce(loss, group=mesh["dp_shard"].get_group())
        out.append((loss.tolist(), {k: _full(v) for k, v in model.state_dict().items()}))
    return out


# Tolerance: the row-wise layer sums its contraction dim in two pieces (one per TP rank)
# and adds them, one process in one piece, so its float32 output differs by rounding
# (~1e-7 relative); everything cast to float8 is cast with the whole tensor's scale, so
# the float8 operands agree (a per-shard scale would move weights by up to a float8 step,
# 1/16 relative, far over this bound). 1e-5 leaves room for 3 SGD steps of float32
# rounding; a float8 cast of a value within ~1e-7 of a rounding boundary could still
# flip it: these seeds' runs do not.
TP_TOL = 1e-5


@pytest.mark.many_ranks
@pytest.mark.parametrize("dp, backends", [
    (1, (None, "aot_eager")), pytest.param(2, (None,), marks=pytest.mark.quick)],
    ids=["tp2", "tp2_fsdp2"])
def test_tensor_parallel_float8_equals_one_process(dp, backends):
    runs = run_ranks(_tp_runs, 2 * dp, backends)
    ref_losses, ref_state = _tp_reference(dp)
    for rank_runs in runs:
        for backend, (losses, state) in zip(backends, rank_runs, strict=True):
            case = f"TP 2 x FSDP {dp}, {backend or 'eager'}"
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                       rtol=TP_TOL, atol=TP_TOL, msg=case)
            for name, value in ref_state.items():
                torch.testing.assert_close(state[name], value, rtol=TP_TOL, atol=TP_TOL,
                                           msg=f"{case}: {name}")


# ---------------------------------------------------------------------------------------
# Gradient sync off: the float8 gather's gradients accumulate, then reduce once.
# ---------------------------------------------------------------------------------------
MICRO = 3


def _accumulated(rank: int, world: int) -> dict:
    """One optimizer step's worth of MICRO micro-steps on the toy (float8 all-gather),
    twice from one seed: sync on every micro-step, and sync off for all but the last;
    the accumulated gradients (whole) and the reduce-scatters each issued."""
    mesh = sf.make_mesh(dp_shard=world, device_type="cpu")
    out = {}
    for sync_every_step in (True, False):
        torch.manual_seed(0)
        model = sf.convert_to_float8(Toy(tie=False), all_gather=True)
        model = sf.data_parallel(model, mesh)
        with _CollectiveLog() as log:
            for micro in range(MICRO):
                model.set_requires_gradient_sync(sync_every_step or micro == MICRO - 1)
                loss_fn(model, global_batch(micro, world)[2 * rank:2 * rank + 2]).backward()
        # (the toy's final norm's bias takes no gradient: None in both runs)
        grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        scatters = sum(kind == "reduce_scatter" for kind, _, _ in log.records)
        out[sync_every_step] = (grads, scatters)
    return out


# Tolerance: sync on sums avg_r(g[m, r]) over micro-steps m, sync off avg_r(sum_m g[m,
# r]): the same float32 terms in another order (the float8 casts see the same values in
# both: each micro-step's forward and backward are unchanged), so a few ulp of the O(1)
# gradients; 2e-6 absolute, as tests/test_gradient_sync.py.
SYNC_TOL = 2e-6


@pytest.mark.quick
def test_float8_gather_with_gradient_sync_off_equals_sync_on():
    for rank_out in run_ranks(_accumulated, 2):
        (on, on_scatters), (off, off_scatters) = rank_out[True], rank_out[False]
        assert on.keys() == off.keys() and "layers.0.up.weight" in on
        for name, grad in on.items():
            torch.testing.assert_close(off[name], grad, rtol=0, atol=SYNC_TOL, msg=name)
        # the reduce-scatters of one micro-step, issued once instead of MICRO times
        assert on_scatters == MICRO * off_scatters > 0, (on_scatters, off_scatters)


# ------------------------------------------------------------ selective AC with float8
def _float8_block_step(ac: str) -> tuple[float, dict, int, int]:
    """One process: a 2-block Llama converted to float8 (tensorwise), one forward and
    backward under ``ac``; (loss, gradients, float8 matmuls in forward, in backward)."""
    from simplefsdp.models.llama import ModelArgs, Transformer
    from simplefsdp.parallel.activation_checkpoint import apply_ac

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                  vocab_size=64, multiple_of=16, max_seq_len=16))
    sf.convert_to_float8(model, recipe="tensorwise")
    apply_ac(model, ac)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    with OpCalls(torch.ops.aten._scaled_mm.default) as forward:
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    with OpCalls(torch.ops.aten._scaled_mm.default) as backward:
        loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
             for n, p in model.named_parameters()}  # the names without AC's wrapper
    return loss.item(), grads, forward.calls, backward.calls


def test_selective_ac_keeps_every_other_float8_matmul():
    """Selective AC counts a float8 linear's ``_scaled_mm`` as the matmul it is: each
    block keeps wq, wv, w1, w2's outputs and recomputes wk, wo, w3 (its 2nd, 4th and 6th
    of 7), as for high-precision ``mm``; before, no ``_scaled_mm`` output was kept and
    all 7 ran again. Counted: the backward's float8 matmuls beyond the run without AC
    (2 per linear: dX and dW) are the recomputed ones, 3 a block x 2 blocks; full AC
    recomputes all 7. Recomputation repeats the same ops: bitwise the same loss and
    gradients."""
    loss, grads, forward, backward = _float8_block_step("none")
    assert forward == 2 * 7  # the output head stays high precision
    assert backward == 2 * forward
    for ac, recomputed in (("selective", 2 * 3), ("full", 2 * 7)):
        ac_loss, ac_grads, ac_forward, ac_backward = _float8_block_step(ac)
        assert (ac_forward, ac_backward - backward) == (forward, recomputed), ac
        assert ac_loss == loss and grads.keys() == ac_grads.keys()
        assert all(torch.equal(grads[n], ac_grads[n]) for n in grads), ac


# ------------------------------------- activation checkpointing with the float8 gather
def _llama(world: int, ac: str):
    """A 2-block Llama, float8 (tensorwise) with the float8 all-gather, under ``ac``, on
    ``world`` ranks: the trainer's order (convert, checkpoint, shard)."""
    from simplefsdp.models.llama import ModelArgs, Transformer
    from simplefsdp.parallel.activation_checkpoint import apply_ac

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                  vocab_size=64, multiple_of=16, max_seq_len=16))
    sf.convert_to_float8(model, recipe="tensorwise", all_gather=True)
    apply_ac(model, ac)
    return sf.data_parallel(model, sf.make_mesh(dp_shard=world, device_type="cpu"))


def _gathered_ac_steps(rank: int, world: int) -> dict:
    """Two optimizer steps per AC mode (losses, whole gradients), and one block called
    on its own after the last step, before and after a forward of the whole model."""
    tokens = torch.randint(0, 64, (2 * world, 17), generator=torch.Generator().manual_seed(1))
    mine = tokens[2 * rank:2 * rank + 2]
    out = {}
    for ac in ("none", "selective", "full"):
        model = _llama(world, ac)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        steps = []
        for _ in range(2):
            logits = model(mine[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
            loss.backward()
            steps.append((loss.item(), {n.replace("._checkpoint_wrapped_module", ""):
                                        _full(p.grad) for n, p in model.named_parameters()}))
            opt.step()
            opt.zero_grad()
        out[ac] = steps
    # the optimizer changed every weight since the last forward agreed their scales: a
    # linear called on its own must agree new ones, as the next forward of the model does
    linear = next(m for m in model.modules() if isinstance(m, Float8Linear))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = linear(x)
        model(mine[:, :-1])  # agrees every scale from the weights as they are now
        after_forward = linear(x)
    return out | {"alone": alone, "after_forward": after_forward}


def test_activation_checkpointing_with_the_float8_gather_equals_none():
    """Selective and full AC with float8-gathered weights, eager, 2 ranks: the same
    losses and gradients, bitwise, as without AC, over two optimizer steps (the
    recomputation casts with the scale the forward agreed: a selective block replays
    its kept ops by count and failed the backward when the recomputation agreed a
    scale again). A weight read after the optimizer step, outside the model's forward,
    casts with its new amax."""
    for out in run_ranks(_gathered_ac_steps, 2):
        reference = out["none"]
        for ac in ("selective", "full"):
            for (loss, grads), (ref_loss, ref_grads) in zip(out[ac], reference, strict=True):
                assert loss == ref_loss, ac
                assert grads.keys() == ref_grads.keys()
                assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), ac
        assert torch.equal(out["alone"], out["after_forward"])


@pytest.mark.quick
def test_rowwise_scales_without_a_rowwise_cpu_kernel_match_the_kernel(monkeypatch):
    """torch 2.11's CPU ``_scaled_mm`` takes tensorwise scales only; there ``scaled_mm``
    dequantizes and multiplies in float32. That path (forced), and the kernel where this
    torch's takes rowwise scales, must equal the product computed in float64 up to float32
    sums: within 2 k eps32 (|A| @ |B|) per element (k terms), plus one bf16 rounding step
    (2^-8 relative) where the output is bf16. A scale left out or applied twice is off by
    the scales' spread (1e2 here), far beyond."""
    from simplefsdp._torch_compat import float8 as compat

    paths = [True, False] if compat._cpu_takes_rowwise_scales() else [False]
    torch.manual_seed(0)
    for m, k, n in ((32, 64, 48), (7, 96, 5), (128, 32, 16)):
        a, b = torch.randn(m, k) * torch.logspace(-1, 1, m)[:, None], torch.randn(n, k)
        sa, sb = a.abs().amax(1, keepdim=True) / 448, b.abs().amax(1, keepdim=True).t() / 448
        a8 = (a / sa).to(torch.float8_e4m3fn)
        b8 = (b / sb.t()).to(torch.float8_e4m3fn).t()
        exact = (a8.double() * sa.double()) @ (b8.double() * sb.double())
        magnitude = exact.new_tensor((a8.double() * sa).abs() @ (b8.double() * sb).abs())
        for dtype, kernel in ((d, p) for d in (torch.bfloat16, torch.float32) for p in paths):
            with monkeypatch.context() as patch:
                patch.setattr(compat, "_cpu_takes_rowwise_scales", lambda k=kernel: k)
                got = compat.scaled_mm(a8, b8, sa, sb, dtype)
            bound = 2 * k * 2**-24 * magnitude
            if dtype == torch.bfloat16:
                bound = bound + exact.abs() * 2**-8
            assert got.dtype == dtype
            assert ((got.double() - exact).abs() <= bound).all(), (m, k, n, dtype, kernel)
