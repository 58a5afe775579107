"""LoRA fine-tuning (``[lora]``, ``models/lora.py``) of a tiny local Hugging Face Llama
on 2 gloo ranks, against a single-process peft run written here.

The reference is peft's own model (``get_peft_model`` on ``from_pretrained``), its
adapters reset by peft's ``reset_lora_parameters`` from the run's seed, trained by
``torch.optim.AdamW`` with ``clip_grad_norm_`` on each step's global batch (the
windows both ranks read, recorded through the trainer's ``batch_transform``) with the
trainer's learning-rate factors (``optim.lr_lambda``; the schedule is
``test_trainer_reference``'s subject).

Tolerances:
* losses: 1e-5 relative. The reference runs one forward over the 4 sequences of a step;
  the trainer two of 2 and sums the token losses across ranks: float32 sums split
  differently, ~1e-7 per op, over 2 layers and 4 steps.
* adapter weights: 2e-5 absolute. The gradients differ by that rounding (the sharded
  run adds the ranks' partial gradients in a reduce-scatter); Adam divides each by its
  root mean square, so an update differs by about lr x (relative gradient rounding).
* base weights and the resumed run: bitwise (the same float32 operations in the same
  order; frozen weights are never written).
* compiled (aot_eager) against eager: losses 1e-6 relative, weights 1e-6 absolute. Not
  bitwise, unlike the same model without LoRA (``test_hf``): the first step's ``lora_B``
  gradients differ in their last bits (up to 7e-9 seen). Not ours: plain
  ``torch.compile(backend="aot_eager")`` of peft's model on one process, without
  simplefsdp, gives the same differences on the same batch.
* our logits against ``PeftModel.from_pretrained`` on the exported adapter folder: 1e-5
  absolute (the same float32 weights through peft's same layers; ours are gathered).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")  # the [hf] extra; CI installs it with .[dev]
pytest.importorskip("peft")  # the [lora] extra; also in .[dev]

from rank_runner import run_ranks  # noqa: E402

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
STEPS, LR, SEED, RANK, ALPHA = 4, 1e-2, 5, 4, 8.0
TARGETS = ["q_proj", "v_proj", "down_proj"]
SEQ_LEN, BATCH = 32, 2


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers (byte ids: vocab 300 > 256)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("lora") / "llama"
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         eos_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _argv(out: Path, folder: Path, *extra: str) -> list[str]:
    return ["--model.hf_path", str(folder), "--data.tokenizer", "byte",
            "--training.steps", str(STEPS), "--training.batch_size", str(BATCH),
            "--training.seq_len", str(SEQ_LEN), "--training.warmup_steps", "1",
            "--training.lr", str(LR), "--training.seed", str(SEED),
            "--metrics.output_dir", str(out), "--metrics.log_every", "1",
            "--lora.enable", "true", "--lora.rank", str(RANK), "--lora.alpha", str(ALPHA),
            "--lora.target_modules", ",".join(TARGETS), *extra]


# ---------------------------------------------------------------------------------------
# What a rank sees: the trainer run, its model and optimizer kept for the checks.
# ---------------------------------------------------------------------------------------
class _Collectives(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the functional collectives run in eager mode: (kind, input numel)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
            self.seen.append((name, args[0].numel()))
        return func(*args, **(kwargs or {}))


def _run_keeping(argv: list[str], record: list | None = None):
    """``main(argv)`` keeping (result, runnable, model, optimizer); with ``record``, the
    windows this rank trained on are appended to it."""
    from simplefsdp.models import registry
    from simplefsdp.train import trainer
    from simplefsdp.train.__main__ import main

    family, build_optimizer = registry.get("hf"), trainer.build_optimizer
    kept = {}

    def build(*args, **kwargs):
        kept["runnable"], kept["model"] = family.build(*args, **kwargs)
        return kept["runnable"], kept["model"]

    def optimizer(*args, **kwargs):
        kept["optimizer"], scheduler = build_optimizer(*args, **kwargs)
        return kept["optimizer"], scheduler

    def transform(inputs, targets):
        record.append((inputs.clone(), targets.clone()))
        return inputs, targets

    registry.register(dataclasses.replace(family, build=build))
    trainer.build_optimizer = optimizer
    try:
        result = main(argv, batch_transform=transform if record is not None else None)
    finally:
        registry.register(family)
        trainer.build_optimizer = build_optimizer
    return result, kept["runnable"], kept["model"], kept["optimizer"]


def _full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered (a collective), by unwrapped name, as numpy arrays."""
    import simplefsdp
    from simplefsdp.state_dict import unwrapped_name

    with simplefsdp.disable_active_parametrization():
        return {unwrapped_name(n): p.full_tensor().detach().numpy().copy()
                for n, p in model.named_parameters()}


