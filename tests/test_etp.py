"""Expert tensor parallelism (``parallel.etp``, ``parallel/expert_tensor.py``): each routed
expert's width stored split over the TP ranks, every TP rank computing its slice for the
routed slots of its whole TP group.

* the trainer, against ``etp = 1`` on the same ranks and global batch: DDP x TP 2 on 2
  ranks, and FSDP 2 x TP 2 x EP 2 on 4 (losses, exported parameters), with the experts'
  stored and gathered bytes per rank counted; the 4-rank runs' checkpoints resumed across
  ``etp`` (``etp = 2`` into ``etp = 1`` and back: DCP resharding);
* one MoE layer by hand: the routed grouped matmuls' FLOPs per TP rank (counted with
  ``FlopCounterMode``), its output and each rank's stored weight slice's gradient;
* bad input refused at config load, naming the key.

The 8-rank HSDP command is in docs/moe.md."""

from __future__ import annotations

import pytest
import torch
from rank_runner import run_ranks
from toy import relabel_odd_bytes

from simplefsdp._torch_compat import dynamo_counters
from simplefsdp.config.job import load_config
from simplefsdp.errors import ConfigError

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

# test_moe_trainer's tiny debug_moe: 2 blocks of width 32, 4 experts of width 32, top-2,
# a shared expert, a balance loss with a large coefficient.
TINY = ["--model.name", "debug_moe", "--model.dim", "32", "--model.n_layers", "2",
        "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.num_experts", "4",
        "--model.moe_hidden_dim", "32", "--model.shared_hidden_dim", "32",
        "--model.aux_loss_coef", "0.1", "--training.seq_len", "32",
        "--training.batch_size", "2", "--training.steps", "3", "--training.warmup_steps", "1",
        "--training.lr", "1e-2", "--checkpoint.export_safetensors", "true"]
TP2 = ["--parallel.tp", "2"]
DDP_TP2 = [*TP2, "--parallel.dp_mode", "replicate"]  # 2 ranks: DDP 1 x TP 2
FSDP_TP2_EP2 = [*TP2, "--parallel.ep", "2"]  # 4 ranks: FSDP 2 x TP 2, EP 2
PP2_TP2 = [*TP2, "--parallel.pp", "2"]  # 4 ranks: 2 stages of one block, TP 2
COMPILED = ["--compile.enable", "true", "--compile.backend", "aot_eager"]
# The routed experts' weights in TINY: 2 layers x (gate_up [4, 64, 32] + down [4, 32, 32]).
EXPERT_ELEMENTS = 2 * (4 * 64 * 32 + 4 * 32 * 32)


class GatherCount:
    """Counts, in one rank, what ``data_parallel``'s reads of the routed experts' weights
    (the 3-D parameters) store and gather: ``stored``, the bytes of their shards on this
    rank; ``gathered``, the bytes the reads return (what a rank materializes, summed over
    the reads: forward and the backward's re-gathers); ``moved``, those minus the rank's
    own shard (what the all-gathers bring from other ranks)."""

    def __init__(self):
        import importlib

        dp_module = importlib.import_module("simplefsdp.data_parallel")

        self.original = dp_module._ReplicateComputation._gather
        self.shards: dict[tuple, int] = {}
        self.gathered = self.moved = self.reads = 0

        def counted(gather, sharded, replica_step=None):
            out = self.original(gather, sharded, replica_step)
            if sharded.dim() == 3 and not torch.compiler.is_compiling():  # eager runs
                own = sharded.to_local()
                self.shards[(own.data_ptr(), tuple(sharded.shape))] = own.nbytes
                self.gathered += out.nbytes
                self.moved += out.nbytes - own.nbytes
                self.reads += 1
            return out

        dp_module._ReplicateComputation._gather = counted
        self.module = dp_module

    def take(self) -> dict:
        found = {"stored": sum(self.shards.values()), "gathered": self.gathered,
                 "moved": self.moved, "reads": self.reads}
        self.shards, self.gathered, self.moved, self.reads = {}, 0, 0, 0
        return found

    def close(self) -> None:
        self.module._ReplicateComputation._gather = self.original


def _run(flags: list[str], out: str, count: GatherCount) -> dict:
    from simplefsdp.train.__main__ import main

    losses = main([*TINY, *flags, "--metrics.output_dir", out],
                  batch_transform=relabel_odd_bytes).losses
    return {"losses": losses, **count.take()}


