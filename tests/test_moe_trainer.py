"""The MoE model family in the trainer (models/moe_family.py): ``--parallel.ep`` with every
``dp_mode`` on 4 gloo ranks against the same run without expert parallelism, the balance
loss and expert load in ``metrics.csv`` against a computation by hand, the router kept
float32 under bf16, and the bad input refused at config load.

Every run reads the shipped text relabelled (``toy.relabel_odd_bytes``: odd bytes + 128),
so that the TP cells' vocabulary-sharded loss has targets on both TP ranks' halves."""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path

import pytest
import torch
from rank_runner import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from toy import relabel_odd_bytes

from simplefsdp.config.job import load_config
from simplefsdp.errors import ConfigError

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

# A tiny debug_moe: 2 blocks of width 32, 4 experts of width 32, top-2, a shared expert,
# balance loss with a large coefficient (so that it moves the weights visibly). 2 steps:
# the second runs on the weights and AdamW state the first step's gradients set, so a
# wrong gradient term shows in its loss as well as in the exported weights.
STEPS = 2
TINY = ["--model.name", "debug_moe", "--model.dim", "32", "--model.n_layers", "2",
        "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.num_experts", "4",
        "--model.moe_hidden_dim", "32", "--model.shared_hidden_dim", "32",
        "--model.aux_loss_coef", "0.1", "--training.seq_len", "32",
        "--training.batch_size", "2", "--training.steps", str(STEPS),
        "--training.warmup_steps", "1",
        "--training.lr", "1e-2", "--metrics.log_every", "1",
        "--checkpoint.export_safetensors", "true"]
# name -> the run's parallel flags (4 ranks); "ep1" is the reference
LAYOUTS = {
    "ep1": ["--parallel.ep", "1"],
    "ep2_fsdp": ["--parallel.ep", "2"],
    "ep4_fsdp": ["--parallel.ep", "4"],
    # HSDP and replicate, each 2 replicas x TP 2 with EP 2 (pairs: HSDP-TP, HSDP-EP,
    # replicate-TP, replicate-EP, TP-EP; they replace HSDP 2 x 2 x EP 2 and replicate 4 x
    # EP 2 cells, whose pairs they keep: HSDP with a real shard dim x EP is
    # test_hf_moe's ep2_hsdp, on the same dispatch): 2 data-parallel ranks, 2 microsteps
    # each as in tp2_ep1; EP pairs are the TP pairs, the experts (dp_replicate 2,
    # dp_shard 1, ep 2) replicated over the 2 pairs. Under HSDP dp_shard is 1 (4 ranks).
    "hsdp_tp2_ep2": ["--parallel.ep", "2", "--parallel.dp_mode", "hybrid_shard",
                     "--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
                     "--parallel.tp", "2", "--training.grad_accum_steps", "2"],
    "ddp_tp2_ep2": ["--parallel.ep", "2", "--parallel.dp_mode", "replicate",
                    "--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
                    "--parallel.tp", "2", "--training.grad_accum_steps", "2"],
    # TP 2 x FSDP 2 without EP: 2 data-parallel ranks, each with 2 microsteps of the same 2
    # sequences per microstep that the reference's 4 ranks read in one (the loader splits
    # the global batch into contiguous runs), so each balance loss is over the same tokens;
    # the experts are still sharded over dp_shard x tp (each TP rank routes other tokens:
    # the experts' gradients are summed over TP too). EP on the TP pairs: cp2_tp2_ep2.
    "tp2_ep1": ["--parallel.tp", "2", "--training.grad_accum_steps", "2"],
    # the same with EP 4: each all-to-all spans both TP ranks and both data-parallel ranks
    # (the experts' mesh folds tp in: dp_shard 2 x tp 2 = ep 4, one expert per rank)
    "tp2_ep4": ["--parallel.tp", "2", "--parallel.ep", "4",
                "--training.grad_accum_steps", "2"],
    # ring 2 x TP 2 with EP 2 (no data parallel: 4 microsteps of the reference ranks' 2
    # sequences): each rank routes a quarter of each sequence; the balance loss gathers
    # its statistics over all 4 (cp x tp); EP pairs are the TP pairs
    "cp2_tp2_ep2": ["--parallel.cp_ring", "2", "--parallel.tp", "2", "--parallel.ep", "2",
                    "--training.grad_accum_steps", "4"],
    # PP 2 x FSDP 2 with EP 2: each data-parallel rank's 4 sequences in 2 microbatches of
    # the 2 that one reference rank reads; each stage's balance loss joins backward
    "pp2_ep2": ["--parallel.pp", "2", "--parallel.ep", "2", "--training.batch_size", "4",
                "--parallel.pp_microbatches", "2"],
}
# The same tiny model with DeepSeek's MLA attention (models/mla.py: latent 16, query/key
# heads 8 + 4 RoPE, value heads 8), without and with EP 2 x FSDP 2: name -> flags
MLA = ["--model.attention", "mla", "--model.n_kv_heads", "4", "--model.kv_lora_rank", "16",
       "--model.qk_nope_head_dim", "8", "--model.qk_rope_head_dim", "4",
       "--model.v_head_dim", "8"]
