"""Per-module mixed precision (``data_parallel(..., mp_overrides=...)``, issue 27).

The toy model runs in bf16 (gathered parameters bf16, gradients reduced in bf16) except
its blocks' ``up`` projections, overridden to float32 (gathered, computed and reduced in
float32; their inputs cast to float32, their outputs back to bf16).

Reference: one process, the same master weights, each rank's half of the batch run on
its own with every parameter cast to its module's dtype (the same input/output casts),
the two halves' gradients cast to the module's reduce dtype, averaged and cast back to
float32, then the same SGD step. It runs the sharded run's ops on the same shapes, and
the average of two terms is exact up to one rounding in the reduce dtype, which both
sides do alike: we ask for bitwise-equal parameters and losses (measured: equal).
Compiled (aot_eager, manual buckets) against eager: bitwise, for the same reasons as
tests/test_composition.py. Under full activation checkpointing (each block in the
trainer's checkpoint wrapper: module FQNs read ``layers.0._checkpoint_wrapped_module.up``)
the glob written for the plain model (``layers.?.up``: ``?`` is one character, so only
the name without the wrapper's component matches) still applies: eager and compiled,
bitwise equal to the same reference (recomputing a block repeats its ops on its values).
"""

from __future__ import annotations

import pytest
import torch
from rank_runner import run_ranks
from toy import Toy, global_batch, loss_fn

import simplefsdp as sf
from simplefsdp.state_dict import unwrapped_name

STEPS, LR = 3, 0.5
BF16, FP32 = torch.bfloat16, torch.float32
DEFAULT = sf.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
OVERRIDES = {"layers.?.up": sf.MixedPrecisionPolicy(param_dtype=FP32, reduce_dtype=FP32)}


def _model(ac: str = "none") -> Toy:
    from simplefsdp.parallel.activation_checkpoint import checkpointed

    torch.manual_seed(0)
    model = Toy(tie=False, frozen=False)
    if ac != "none":
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpointed(block, ac)
    return model


def _dtypes(name: str) -> tuple[torch.dtype, torch.dtype]:
    """(param, reduce) dtype of parameter ``name`` in the reference."""
    return (FP32, FP32) if ".up." in name else (BF16, BF16)