def _train(rank: int, world: int, out: str, runs: dict[str, tuple]) -> dict:
    """Each of ``runs`` (``{name: (layout flags, resume, compiled)}``) with ETP 1, then
    ETP 2, on these ranks, counting the experts' bytes (in ``{name: found}``); with
    ``compiled``, ETP 2 compiled too (aot_eager: its graph breaks counted); with
    ``resume`` each eager run also checkpoints after step 2, and each checkpoint is
    resumed by the other ``etp`` for step 3 (``from1``: ETP 1's, run with ETP 2;
    ``from2``: ETP 2's, run with ETP 1)."""
    count = GatherCount()
    try:
        return {name: _layout(rank, f"{out}/{name}", *run, count)
                for name, run in runs.items()}
    finally:
        count.close()


def _layout(rank: int, out: str, layout: list[str], resume: bool, compiled: bool,
            count: GatherCount) -> dict:
    """One entry of :func:`_train`'s ``runs``."""
    import shutil

    import torch.distributed as dist

    found = {}
    saving = ["--checkpoint.enable", "true", "--checkpoint.every", "2"] if resume else []
    for etp in (1, 2):
        found[etp] = _run([*layout, *saving, "--parallel.etp", str(etp)],
                          f"{out}/etp{etp}", count)
    if compiled:
        dynamo_counters().clear()
        found["compiled"] = _run([*layout, "--parallel.etp", "2", *COMPILED],
                                 f"{out}/compiled", count)
        found["compiled"]["breaks"] = dict(dynamo_counters()["graph_break"])
    if resume:
        for etp, other in ((1, 2), (2, 1)):
            if rank == 0:  # the other run's checkpoint at step 2 (step 3's is later)
                shutil.copytree(f"{out}/etp{etp}/checkpoints/step-2",
                                f"{out}/from{etp}/checkpoints/step-2")
            dist.barrier()
            found[f"from{etp}"] = _run(
                [*layout, *saving, "--checkpoint.resume", "true", "--parallel.etp",
                 str(other)], f"{out}/from{etp}", count)
    return found


def _params(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _initial_down() -> torch.Tensor:
    """The trainer's initial ``layers.1`` down-projection (seed 0, initialized on a
    meta-built model, as test_moe_trainer's ``_initial_model``)."""
    from simplefsdp.models import moe

    torch.manual_seed(0)
    with torch.device("meta"):
        model = moe.MoETransformer(load_config(None, TINY).model.model_args())
    model.to_empty(device="cpu")
    model.init_weights()
    return model.state_dict()["layers.1.feed_forward.experts.down_proj"]


def _assert_same_model(got: dict, want: dict) -> None:
    """Exported parameters within test_moe_trainer's TP tolerance (3.5e-5 absolute:
    AdamW's first steps move a weight whose gradient is near eps by up to ~lr, so a
    few-ulp gradient difference shows there; a lost slice or a doubled gradient moves
    thousands of elements by ~1e-3)."""
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=3.5e-5, msg=name)
    moved = got["layers.1.feed_forward.experts.down_proj"] - _initial_down()
    assert moved.abs().max() > 1e-3  # the comparison is not between two initial models


def _assert_etp2_matches_etp1(results: list[dict], out) -> None:
    """ETP 2's losses (every rank) within 1e-6 relative of ETP 1's and its exported model
    within :func:`_assert_same_model`'s tolerance: routing is the same (the router and
    everything outside the experts is unchanged); only each expert's down-projection is
    summed in TP partial sums instead of in one matmul, a float32 reordering of a few ulps."""
    for found in results:
        assert found[2]["losses"] == pytest.approx(results[0][1]["losses"], rel=1e-6)
    _assert_same_model(_params(out / "etp2"), _params(out / "etp1"))


def _assert_half_per_read(etp1: dict, etp2: dict) -> None:
    """Each read of an ETP 2 run returns half the bytes of an ETP 1 read, and the run's
    reads return at most half the bytes in all (ETP 2 skips the backward's re-gather
    where the experts' data-parallel mesh has one rank: nothing to free)."""
    assert etp1["reads"] > 0 and etp2["reads"] > 0
    assert etp2["gathered"] * etp1["reads"] * 2 == etp1["gathered"] * etp2["reads"]
    assert etp2["gathered"] <= etp1["gathered"] // 2


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("etp2r")
    return out, run_ranks(_train, 2, str(out), {"ddp": (DDP_TP2, False, True)})


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("etp4r")
    return out, run_ranks(_train, 4, str(out), {"ep": (FSDP_TP2_EP2, True, False),
                                                "pp": (PP2_TP2, False, False)})