MLA_LAYOUTS = {"mla_ep1": [*MLA, *LAYOUTS["ep1"]], "mla_ep2_fsdp": [*MLA, *LAYOUTS["ep2_fsdp"]]}
# Every exported parameter within this of the reference (see the parity test). TP sums its
# split matmuls in another order (attention's output projection, the shared expert), so
# the experts see inputs a few ulps off; the measured worst (1.57e-5 tp2_ep2 when it ran, 1.72e-5
# tp2_ep1, 1.25e-5 tp2_ep4, 7.8e-6 cp2_tp2_ep2) is one element of 4096 (an expert weight
# whose gradient is near AdamW's eps, where lr * g / (|g| + eps) swings): about twice
# that. MLA under EP 2 x FSDP 2 has the same single near-eps element on a host whose BLAS
# rounds otherwise (an AVX2-only CPU: 1.07e-5 on one of 8192 experts' gate_up_proj
# elements, every other element under 2.3e-6), so it gets the same bound. A lost gradient
# term moves thousands of elements by ~1e-3, thirty times the bound.
PARAM_ATOL = {name: 3.5e-5 for name in ("tp2_ep1", "tp2_ep4", "cp2_tp2_ep2", "hsdp_tp2_ep2",
                                        "ddp_tp2_ep2", "mla_ep2_fsdp")}


def _runs(rank: int, world: int, out: str) -> dict:
    """Every layout's ``STEPS`` steps on these 4 ranks (one process group), then a bf16 model's
    parameter dtypes as its modules see them in forward."""
    from simplefsdp.train.__main__ import main

    results, batches = {}, []

    def keep(inputs, targets):  # this rank's batches, for the reference by hand
        inputs, targets = relabel_odd_bytes(inputs, targets)
        # plain lists: a tensor would travel as shared memory that dies with this process
        batches.append((inputs.tolist(), targets.tolist()))
        return inputs, targets

    for name, flags in {**LAYOUTS, **MLA_LAYOUTS}.items():
        result = main([*TINY, *flags, "--metrics.output_dir", f"{out}/{name}"],
                      batch_transform=keep if name == "ep1" else relabel_odd_bytes)
        results[name] = result.losses
    return {"losses": results, "batches": batches, "dtypes": _bf16_dtypes(out),
            **_compiled(out)}


# compiled run (aot_eager) -> (the LAYOUTS entry it runs, bucketing, activation
# checkpointing): auto bucketing with selective AC on EP 2 x FSDP 2 (the experts' own
# data-parallel collectives in the graph; the routed block's checkpoint traced into it
# with the op-level policy), and manual on TP 2 x EP 4 x FSDP 2 (compiled TP on an MoE
# model). Against an eager twin without AC ("<layout>_one_block_eager"; AC recomputes the
# same ops, so it does not change eager's figures). One routed block (``ONE_BLOCK``):
# compile time grows with the blocks, and the bucket checks below read that block's
# experts' buckets. A dense block before a routed one under compiled selective AC (its
# checkpoint traced with no exchanges' context): ``tests/test_moe_compiled_ac.py``.
COMPILED = {"auto_selective_ac": ("ep2_fsdp", "auto", "selective"),
            "tp2_ep4_manual": ("tp2_ep4", "manual", "none")}