def _optimizer_facts(model, optimizer) -> dict:
    """Which parameters the optimizer holds state for, and the bytes of that state
    against this rank's shard bytes of the trainable and frozen parameters."""
    import simplefsdp
    from simplefsdp.state_dict import unwrapped_name

    with simplefsdp.disable_active_parametrization():
        names = {id(p): unwrapped_name(n) for n, p in model.named_parameters()}
        local = {n: p.to_local() for n, p in model.named_parameters()}
        shard = {unwrapped_name(n): t.numel() * t.element_size() for n, t in local.items()}
        trainable = {unwrapped_name(n) for n, p in model.named_parameters() if p.requires_grad}
    state_bytes = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.dim():  # exp_avg, exp_avg_sq; not the step
                t = value.to_local() if hasattr(value, "to_local") else value
                state_bytes += t.numel() * t.element_size()
    return {"with_state": sorted(names[id(p)] for p in optimizer.state),
            "optimized": sorted(names[id(p)] for g in optimizer.param_groups
                                for p in g["params"]),
            "state_bytes": state_bytes, "trainable": sorted(trainable),
            "trainable_bytes": sum(shard[n] for n in trainable),
            "frozen_bytes": sum(b for n, b in shard.items() if n not in trainable)}


def _one_step(runnable, model, mode=None) -> dict:
    """One forward + backward of the trained model (under ``mode``, if given): which
    parameters got a gradient, and the collectives ``mode`` saw."""
    from contextlib import nullcontext

    from simplefsdp.state_dict import unwrapped_name

    tokens = torch.arange(BATCH * SEQ_LEN).view(BATCH, SEQ_LEN) % 256
    with mode or nullcontext():
        runnable(tokens).float().square().mean().backward()
    graded = sorted(unwrapped_name(n) for n, p in model.named_parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    return {"seen": getattr(mode, "seen", None), "graded": graded}


def _trained_logits(runnable) -> torch.Tensor:
    tokens = (torch.arange(2 * SEQ_LEN).view(2, SEQ_LEN) * 7) % 256
    with torch.no_grad():
        return runnable(tokens).float().numpy().copy()


def _eager_rank(rank: int, world: int, argv: list[str]) -> dict:
    recorded: list = []
    result, runnable, model, optimizer = _run_keeping(argv, recorded)
    return {"losses": result.losses, "params": _full_params(model),
            "optimizer": _optimizer_facts(model, optimizer),
            "logits": _trained_logits(runnable),
            "step": _one_step(runnable, model, _Collectives()),
            "batches": [(i.numpy(), t.numpy()) for i, t in recorded]}


# ---------------------------------------------------------------------------------------
# The reference: peft on one process.
# ---------------------------------------------------------------------------------------
def _peft_model(folder: Path):
    """peft's LoRA model on the folder's weights, adapters reset by peft from SEED."""
    import peft
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=ALPHA,
                                                      target_modules=TARGETS))
    torch.manual_seed(SEED)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.reset_lora_parameters("default", True)
    return model


def _peft_reference(folder: Path, steps: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """peft trained with AdamW (the trainer's default hyper-parameters) on each step's
    global batch: its losses and its adapters by our names."""
    import torch.nn.functional as F

    from simplefsdp.optim import lr_lambda

    model = _peft_model(folder)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            foreach=True)
    losses = []
    for step, (inputs, targets) in enumerate(steps):
        for group in opt.param_groups:
            group["lr"] = LR * lr_lambda(step, 1, STEPS)
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    prefix = "base_model.model."
    adapters = {n.removeprefix(prefix): p.detach().numpy().copy()
                for n, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "adapters": adapters}