def _layout_results(fixture, name: str):
    out, ranks = fixture
    return out / name, [found[name] for found in ranks]


def test_ddp_tp2_etp2_matches_and_stores_half(two_ranks):
    """DDP x TP 2 (2 ranks): ETP 2 equals ETP 1, and each rank stores half the experts'
    bytes (ETP 1 replicates whole experts on the TP ranks, its experts' data-parallel
    ranks) and reads half as many bytes per read; no rank gathers anything (replicated)."""
    out, results = _layout_results(two_ranks, "ddp")
    _assert_etp2_matches_etp1(results, out)
    for found in results:
        etp1, etp2 = found[1], found[2]
        assert etp1["stored"] == EXPERT_ELEMENTS * 4  # float32, whole
        assert etp2["stored"] == etp1["stored"] // 2
        _assert_half_per_read(etp1, etp2)
        assert etp1["moved"] == etp2["moved"] == 0


def test_compiled_etp2_equals_eager(two_ranks):
    """ETP 2 compiled (aot_eager, the trainer's MoE compile): no graph break (the TP
    group's exchanges are functional collectives, their split sizes unbacked), and the
    losses equal eager ETP 2's within 1e-6 relative (the same ops; traced, the experts
    run one ``F.linear`` per expert where eager may take the grouped matmul)."""
    _, results = _layout_results(two_ranks, "ddp")
    for found in results:
        assert found["compiled"]["breaks"] == {}
        assert found["compiled"]["losses"] == pytest.approx(found[2]["losses"], rel=1e-6)


def test_fsdp_tp2_ep2_etp2_matches_and_gathers_half(four_ranks):
    """FSDP 2 x TP 2 with EP 2 (4 ranks): ETP 2 equals ETP 1 on the same global batch.
    Bytes per rank: both store a quarter of the experts (ETP 1: each EP rank's experts
    sharded over 2 data-parallel ranks, the TP peers among them; ETP 2: split over TP, and
    the EP groups leave no data-parallel rank to shard over), but ETP 1 gathers its two
    whole local experts per read (moving half of them), ETP 2 reads its own half-width
    slice: half the gathered bytes, nothing moved."""
    for etp1, etp2 in _quarter_stored_half_read(four_ranks, "ep"):
        assert etp1["moved"] == etp1["gathered"] // 2
        assert etp2["moved"] == 0


def test_pp2_tp2_etp2_matches(four_ranks):
    """PP 2 x TP 2 (4 ranks, a block per stage): ETP 2 equals ETP 1; each stage's ranks
    store a quarter of the model's experts (their one block's, over the TP peers) in both,
    and an ETP 2 read returns half the bytes (the slice, not the whole experts)."""
    for _, etp2 in _quarter_stored_half_read(four_ranks, "pp"):
        assert etp2["moved"] == 0


def _quarter_stored_half_read(four_ranks, layout: str) -> list[tuple[dict, dict]]:
    """``layout``'s ETP 2 run equals its ETP 1 run; on every rank both store a quarter of
    the model's experts and an ETP 2 read returns half the bytes. Per rank (etp 1, etp 2)."""
    out, results = _layout_results(four_ranks, layout)
    _assert_etp2_matches_etp1(results, out)
    pairs = [(found[1], found[2]) for found in results]
    for etp1, etp2 in pairs:
        assert etp1["stored"] == etp2["stored"] == EXPERT_ELEMENTS * 4 // 4
        _assert_half_per_read(etp1, etp2)
    return pairs


def test_checkpoint_resumes_across_etp(four_ranks):
    """The step-2 checkpoint of each run, resumed by the other ``etp`` for step 3 (DCP
    reshards the experts: ETP 2 saves ``gate_up``'s strided slices as ``Shard(1)``,
    ``simplefsdp.state_dict.checkpoint_placements``), ends where the uninterrupted run
    of the resuming ``etp`` ends: step 3's loss within 1e-6 relative, the exported model
    within :func:`_assert_same_model`'s tolerance (the two runs' states at step 2 differ
    by float32 reordering only). A slice loaded into the wrong place (gate for up, the
    wrong TP rank's columns) changes the loss by far more."""
    out, results = _layout_results(four_ranks, "ep")
    for source, resumed_as in ((1, 2), (2, 1)):
        for found in results:
            resumed = found[f"from{source}"]["losses"]
            assert len(resumed) == 1  # step 3 only: the run did resume
            assert resumed[0] == pytest.approx(found[resumed_as]["losses"][-1], rel=1e-6)
        _assert_same_model(_params(out / f"from{source}"), _params(out / f"etp{resumed_as}"))