ONE_BLOCK = ["--model.n_layers", "1"]


def _microsteps(layout: str) -> int:
    """``training.grad_accum_steps`` of a ``LAYOUTS`` entry (1 where it is not set)."""
    flags = LAYOUTS[layout]
    key = "--training.grad_accum_steps"
    return int(flags[flags.index(key) + 1]) if key in flags else 1


class _ExchangeCounter:
    """Counts the all-to-alls gloo runs (every one, a routed block's counts exchange
    included) from step ``first`` of a trainer run on, while the ``with`` block runs: pass
    :meth:`transform` as the run's ``batch_transform`` (the trainer draws a step's
    microbatches just before running it, so the profiler starts when step ``first``'s are
    drawn); ``count`` after the block. A compiled run counts from
    step 2: its first step compiles, and the profiler would record every op the compiler
    traces (nothing that runs a collective) and read them all back."""

    def __init__(self, first: int = 1, microsteps: int = 1, then=None):
        from torch.profiler import ProfilerActivity, profile

        self.profile = profile(activities=[ProfilerActivity.CPU])
        self.start_at, self.drawn, self.then = (first - 1) * microsteps, 0, then
        self.count: int | None = None

    def transform(self, inputs, targets):
        if self.drawn == self.start_at:
            self.profile.start()
        self.drawn += 1
        return (inputs, targets) if self.then is None else self.then(inputs, targets)

    def __enter__(self) -> _ExchangeCounter:
        return self

    def __exit__(self, *exc) -> None:
        if self.drawn > self.start_at:  # started: stop it, also when the run failed
            self.profile.stop()
            self.count = sum(e.name == "gloo:all_to_all" for e in self.profile.events())


def _compiled(out: str) -> dict:
    """``COMPILED``'s runs (aot_eager) and their eager twins: losses and the bucket
    reports of every compiled graph."""
    import torch._dynamo

    from simplefsdp.train.__main__ import main
    from simplefsdp.train.console import CompileReports

    found = {}
    for name, (layout, bucketing, ac) in COMPILED.items():
        flags = [*TINY, *LAYOUTS[layout], *ONE_BLOCK]
        twin = f"{layout}_one_block_eager"
        found[twin] = main([*flags, "--metrics.output_dir", f"{out}/{twin}"],
                           batch_transform=relabel_odd_bytes).losses
        torch._dynamo.reset()
        with CompileReports() as reports, _uncalibrated_comm_model(), _ExchangeCounter(
                first=2, microsteps=_microsteps(layout), then=relabel_odd_bytes) as exchanges:
            losses = main([*flags, "--compile.enable", "true", "--compile.backend",
                           "aot_eager", "--compile.bucketing", bucketing,
                           "--activation_checkpoint.mode", ac,
                           "--metrics.output_dir", f"{out}/{name}"],
                          batch_transform=exchanges.transform).losses
        found[name] = losses
        found[f"{name}_exchanges"] = exchanges.count
        # per compiled graph: its buckets (kind, bytes, the modules they gather, named
        # from the frame's root: "" is the root's own parameters) and every collective it
        # held before bucketing, data-parallel (by kind) or not (a count)
        found[f"{name}_graphs"] = [(r.graph, sorted((b["kind"], b["bytes"], tuple(b["modules"]))
                                                    for b in r.buckets),
                                    dict(r.collectives_before), r.other_collectives)
                                   for r in reports.reports]
    return found