def _global_steps(ranks: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's global batch: rank 0's windows, then rank 1's."""
    per_rank = [r["batches"] for r in ranks]
    return [(torch.cat([torch.from_numpy(b[s][0]) for b in per_rank]).long(),
             torch.cat([torch.from_numpy(b[s][1]) for b in per_rank]).long())
            for s in range(STEPS)]


@pytest.fixture(scope="module")
def eager(hf_folder, tmp_path_factory) -> dict:
    """The 2-rank eager run (checkpoints every 2 steps, merged export) and its reference."""
    out = tmp_path_factory.mktemp("eager")
    argv = _argv(out, hf_folder, "--checkpoint.enable", "true", "--checkpoint.every", "2",
                 "--checkpoint.export_hf", "true")
    ranks = run_ranks(_eager_rank, 2, argv)
    reference = _peft_reference(hf_folder, _global_steps(ranks))
    return {"out": out, "ranks": ranks, "reference": reference}


def test_losses_and_adapters_match_single_process_peft(eager):
    ours, ref = eager["ranks"][0], eager["reference"]
    print("ours", ours["losses"], "\npeft", ref["losses"])
    for a, b in zip(ours["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (ours["losses"], ref["losses"])
    adapters = {n: v for n, v in ours["params"].items() if ".lora_" in n}
    assert adapters.keys() == ref["adapters"].keys()
    assert len(adapters) == 2 * 2 * len(TARGETS)  # A and B, 2 layers
    worst = max(abs(adapters[n] - ref["adapters"][n]).max() for n in adapters)
    print("adapter max diff", worst)
    assert worst <= 2e-5, worst
    # the adapters moved: B left zero, A its initial draw (the update is not a no-op)
    assert all(abs(v).max() > 0 for n, v in adapters.items() if ".lora_B." in n)


def test_base_weights_bitwise_unchanged(eager, hf_folder):
    from safetensors.torch import load_file

    base = load_file(hf_folder / "model.safetensors")
    ours = {n: v for n, v in eager["ranks"][0]["params"].items() if ".lora_" not in n}
    assert ours.keys() == base.keys()
    changed = [n for n in base if not (ours[n] == base[n].numpy()).all()]
    assert not changed, changed


def _adapter_sizes(params: dict) -> list[int]:
    return sorted(v.size for n, v in params.items() if ".lora_" in n)


def test_frozen_parameters_get_no_gradient_and_no_reduction(eager):
    for r in eager["ranks"]:
        adapters = sorted(n for n in r["params"] if ".lora_" in n)
        assert r["step"]["graded"] == adapters  # only the adapters have a gradient
        seen = r["step"]["seen"]
        # fully_shard reduces a gradient with one reduce-scatter of its full size: one per
        # adapter, none for a frozen weight (all 21 base tensors are gathered for compute)
        scattered = sorted(n for kind, n in seen if kind == "reduce_scatter_tensor")
        assert scattered == _adapter_sizes(r["params"]), scattered
        assert not [k for k, _ in seen if k == "all_reduce"]
        gathered = {n for kind, n in seen if kind == "all_gather_into_tensor"}
        assert len(gathered) > 0 and sum(k.startswith("all_gather") for k, _ in seen) >= len(
            r["params"])


def test_optimizer_holds_state_only_for_adapters(eager):
    for r in eager["ranks"]:
        facts = r["optimizer"]
        adapters = sorted(n for n in r["params"] if ".lora_" in n)
        assert facts["trainable"] == adapters
        assert facts["with_state"] == facts["optimized"] == adapters
        # AdamW: exp_avg and exp_avg_sq, each the size of this rank's adapter shards; the
        # frozen base would add 2 x its (far larger) bytes
        assert facts["state_bytes"] == 2 * facts["trainable_bytes"], facts
        assert facts["frozen_bytes"] > 10 * facts["trainable_bytes"]


def _tokens() -> torch.Tensor:
    return (torch.arange(2 * SEQ_LEN).view(2, SEQ_LEN) * 7) % 256


def test_adapter_folder_loads_in_peft_and_reproduces_logits(eager, hf_folder):
    import peft
    from transformers import AutoModelForCausalLM

    folder = eager["out"] / "lora"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json",
                                                       "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, folder)
    with torch.no_grad():
        theirs = model(input_ids=_tokens()).logits.numpy()
    ours = eager["ranks"][0]["logits"]
    diff = abs(ours - theirs).max()
    print("peft adapter folder logits max diff", diff)
    assert diff <= 1e-5, diff
    # the adapters matter: the base model alone gives other logits
    with torch.no_grad(), model.disable_adapter():
        assert abs(model(input_ids=_tokens()).logits.numpy() - ours).max() > 1e-3


def test_merged_export_loads_in_transformers(eager):
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(eager["out"] / "hf", dtype=torch.float32)
    with torch.no_grad():
        theirs = merged(input_ids=_tokens()).logits.numpy()
    # W + s B A in one weight against x W + s (x A) B: float32 rounding apart
    diff = abs(eager["ranks"][0]["logits"] - theirs).max()
    print("merged export logits max diff", diff)
    assert diff <= 1e-5, diff


def _resumed_rank(rank: int, world: int, argv: list[str]) -> dict:
    result, _, model, _ = _run_keeping(argv)
    return {"start": result.start_step, "losses": result.losses, "params": _full_params(model)}


def test_resume_gives_the_uninterrupted_run(eager, hf_folder, tmp_path):
    """The step-2 checkpoint of the eager run, resumed to step 4: the same losses and
    adapters, bitwise (the checkpoint holds the adapters and their optimizer state)."""
    source = eager["out"] / "checkpoints"
    (tmp_path / "checkpoints").mkdir()
    shutil.copytree(source / "step-2", tmp_path / "checkpoints" / "step-2")
    shutil.copy(source / "config.json", tmp_path / "checkpoints" / "config.json")
    argv = _argv(tmp_path, hf_folder, "--checkpoint.enable", "true", "--checkpoint.every",
                 "2", "--checkpoint.resume", "true")
    got = run_ranks(_resumed_rank, 2, argv)[0]
    assert got["start"] == 2
    assert got["losses"] == eager["ranks"][0]["losses"][2:]
    full = eager["ranks"][0]["params"]
    assert got["params"].keys() == full.keys()
    assert all((got["params"][n] == full[n]).all() for n in full)


def _compiled_rank(rank: int, world: int, argv: list[str]) -> dict:
    from simplefsdp.train.console import CompileReports

    reports = CompileReports()
    with reports:
        result, runnable, model, _ = _run_keeping(argv)
    backward = [b for r in reports.reports if r.graph == "backward" for b in r.buckets]
    return {"losses": result.losses, "params": _full_params(model),
            "step": _one_step(runnable, model),
            "scatters": [(b["modules"], b["bytes"]) for b in backward
                         if b["kind"] == "reduce_scatter"],
            "graphs": [r.graph for r in reports.reports]}


@pytest.mark.quick
def test_compiled_matches_eager_and_reduces_only_adapters(eager, hf_folder, tmp_path):
    argv = _argv(tmp_path, hf_folder, "--compile.enable", "true", "--compile.backend",
                 "aot_eager", "--compile.bucketing", "none")
    ranks = run_ranks(_compiled_rank, 2, argv)
    compiled, ours = ranks[0], eager["ranks"][0]
    print("compiled", compiled["losses"], compiled["graphs"])
    # not bitwise: aot_eager of peft's layer rounds lora_B's gradients differently from
    # eager, with or without simplefsdp (the module's docstring)
    for a, b in zip(compiled["losses"], ours["losses"], strict=True):
        assert abs(a - b) <= 1e-6 * b, (compiled["losses"], ours["losses"])
    worst = max(abs(compiled["params"][n] - v).max() for n, v in ours["params"].items())
    assert worst <= 1e-6, worst
    for r in ranks:
        adapters = sorted(n for n in eager["ranks"][0]["params"] if ".lora_" in n)
        assert r["step"]["graded"] == adapters
        # bucketing none: one reduce-scatter per reduced gradient, named by its module
        modules = sorted(m[m.index("model."):] for mods, _ in r["scatters"] for m in mods)
        assert modules == sorted(n.removesuffix(".weight") for n in adapters), modules
        sizes = sorted(nbytes // 4 for _, nbytes in r["scatters"])
        assert sizes == _adapter_sizes(eager["ranks"][0]["params"]), sizes


# ---------------------------------------------------------------------------------------
# Our Llama.
# ---------------------------------------------------------------------------------------
LLAMA = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
         "--model.n_kv_heads", "2"]


def _llama_rank(rank: int, world: int, out: str) -> dict:
    from simplefsdp.train.__main__ import main

    argv = [*LLAMA, "--training.steps", "3", "--training.batch_size", "2",
            "--training.seq_len", str(SEQ_LEN), "--training.seed", str(SEED),
            "--training.lr", str(LR), "--metrics.output_dir", out, "--lora.enable", "true"]
    from simplefsdp.models import registry

    family, kept = registry.get("llama"), {}

    def build(*args, **kwargs):
        kept["runnable"], kept["model"] = family.build(*args, **kwargs)
        return kept["runnable"], kept["model"]

    registry.register(dataclasses.replace(family, build=build))
    try:
        result = main(argv)
    finally:
        registry.register(family)
    return {"losses": result.losses, "params": _full_params(kept["model"]),
            "logits": _trained_logits(kept["runnable"])}


def test_our_llama_trains_adapters_that_peft_loads(tmp_path):
    """Our Llama, 2 ranks, default targets (wq, wv): the base stays its seeded init
    bitwise, and the adapter folder on that base under peft gives our logits."""
    import peft

    from simplefsdp.config import parse_args
    from simplefsdp.models.llama import Transformer

    got = run_ranks(_llama_rank, 2, str(tmp_path))[0]
    args = parse_args(LLAMA).model.model_args()
    torch.manual_seed(SEED)  # the trainer's initialization (test_trainer_reference)
    with torch.device("meta"):
        base = Transformer(args)
    base.to_empty(device="cpu")
    base.init_weights()
    init = {n: p.detach().numpy() for n, p in base.named_parameters()}
    assert sorted(n for n in got["params"] if ".lora_" not in n) == sorted(init)
    assert all((got["params"][n] == v).all() for n, v in init.items())
    assert sorted(n for n in got["params"] if ".lora_" in n) == sorted(
        f"layers.{i}.attention.{w}.lora_{ab}.default.weight"
        for i in range(2) for w in ("wq", "wv") for ab in "AB")
    model = peft.PeftModel.from_pretrained(base, tmp_path / "lora")
    with torch.no_grad():
        theirs = model(_tokens()).numpy()
    assert abs(theirs - got["logits"]).max() <= 1e-5  # float32, gathered vs plain weights


# ---------------------------------------------------------------------------------------
# Refusals at start-up.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--lora.rank", "0"], "lora.rank"),
    (["--lora.alpha", "0"], "lora.alpha"),
    (["--lora.dropout", "1"], "lora.dropout"),
    (["--lora.enable", "true", "--model.name", "debug_moe"], "model.family = 'moe'"),
    (["--lora.enable", "true", "--parallel.tp", "2"], "parallel.tp = 2"),
])
def test_bad_lora_keys_are_refused(extra, message):
    from simplefsdp.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=message):
        parse_args([*LLAMA, *extra])


def test_missing_peft_is_named(monkeypatch):
    import importlib.util

    from simplefsdp.config import ConfigError, parse_args

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"lora.enable = true needs the peft package.*\[lora\]"):
        parse_args([*LLAMA, "--lora.enable", "true"])


def test_unknown_target_module_is_refused_before_weights():
    """Checked on the model built on meta (nothing allocated), naming the layers."""
    from simplefsdp.config import ConfigError, parse_args
    from simplefsdp.models.llama import Transformer
    from simplefsdp.models.lora import apply_lora

    cfg = parse_args([*LLAMA, "--lora.enable", "true", "--lora.target_modules", "wq,q_proj"])
    with torch.device("meta"):
        model = Transformer(cfg.model.model_args())
    with pytest.raises(ConfigError, match=r"lora.target_modules: 'q_proj' names no linear "
                                          r"layer.*w1, w2, w3, wk, wo, wq, wv"):
        apply_lora(model, cfg)