def _grouped_mm_flops(rows, weights, *_, out_shape=None, **__) -> int:
    """FLOPs of one forward grouped matmul (FlopCounterMode has no formula for it):
    ``rows [M, K]`` against the experts' ``[E, K, N]``, each row through one expert:
    2 x M x K x N."""
    assert len(rows) == 2 and len(weights) == 3, (rows, weights)
    return 2 * rows[0] * rows[1] * weights[2]


GROUPED_MM_FLOPS = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


def _layer(rank: int, world: int) -> dict:
    """One MoE layer (4 experts of width 32, dim 16) on TP 2 ranks, each routing 8 tokens
    of its own: its experts' FLOPs (``FlopCounterMode``), output and weight gradients,
    plain (ETP 1: this rank's slots, whole experts; gradients summed over the TP ranks,
    as the experts' data parallel does) and with :func:`apply_etp` (this rank's stored
    slice and its gradient, unreduced)."""
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    import simplefsdp as sf
    from simplefsdp._torch_compat import grouped_mm
    from simplefsdp.mesh import ParallelDims
    from simplefsdp.models.moe import MoE, MoEArgs
    from simplefsdp.parallel.expert_tensor import apply_etp

    args = MoEArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32, num_experts=4, top_k=2,
                   moe_hidden_dim=32)
    torch.manual_seed(0)
    layer = MoE(args)
    layer.init_weights(0.02)
    torch.manual_seed(1 + rank)  # each TP rank's own tokens
    x = torch.randn(8, 16)
    grouped_mm(x.device, x.dtype)  # its first-use probe runs now, not inside a count
    found, counters = {}, []
    # counts the experts' call only (not the router): a counter entered around it
    layer.experts.register_forward_pre_hook(lambda *_: counters[-1].__enter__() and None)
    layer.experts.register_forward_hook(
        lambda *_: counters[-1].__exit__(None, None, None) and None)
    for etp in (1, 2):
        if etp == 2:
            mesh = sf.make_mesh(dp_shard=1, tp=world)
            apply_etp(layer, ParallelDims.expert_mesh(mesh, 1, etp=world))
        layer.zero_grad()
        counters.append(FlopCounterMode(display=False, custom_mapping=GROUPED_MM_FLOPS))
        out = layer(x)
        experts = counters[-1].get_total_flops()
        out.square().sum().backward()
        params = list(layer.experts.parameters())
        grads = [p.grad.to_local().clone() if etp == 2 else p.grad.clone() for p in params]
        if etp == 1:
            for grad in grads:  # the experts' data parallel sums them over the TP ranks
                dist.all_reduce(grad)
        stored = [p.to_local().clone() if etp == 2 else p.detach().clone() for p in params]
        found[etp] = {"flops": experts, "out": out.detach(), "grads": grads,
                      "stored": stored}
    return found


@pytest.mark.quick
def test_etp_halves_the_width_per_rank():
    """Counted per TP rank: ETP 2 runs the grouped matmuls on the routed slots of both TP
    ranks (2 x 16) at half the width; ETP 1 here already gives each TP rank only its own
    part of the sequence (moe_tp_plan), so per rank the FLOPs are equal, and per routed
    slot halved. Each rank stores exactly its slice (gate rows r, up rows r; down columns
    r) and its gradient equals that slice of ETP 1's summed gradient; outputs equal ETP
    1's; both up to float32 reordering (the down-projection summed in two halves: 1e-6
    absolute on values and gradients of order 1e-2..1)."""
    results = run_ranks(_layer, 2)
    slots, dim, width, tp = 16, 16, 32, 2  # 8 tokens x top-2
    whole = 3 * 2 * slots * dim * width  # gate, up, down: 2 FLOPs per multiply-add
    part = width // tp
    for rank in range(tp):
        etp1, etp2 = results[rank][1], results[rank][2]
        assert etp1["flops"] == whole
        assert etp2["flops"] == 3 * 2 * (2 * slots) * dim * part
        assert etp2["flops"] / (2 * slots) == etp1["flops"] / slots / 2
        torch.testing.assert_close(etp2["out"], etp1["out"], rtol=0, atol=1e-6)
        rows = slice(rank * part, (rank + 1) * part)
        for key, tol in (("stored", 0), ("grads", 1e-6)):
            gate_up, down = etp1[key]
            want_gate_up = torch.cat([gate_up[:, :width][:, rows],
                                      gate_up[:, width:][:, rows]], 1)
            got_gate_up, got_down = etp2[key]
            torch.testing.assert_close(got_gate_up, want_gate_up, rtol=0, atol=tol)
            torch.testing.assert_close(got_down, down[..., rows], rtol=0, atol=tol)