@contextlib.contextmanager
def _uncalibrated_comm_model():
    """Auto bucketing plans with the cost model's default figures for this fabric
    (``cost.get_comm_model(calibrate_on_miss=False, cache=False)``) instead of calibrating
    the process group: a calibration times collectives for seconds, and again whenever a
    loaded host's probe disagrees with the cached one. The checks below hold for any plan
    (the experts' collectives in one or two buckets of their own); calibration and its
    probe are ``tests/test_calibration_probe.py``'s and ``tests/test_loaded_calibration.py``'s."""
    import functools

    from simplefsdp.compiler import cost
    from simplefsdp.compiler.cost import comm

    calibrated = comm.get_comm_model
    comm.get_comm_model = cost.get_comm_model = functools.partial(
        calibrated, calibrate_on_miss=False, cache=False)
    try:
        yield
    finally:
        comm.get_comm_model = cost.get_comm_model = calibrated


class _MatmulDtypes(TorchDispatchMode):
    """Records each matmul that runs while active: (op, its operands' and its result's
    dtypes)."""

    OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.bmm.default}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[str, ...]]] = []

    def start(self) -> None:  # hooks: returning nothing leaves the args and output alone
        self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in self.OPS:
            operands = [a for a in args if isinstance(a, torch.Tensor)]
            self.seen.append((str(func), tuple(str(t.dtype) for t in [*operands, result])))
        return result


def _bf16_dtypes(out: str) -> dict:
    """The dtype each module's parameters have while it runs, in a bf16 EP 2 model."""
    import dataclasses

    from simplefsdp.train import trainer

    cfg = load_config(None, [*TINY, "--parallel.ep", "2", "--metrics.output_dir",
                             f"{out}/bf16", "--training.mixed_precision_param", "bfloat16"])
    cfg = dataclasses.replace(cfg, parallel=cfg.parallel.resolve(4))
    s = trainer.setup(cfg, None)
    seen = {}
    block = s.model.layers["1"].feed_forward
    for name, module, read in (("router", block.gate, lambda m: m.weight),
                               ("experts", block.experts, lambda m: m.gate_up_proj),
                               ("shared", block.shared_expert, lambda m: m.w1.weight)):
        module.register_forward_pre_hook(
            lambda mod, args, name=name, read=read: seen.__setitem__(name, str(read(mod).dtype)))
    # the router's own matmul, as it runs (after the module's input casts)
    matmuls = _MatmulDtypes()
    block.gate.register_forward_pre_hook(lambda mod, args: matmuls.start())
    block.gate.register_forward_hook(lambda mod, args, out: matmuls.stop())
    s.runnable(torch.zeros(2, 32, dtype=torch.long))
    seen["router_matmuls"] = matmuls.seen
    s.metrics.close()
    shard = block.experts._parameters["gate_up_proj"]  # the stored shard, not the gather
    seen["experts_layout"] = (shard.device_mesh.mesh_dim_names, tuple(shard.to_local().shape))
    return seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    results = run_ranks(_runs, 4, str(out))
    return out, results


def _params(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("layout", [n for n in LAYOUTS if n != "ep1"])
def test_expert_parallel_matches_ep1(runs, layout):
    """EP 2 x FSDP 2, EP 4 (one expert per rank), TP 2 x EP 2 with HSDP and with replicate
    (2 replicas each; the experts replicated over the 2 EP groups), TP 2 x FSDP 2 with EP 1
    and 4 (attention and shared expert split, each TP rank routing its own part of the
    sequence; the EP groups take the TP ranks), ring 2 x TP 2 with EP 2 and PP 2 x
    FSDP 2 with EP 2 (one block per stage, 2 microbatches) train the same 2
    AdamW steps as the same 4 ranks without EP, TP or PP: the same global batch, each
    balance loss over the same tokens, so routing is identical and only reduction orders
    differ (each expert's rows from two ranks in one matmul; gradients summed over other
    groups; TP's split matmuls summed over ranks). Losses within 1e-6 relative; every
    exported parameter within 1e-5 absolute (AdamW's first steps move each weight by ~lr
    = 1e-2 times g / |g|, so a relative 1e-6 gradient difference shows as ~1e-8; 1e-5
    leaves room for near-zero gradients; TP: ``PARAM_ATOL``). A lost gradient term (a
    stage's balance loss, a TP rank's tokens) moves thousands of elements by ~1e-3."""
    out, results = runs
    ref = results[0]["losses"]["ep1"]
    for rank in range(4):
        assert results[rank]["losses"][layout] == pytest.approx(ref, rel=1e-6)
    want, got = _params(out / "ep1"), _params(out / layout)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_ATOL.get(layout, 1e-5),
                                   msg=name)
    # the experts moved (the comparison is not between two initial models)
    start = _initial_model().state_dict()["layers.1.feed_forward.experts.down_proj"]
    assert (got["layers.1.feed_forward.experts.down_proj"] - start).abs().max() > 1e-3