def _reference(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    for block in model.layers:  # the fp32 island: inputs to fp32, outputs back to bf16
        block.up.register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
        block.up.register_forward_hook(lambda m, args, out: out.to(BF16))
    master = dict(model.named_parameters())
    losses = []
    for step in range(STEPS):
        tokens = global_batch(step, world)
        grads: dict[str, list[torch.Tensor]] = {name: [] for name in master}
        step_loss = torch.zeros((), dtype=FP32)  # summed as the all-reduce sums
        for rank in range(world):
            cast = {name: p.detach().to(_dtypes(name)[0]).requires_grad_()
                    for name, p in master.items()}
            loss = loss_fn(lambda x, cast=cast: torch.func.functional_call(model, cast, (x,)),
                           tokens[2 * rank:2 * (rank + 1)])
            for name, g in zip(cast, torch.autograd.grad(loss, list(cast.values())),
                               strict=True):
                grads[name].append(g.to(_dtypes(name)[1]))
            step_loss += loss.detach()
        with torch.no_grad():
            for name, p in master.items():
                p -= LR * (sum(grads[name]) / world).to(FP32)
        losses.append(step_loss.item() / world)
    return losses, {name: p.detach() for name, p in master.items()}


def _sgd(model, rank: int, world: int, runnable=None) -> list[float]:
    runnable = model if runnable is None else runnable
    losses = []
    for step in range(STEPS):
        loss = loss_fn(runnable, global_batch(step, world)[2 * rank:2 * (rank + 1)])
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _run(rank: int, world: int) -> dict:
    ref_losses, ref_params = _reference(world)
    out = {}
    for ac, compiled in (("none", False), ("none", True), ("full", False), ("full", True)):
        torch._dynamo.reset()
        model = sf.data_parallel(_model(ac), sf.make_mesh(dp_shard=world), mp_policy=DEFAULT,
                                 mp_overrides=OVERRIDES)
        backend = runnable = None
        if compiled:
            backend = sf.compile_backend("aot_eager", bucketing="manual", reordering=True)
            runnable = torch.compile(model, fullgraph=True, backend=backend)
        losses = _sgd(model, rank, world, runnable)
        params = {name: p.full_tensor() for name, p in model.named_parameters()}
        assert all(p.dtype == FP32 for p in params.values())  # master weights stay fp32
        out[ac, compiled] = {"losses": losses,
                             "params": {unwrapped_name(n): p for n, p in params.items()}}
        if compiled and ac == "none":
            fwd = [r for r in backend.reports if r.graph == "forward"][-1]
            bwd = [r for r in backend.reports if r.graph == "backward"][-1]
            out["buckets"] = (fwd.buckets, bwd.buckets)
    for variant in (("none", False), ("none", True), ("full", False), ("full", True)):
        run = out[variant]
        assert run["params"].keys() == ref_params.keys(), variant
        worst = max((run["params"][n] - ref_params[n]).abs().max().item() for n in ref_params)
        assert worst == 0.0, (variant, worst)
        assert run["losses"] == ref_losses, (variant, run["losses"], ref_losses)
    return {"losses": ref_losses, "buckets": out["buckets"]}


def test_overrides_match_reference_and_compile():
    got = run_ranks(_run, 2)[0]
    fwd, bwd = got["buckets"]
    # Manual buckets group per block; a block's fp32 ``up`` and its bf16 parameters are
    # never one collective: each block gives two gathers (and two reduce-scatters).
    per_block = [b for b in fwd if b["name"].startswith("layers.")]
    assert len(per_block) == 2 * len(Toy(tie=False).layers), fwd
    assert sorted(b["modules"][0] for b in per_block if len(b["modules"]) == 1) == \
        ["layers.0.up", "layers.1.up"], fwd
    for kind in ("all_gather", "reduce_scatter"):  # backward: re-gathers, reductions
        mine = [b for b in bwd if b["name"].startswith("layers.") and b["kind"] == kind]
        assert len(mine) == 4 and sum(b["modules"] == [f"layers.{i}.up"] for b in mine
                                      for i in range(2)) == 2, (kind, bwd)
    print("forward buckets:", [(b["name"], b["count"], b["bytes"], b["modules"]) for b in fwd])
    assert got["losses"][-1] < got["losses"][0]


def _bad(rank: int, world: int) -> None:
    mesh = sf.make_mesh(dp_shard=world)
    with pytest.raises(ValueError, match=r"'\*\.router' matches no module"):
        sf.data_parallel(_model(), mesh, mp_overrides={"*.router": DEFAULT})


def test_unmatched_glob_raises():
    run_ranks(_bad, 2)


def test_trainer_fp32_modules_key():
    """``[training] mixed_precision_fp32_modules``: globs become float32 overrides; one that
    matches nothing is a ConfigError naming the key."""
    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError
    from simplefsdp.models.llama import ModelArgs, Transformer
    from simplefsdp.models.parallelize import fp32_overrides
    from simplefsdp.parallel.activation_checkpoint import apply_ac

    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64))
    apply_ac(model, "full")  # the checkpoint wrapper's name is not part of the globs
    key = "--training.mixed_precision_fp32_modules"
    got = fp32_overrides(model, load_config(None, [key, "*.attention_norm,norm"]))
    assert got == {g: sf.MixedPrecisionPolicy(FP32, FP32) for g in ("*.attention_norm", "norm")}
    with pytest.raises(ConfigError, match=r"training.mixed_precision_fp32_modules: "
                                          r"'\*\.router' matches no module"):
        fp32_overrides(model, load_config(None, [key, "norm,*.router"]))
    assert fp32_overrides(model, load_config(None, [])) == {}