def _eight_ranks(rank: int, world: int) -> dict:
    """One MoE layer's experts (4 of width 32) split as FSDP 4 x TP 2 x EP 2 lays them out
    on 8 ranks (each EP rank's 2 experts sharded over 2 data-parallel ranks, each a TP
    slice): the whole weights gathered back (``full_state_dict``, the export's path)
    against the weights before the split."""
    import simplefsdp as sf
    from simplefsdp.mesh import ParallelDims
    from simplefsdp.models.moe import MoE, MoEArgs
    from simplefsdp.parallel.expert import shard_experts
    from simplefsdp.parallel.expert_tensor import apply_etp
    from simplefsdp.state_dict import full_state_dict

    args = MoEArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32, num_experts=4, top_k=2,
                   moe_hidden_dim=32)
    torch.manual_seed(0)
    layer = MoE(args)
    layer.init_weights(0.02)
    want = {name: p.detach().clone() for name, p in layer.experts.named_parameters()}
    experts_mesh = ParallelDims.expert_mesh(sf.make_mesh(dp_shard=4, tp=2), 2, etp=2)
    apply_etp(layer, experts_mesh)
    shard_experts(layer, experts_mesh, mode="fully_shard")
    local = {name: p.to_local().shape for name, p in layer.experts.named_parameters()}
    return {"got": full_state_dict(layer.experts, rank0_only=False), "want": want,
            "local": local}


def test_fsdp_ep_etp_layout_on_eight_ranks():
    """Each rank holds one expert's TP slice (gate_up [1, 32, 16], down [1, 16, 16]), and
    the whole weights come back exactly (bitwise: copies only): the data-parallel shard
    of dim 0 is strided by the ``ep`` split alone (not by ``ep x tp``), and the gather
    goes by way of the checkpoint layout (torch's gather of ETP's two strided shards
    fails)."""
    for found in run_ranks(_eight_ranks, 8):
        assert found["local"] == {"gate_up_proj": (1, 32, 16), "down_proj": (1, 16, 16)}
        assert set(found["got"]) == set(found["want"])
        for name, value in found["want"].items():
            assert torch.equal(found["got"][name], value), name


MOE = [*TINY, *TP2]


@pytest.mark.parametrize("flags, message", [
    (["--parallel.etp", "4"], "parallel.etp = 4 must be 1 or parallel.tp = 2"),
    (["--parallel.etp", "0"], "parallel.etp = 0 must be 1 or parallel.tp = 2"),
    (["--parallel.etp", "2", "--parallel.ep", "8"],
     "parallel.ep = 8 must divide parallel.dp_shard = 4"),
    (["--parallel.etp", "2", "--model.moe_hidden_dim", "33"],
     "does not divide the routed experts' width model.moe_hidden_dim = 33"),
    (["--parallel.etp", "2", "--parallel.cp_ring", "2", "--parallel.ep", "8"],
     "parallel.ep = 8 must divide parallel.dp_shard * parallel.cp_ring = 4"),
    (["--parallel.etp", "2", "--parallel.expert_dispatch", "padded"],
     "expert_dispatch = 'padded'"),
])
def test_etp_bad_input_refused(flags, message):
    """Each unsupported value or combination is refused at config load, naming the key
    and the fix (``set parallel.etp = ...``; ep 8 on 8 ranks with TP 2 divides
    ``dp_shard x tp = 8`` but not ``dp_shard = 4``, which ETP's groups come out of)."""
    with pytest.raises(ConfigError, match="parallel.etp") as caught:
        load_config(None, [*MOE, *flags], world_size=8)
    assert message in str(caught.value)
    assert "set parallel." in str(caught.value)


def test_etp_needs_an_moe_model():
    with pytest.raises(ConfigError, match="model.family = 'llama'"):
        load_config(None, ["--model.name", "debug", "--parallel.tp", "2",
                           "--parallel.etp", "2"], world_size=2)