def test_mla_trains_under_fsdp_and_ep(runs):
    """MLA in the trainer: EP 2 x FSDP 2 trains the same 2 steps as the same 4 ranks with
    FSDP 4 alone (the parity test's reasoning and tolerances: routing identical, only
    reduction orders differ); its latent path (wkv_a, the latent's norm, wkv_b) is in the
    exported model and moved from its initial values, and the loss fell."""
    out, results = runs
    ref = results[0]["losses"]["mla_ep1"]
    assert ref[-1] < ref[0]
    for rank in range(4):
        assert results[rank]["losses"]["mla_ep2_fsdp"] == pytest.approx(ref, rel=1e-6)
    want, got = _params(out / "mla_ep1"), _params(out / "mla_ep2_fsdp")
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_ATOL["mla_ep2_fsdp"],
                                   msg=name)
    assert "layers.1.attention.wk.weight" not in got
    assert (got["layers.1.attention.kv_norm.weight"] - 1).abs().max() > 1e-3  # init: ones
    start = _initial_model(tuple(MLA)).state_dict()["layers.1.attention.wkv_b.weight"]
    assert (got["layers.1.attention.wkv_b.weight"] - start).abs().max() > 1e-3


def _initial_model(flags: tuple = ()):
    """The trainer's initial weights (seed 0, initialized on a meta-built model as
    ``llama_family`` does); ``flags``: model keys on top of ``TINY``."""
    from simplefsdp.models import moe

    args = load_config(None, [*TINY, *flags]).model.model_args()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = moe.MoETransformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_metrics_by_hand(runs):
    """metrics.csv has the MoE columns; step 1's loss, aux_loss and expert load equal a
    computation by hand on the initial model over the 4 ranks' first batches: the Switch
    loss of each layer from its router's scores (E * sum_e f_e * P_e, f_e the share of
    slots routed to expert e, P_e its mean score), times the coefficient 0.1, summed over
    layers, averaged over ranks (equal token counts); the load is the busiest expert's
    slots over the mean, over all ranks' tokens, worst layer. Within 1e-5 relative
    (float32, different reduction orders)."""
    out, results = runs
    model = _initial_model()
    routed: list[tuple[torch.Tensor, torch.Tensor]] = []
    for block in model.layers.values():
        block.feed_forward.gate.register_forward_hook(
            lambda mod, args, res: routed.append((res[0].detach(), res[2])))
    aux, ce, loads = 0.0, 0.0, {}
    experts, coef, ranks = 4, 0.1, 4
    for rank in range(ranks):
        inputs, targets = (torch.tensor(t) for t in results[rank]["batches"][0])
        routed.clear()
        with torch.no_grad():
            logits = model(inputs)
        ce += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                reduction="sum").item()
        for layer, (scores, ids) in enumerate(routed):
            counts = torch.bincount(ids.flatten(), minlength=experts).float()
            f, p = counts / scores.shape[0], scores.mean(0)
            aux += coef * experts * (f * p).sum().item() / ranks
            loads[layer] = loads.get(layer, 0) + counts
    ratio = max((c.max() / c.mean()).item() for c in loads.values())
    tokens = ranks * inputs.numel()
    with open(out / "ep2_fsdp" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"aux_loss", "expert_load_max_mean", "tokens_dropped"} <= set(rows[0])
    assert len(rows) == STEPS
    first = {k: float(v) for k, v in rows[0].items()}
    assert first["loss"] == pytest.approx(ce / tokens, rel=1e-5)
    assert first["aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert first["expert_load_max_mean"] == pytest.approx(ratio, rel=1e-6)
    assert all(float(r["tokens_dropped"]) == 0 for r in rows)
    # TP, CP x TP and PP report the same figures: under TP each rank routes its part of the
    # sequence, the loads are summed over all ranks and the balance loss (the whole
    # slice's, statistics gathered over tp, or cp x tp) counts TP rank 0's share once;
    # under PP each stage adds its own blocks' (torch's metadata-inference forward counts
    # nothing).
    for layout in ("tp2_ep4", "cp2_tp2_ep2", "pp2_ep2"):
        with open(out / layout / "metrics.csv") as f:
            other = list(csv.DictReader(f))
        for mine, theirs in zip(rows, other, strict=True):
            for key in ("aux_loss", "expert_load_max_mean"):
                assert float(theirs[key]) == pytest.approx(float(mine[key]), rel=1e-5), key


def test_router_stays_float32_under_bf16(runs):
    """With mixed_precision_param = bfloat16 the routers are added to the fp32 modules:
    in forward the router's weight is float32, the experts' and the shared expert's
    bfloat16 (the experts sharded on their own mesh take the same policy). And EP 2 was
    applied: the experts' weight lives on the (dp_shard, ep) mesh, this rank holding 1 of
    the 4 experts (2 per ep rank, split over the experts' 2 dp_shard ranks). The
    router's matmul itself (its logits) runs in float32: one ``aten.mm`` on float32
    operands, what the routing decisions are computed from."""
    _, results = runs
    assert results[0]["dtypes"] == {"router": "torch.float32", "experts": "torch.bfloat16",
                                    "shared": "torch.bfloat16",
                                    "router_matmuls": [("aten.mm.default", ("torch.float32",) * 3)],
                                    "experts_layout": (("dp_shard", "ep"), (1, 64, 32))}


@pytest.mark.parametrize("flags, message", [
    (["--parallel.ep", "3"], "parallel.ep = 3 does not divide the 8 experts"),
    (["--model.top_k", "9"], "top_k=9 must be between 1 and num_experts=8"),
    (["--parallel.tp", "2", "--model.shared_hidden_dim", "33"],
     "parallel.tp = 2 does not divide model.shared_hidden_dim = 33"),
])
def test_moe_bad_input_refused(flags, message):
    """Refused when the config is read, naming the key (no process started)."""
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, ["--model.name", "debug_moe", *flags])


def _exchanges_per_ac_mode(rank: int, world: int, out: str) -> dict:
    from simplefsdp.train.__main__ import main

    found = {}
    for run, ac in (("none", "none"), ("selective", "selective"), ("full", "full"),
                    ("selective_inductor", "selective")):
        compiled = ["--compile.enable", "true"] if run.endswith("inductor") else []
        with _ExchangeCounter(first=2 if compiled else 1) as exchanges:
            losses = main([*TINY, *LAYOUTS["ep2_fsdp"], *ONE_BLOCK,
                           "--training.steps", "2", "--activation_checkpoint.mode", ac,
                           *compiled, "--metrics.output_dir", f"{out}/{run}"],
                          batch_transform=exchanges.transform).losses
        found[run] = (losses, exchanges.count)
    return found


def test_selective_ac_keeps_the_token_exchanges(tmp_path):
    """EP 2 on 2 ranks, one routed block, 2 steps, eager: the block exchanges its counts
    once per forward run and its tokens twice (dispatch, combine) per forward run and in
    backward. Without AC 1 + 2 + 2 = 5 all-to-alls a step; full AC runs the forward again:
    2 + 4 + 2 = 8; selective keeps the two token exchanges' outputs
    (``parallel.expert.keep_exchanges``), so its recomputation exchanges only the counts
    again: 2 + 2 + 2 = 6. Losses bitwise equal across the eager modes (AC
    recomputes the same ops on the same inputs).

    The same selective run compiled with Inductor (the trainer's default backend; the
    block's checkpoint traced into the graph, whose policy keeps every exchange, the
    counts' too: ``tests/test_moe_compiled_ac.py``): 5 in step 2 (counted from there:
    step 1 compiles), as without AC, and eager's
    losses within 1e-5 relative (Inductor's fused kernels may sum in another order).
    ``test_compiled_equals_eager`` checks the aot_eager cell bitwise. (This model's
    routed block traces whole into the model's graph, its checkpoint too, so no frame is
    entered at another compiled-forward depth here: that the depth counter stays out of
    Dynamo's guards (no recompile for it) is ``tests/test_compiler.py``'s
    ``test_the_forward_depth_counter_stays_out_of_guards``.)"""
    found = run_ranks(_exchanges_per_ac_mode, 2, str(tmp_path))
    for per_rank in found:
        assert {run: n for run, (_, n) in per_rank.items()} == \
            {"none": 2 * 5, "selective": 2 * 6, "full": 2 * 8,
             "selective_inductor": 5}, per_rank
        assert per_rank["selective"][0] == per_rank["none"][0] == per_rank["full"][0]
        assert per_rank["selective_inductor"][0] == pytest.approx(per_rank["none"][0],
                                                                 rel=1e-5)


def test_ep_refusals_name_the_key():
    """EP on a dense model, an MoE key on a dense preset, ep not dividing the ranks the
    groups come from (dp_shard, times tp under TP; dp_replicate when dp_shard = 1) for the
    world size."""
    with pytest.raises(ConfigError, match=r"^parallel\.ep = 2 needs a mixture-of-experts "
                                          r"model, but model\.family = 'llama'"):
        load_config(None, ["--parallel.ep", "2"])
    with pytest.raises(ConfigError, match=r"^model\.num_experts configures a mixture of "
                                          r"experts, but model\.name = 'debug' is a dense"):
        load_config(None, ["--model.num_experts", "4"])
    moe = ["--model.name", "debug_moe", "--parallel.ep", "4"]
    with pytest.raises(ConfigError, match=r"^parallel\.ep = 4 must divide parallel\.dp_shard "
                                          r"= 2 "):
        load_config(None, moe, world_size=2)
    with pytest.raises(ConfigError, match=r"^parallel\.ep = 4 must divide "
                                          r"parallel\.dp_replicate = 2"):
        load_config(None, [*moe, "--parallel.dp_mode", "replicate", "--parallel.dp_shard",
                           "1", "--parallel.dp_replicate", "2"], world_size=2)
    with pytest.raises(ConfigError, match=r"model\.name = 'debug_moe' is a mixture-of-experts "
                                          r"preset: set model\.family = 'moe'"):
        load_config(None, ["--model.name", "debug_moe", "--model.family", "llama"])
    load_config(None, [*moe, "--parallel.dp_shard", "4"], world_size=4)  # fine
    # under TP the groups come out of dp_shard x tp (TP ranks route different tokens)
    load_config(None, [*moe, "--parallel.tp", "2"], world_size=4)  # ep 4 = dp_shard 2 x tp 2
    with pytest.raises(ConfigError, match=r"^parallel\.ep = 4 must divide parallel\.dp_shard "
                                          r"\* parallel\.tp = 2 "):
        load_config(None, [*moe, "--parallel.tp", "2"], world_size=2)
    # compiled TP on an MoE model trains (test_compiled_equals_eager), no refusal
    load_config(None, [*moe, "--parallel.tp", "2", "--compile.enable", "true"], world_size=4)



@pytest.mark.parametrize("name", COMPILED)
def test_compiled_equals_eager(runs, name):
    """Compiled (aot_eager, our passes) against the same layout eager (``COMPILED``, one
    routed block): EP 2 x FSDP 2 with auto bucketing and selective AC against its eager
    run without AC, and TP 2 x EP 4 x FSDP 2 with manual bucketing. Step
    1's loss is bitwise equal (the forward runs eager's ops; bucketing only concatenates and
    slices; each bucket reduces over the same ranks in the same order). The graph does not
    allow bitwise gradients: the gradient of a block's normed input sums three branches
    (router, routed experts, shared expert), and the joint graph adds them in another order
    than eager autograd (float addition of three terms is not associative); AdamW divides
    each gradient element by its running RMS, so on a near-cancelling element those ulps
    become a visible part of a step (lr 1e-2; measured worst 2.4e-6). So: later losses
    within 1e-6 relative, every exported parameter within 1e-5 absolute.

    Compiled TP: the blocks run in ``Transformer.run_blocks``, so the graph break around
    the routed experts falls on that call and the embedding stays in one graph with its
    hooks (a break inside ``forward``'s loop over blocks would trace each module hook as a
    frame of its own, and the vocabulary-parallel embedding's output hook would meet an
    eager DTensor whose ``_MaskPartial`` placement holds a real mask, on fake tensors).

    Compiled selective AC on an MoE model: the block's checkpoint is traced into the
    graph (``parallel.activation_checkpoint.compile_checkpointed_blocks``), whose policy
    keeps the routed block's exchanges: step 2 (counted from there: step 1 compiles) runs
    its counts exchange once and its tokens' four times (dispatch and combine, forward and
    backward), 5 all-to-alls, as without AC (per microstep: TP 2 x EP 4 runs 2 a step;
    eager selective runs 6, ``test_selective_ac_keeps_the_token_exchanges``)."""
    out, results = runs
    layout, _, ac = COMPILED[name]
    twin = f"{layout}_one_block_eager"
    for rank in range(4):
        eager, compiled = results[rank][twin], results[rank][name]
        assert compiled[0] == eager[0]
        assert compiled == pytest.approx(eager, rel=1e-6)
        assert results[rank][f"{name}_exchanges"] == (STEPS - 1) * _microsteps(layout) * 5
    want, got = _params(out / twin), _params(out / name)
    assert set(got) == set(want)
    worst = max((got[n] - v).abs().max().item() for n, v in want.items())
    assert worst <= 1e-5, worst
    graphs = results[0][f"{name}_graphs"]
    if layout == "tp2_ep4":
        # the non-expert weights' FSDP gathers (dp_shard 2) ran in compiled graphs, e.g. the
        # embedding's and the output's (128 TP rows of 32, float32: 16384 B); the experts
        # (one whole expert per rank: ep 4 = dp_shard 2 x tp 2) have no data parallel
        forward = [[(k, n) for k, n, _ in b] for g, b, *_ in graphs if g == "forward"]
        assert any(("all_gather", 16384) in b for b in forward), forward
        return
    # One forward and one backward graph (no break). The forward gathers this rank's 2
    # experts' gate_up_proj (2 x 64 x 32 float32: 16384 B) and down_proj (2 x 32 x 32:
    # 8192 B) over the experts' dp_shard, the backward reduce-scatters their gradients;
    # each in one or two buckets of the experts module's own (auto may merge them), apart
    # from the rest of the model's, which shards over all 4 ranks.
    assert [g for g, *_ in graphs] == ["forward", "backward"], graphs
    for graph, kind in (("forward", "all_gather"), ("backward", "reduce_scatter")):
        buckets = next(b for g, b, *_ in graphs if g == graph)
        experts = [(k, n) for k, n, mods in buckets if any("experts" in m for m in mods)]
        assert all(len(mods) == 1 for k, n, mods in buckets
                   if any("experts" in m for m in mods)), buckets  # not with other modules
        assert sorted(n for k, n in experts if k == kind) in ([8192, 16384], [24576]), buckets


def test_grouped_mm_probe_under_no_grad(monkeypatch):
    """The grouped-matmul probe runs its backward in grad mode: probed first under
    ``no_grad`` (an evaluation, test_metrics_by_hand's reference) it must still pass, or
    the grouped matmul would be off for the whole process."""
    from simplefsdp import _torch_compat

    monkeypatch.setattr(_torch_compat, "_KERNEL_RUNS", {})
    with torch.no_grad():
        assert _torch_compat.grouped_mm(torch.device("cpu"), torch.float32) is not None
