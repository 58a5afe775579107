"""Hugging Face MoE models (transformers 5: experts fused in memory, per expert on disk)
in the trainer: sharded loading through transformers' own conversion mapping, training,
export back to the per-expert files.

Tiny Qwen3-MoE and Mixtral models are made here with ``save_pretrained``; no network.
Their hidden size (30) keeps ``expert_ffn`` on its loop path (the grouped matmul wants
16-byte strides): transformers' own per-expert matmuls on the same rows, compared with
transformers' loop (``experts_implementation="eager"``, :data:`EAGER`). Not bitwise: the
CPU BLAS rounds a 2- or 3-row product differently when its rows do not start on a
16-byte boundary (ours: one buffer of every expert's rows; transformers: a fresh buffer
per expert), checked here on 64 offsets of a (rows, 30) x (30, 36) product
(``test_blas_rounding_depends_on_where_the_rows_start``).
Its default on CPU, ``grouped_mm``, fails on such shapes in transformers 5.24 with torch
2.13 ("strides should be multiple of 16 bytes": it checks the alignment only up to torch
2.10).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rank_runner import run_ranks  # noqa: E402
from test_hf import (  # noqa: E402
    TOKENIZER_VOCAB,
    VOCAB,
    _argv,
    _documents,
    _train_tokenizer,
    exported_logits,
    packed_documents,
    train_keeping_model,
)

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
EXPERTS = 12  # over 10: file order must be transformers' natural one (10 after 9)
# The balance loss joins the loss (transformers: output_router_logits); its weight is 100x
# the usual 0.001 so that its gradient shows in the gradient norm next to the LM loss's.
COEF = 0.1
EAGER = {"experts_implementation": "eager"}  # transformers' per-expert loop (the reference)
SHAPE = dict(vocab_size=VOCAB, hidden_size=30, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
             num_experts_per_tok=2, tie_word_embeddings=False, eos_token_id=0,
             bos_token_id=None, output_router_logits=True, router_aux_loss_coef=COEF)


def _qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**SHAPE, intermediate_size=36, moe_intermediate_size=18,
                          num_experts=EXPERTS, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[])


def _mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(**SHAPE, intermediate_size=18, num_local_experts=EXPERTS,
                         router_jitter_noise=0.0)


def _save_moe(folder: Path, config) -> None:
    """A random model, its routers scaled up so tokens spread over all experts."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gate.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder, max_shard_size="100KB")
    _train_tokenizer(folder, TOKENIZER_VOCAB)


def _file_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    keys = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(path, framework="pt") as f:
            keys |= set(f.keys())
    return keys


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    _save_moe(root / "qwen3_moe", _qwen3_moe_config())
    _save_moe(root / "mixtral", _mixtral_config())
    with open(root / "docs.jsonl", "w") as f:
        for d in _documents():
            f.write(json.dumps({"body": d}) + "\n")
    # The premise: transformers saved the experts one by one, under other names than it
    # holds them (qwen3: mlp.experts.<i>.gate_proj; mixtral: block_sparse_moe.experts.<i>.w1).
    qwen, mixtral = _file_keys(root / "qwen3_moe"), _file_keys(root / "mixtral")
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in qwen
    assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in mixtral
    assert not any("gate_up_proj" in k for k in qwen | mixtral)
    assert (root / "qwen3_moe" / "model.safetensors.index.json").is_file()  # several files
    return {"qwen3_moe": root / "qwen3_moe", "mixtral": root / "mixtral",
            "jsonl": root / "docs.jsonl"}


# ---------------------------------------------------------------------------------------
# First step: ours (sharded load + adapted experts) against transformers' from_pretrained.
# ---------------------------------------------------------------------------------------
def _first_step(rank: int, world: int, argv: list[str], model_dir: str, data: str,
                coef: float = COEF):
    """Our first step (loss, metrics row) and transformers' on the same batch: the LM
    loss, the balance loss, the gradient norm of their loss (LM + coef x balance), the
    worst layer's max / mean slots per expert from their router logits. Then the dtypes
    the router and the experts compute in under bf16 mixed precision."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from simplefsdp.config.job import load_config
    from simplefsdp.hf.tokenizer import load_tokenizer
    from simplefsdp.train import trainer
    from simplefsdp.train.__main__ import main

    result = main(argv)
    dataset = packed_documents(data, load_tokenizer(model_dir), "body")
    inputs, targets = next(dataset.loader("train", 2, 32, seed=0))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **EAGER)
    kwargs = dict(input_ids=inputs, labels=inputs, shift_labels=targets.contiguous())
    with torch.no_grad():
        lm = hf(**kwargs, output_router_logits=False).loss.item()
    out = hf(**kwargs, output_router_logits=True)
    # their loss with the balance loss weighed ``coef`` (the folder's weight is COEF)
    (out.loss + (coef - hf.config.router_aux_loss_coef) * out.aux_loss).backward()
    grad_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in hf.parameters() if p.grad is not None])).item()
    ratios = []
    for logits in out.router_logits:
        chosen = logits.softmax(-1).topk(hf.config.num_experts_per_tok, dim=-1).indices
        load = torch.bincount(chosen.flatten(), minlength=EXPERTS).double()
        ratios.append((load.max() / load.mean()).item())
    theirs = {"loss": lm, "aux_loss": coef * out.aux_loss.item(), "grad_norm": grad_norm,
              "expert_load_max_mean": max(ratios)}

    out_dir = argv[argv.index("--metrics.output_dir") + 1]
    cfg = load_config(None, [*argv, "--training.mixed_precision_param", "bfloat16",
                             "--metrics.output_dir", f"{out_dir}/bf16"])
    s = trainer.setup(dataclasses.replace(cfg, parallel=cfg.parallel.resolve(1)), None)
    dtypes = {}
    for name, module in s.model.named_modules():
        if name.endswith("layers.1.mlp.gate"):
            read, key = (lambda m: m.weight), "router"
        elif name.endswith("layers.1.mlp.experts"):
            read, key = (lambda m: m.gate_up_proj), "experts"
        else:
            continue
        module.register_forward_pre_hook(
            lambda mod, args, key=key, read=read: dtypes.__setitem__(key, str(read(mod).dtype)))
    with torch.no_grad():  # the logits transformers' balance loss is computed from
        out = s.model(input_ids=inputs, use_cache=False, output_router_logits=True)
    dtypes["router_logits"] = str(out.router_logits[0].dtype)
    s.metrics.close()
    return result.losses[0], result.metrics["rows"][0], theirs, dtypes


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_first_step_equals_hf(moe_assets, tmp_path, name):
    """One step on 1 rank against transformers' own model on the same batch.

    LM loss: the same weights and float32 matmuls (the loop path: transformers' own
    per-expert F.linear on the same rows); only the reduction differs (our sum / token
    count vs. their mean): float32 rounding of a sum of 64 terms, rel 1e-6. Balance loss
    (``metrics.csv`` aux_loss, coefficient applied) against their ``aux_loss`` (their
    ``load_balancing_loss_func``) times ``router_aux_loss_coef``: the same function on
    router logits equal to float rounding, rel 1e-6. Gradient norm against that of their
    loss (LM + coef x balance): the same gradients summed in other orders (per-expert
    rows scattered back by index_add, our loss a sum divided once), rel 1e-5. Expert
    load: the worst layer's max / mean slots per expert from their router logits' top-k;
    counts of equal routing, rel 1e-6. Under bf16 mixed precision the router's weight is
    float32 in forward (kept so by default), the experts' bfloat16, and the router logits
    transformers records for its balance loss float32 (recorded before the cast back).
    Mixtral runs with ``model.router_aux_loss_coef = 2 x`` the folder's: their loss then
    weighs the balance loss so too."""
    coef = COEF if name == "qwen3_moe" else 2 * COEF
    extra = [] if coef == COEF else ["--model.router_aux_loss_coef", str(coef)]
    argv = _argv(tmp_path, moe_assets[name], moe_assets["jsonl"], *extra)
    loss, row, theirs, dtypes = run_ranks(_first_step, 1, argv, str(moe_assets[name]),
                                          str(moe_assets["jsonl"]), coef)[0]
    print(f"ours {loss} {row}, theirs {theirs}")
    assert loss == pytest.approx(theirs["loss"], rel=1e-6, abs=0)
    assert row["aux_loss"] == pytest.approx(theirs["aux_loss"], rel=1e-6, abs=0)
    assert row["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5, abs=0)
    assert row["expert_load_max_mean"] == pytest.approx(theirs["expert_load_max_mean"],
                                                        rel=1e-6, abs=0)
    assert row["tokens_dropped"] == 0
    assert dtypes == {"router": "torch.float32", "experts": "torch.bfloat16",
                      "router_logits": "torch.float32"}, dtypes


# ---------------------------------------------------------------------------------------
# Sharded loading: values and which file tensors each rank reads.
# ---------------------------------------------------------------------------------------
def _load_moe(rank: int, world: int, folder: str):
    """Load ``folder`` in both modes; per mode: every tensor's full value (rank 0) and
    the file tensors this rank read (names, as ``WeightFiles`` handed them out)."""
    import simplefsdp
    from simplefsdp.config.job import load_config
    from simplefsdp.hf import weights
    from simplefsdp.state_dict import unwrapped_name

    read: list[str] = []
    real_tensor, real_rows = weights.WeightFiles.tensor, weights.WeightFiles.rows

    def tensor(self, name):
        read.append(name)
        return real_tensor(self, name)

    def rows(self, name, start, stop):
        read.append(name)
        return real_rows(self, name, start, stop)

    weights.WeightFiles.tensor, weights.WeightFiles.rows = tensor, rows
    mesh = simplefsdp.make_mesh(dp_shard=world, device_type="cpu")
    out = {}
    for mode in ("broadcast", "all_ranks"):
        read.clear()
        cfg = load_config(None, ["--model.hf_path", folder, "--model.load_weights", mode])
        dims = cfg.parallel.dims().resolve(mesh.size())
        _, model = cfg.model.family_entry().build(cfg, mesh, dims, torch.device("cpu"))
        state = {unwrapped_name(k): v for k, v in model.state_dict().items()}
        full = {k: v.full_tensor().numpy() for k, v in state.items()}  # a collective
        out[mode] = {"full": full if rank == 0 else None, "read": sorted(read)}
    return out


def test_moe_sharded_loading_reads_only_own_experts(moe_assets):
    """2 ranks, a Qwen3-MoE folder of per-expert tensors in several files. Every
    in-memory tensor (fused experts included) equals, bitwise, the one transformers'
    ``from_pretrained`` builds from the same files with its own conversion: the loader
    moves and stacks bytes, nothing may differ. Under ``all_ranks`` rank r reads the
    per-expert tensors of its own experts only (12 experts, Shard(0): rank 0 experts 0-5,
    rank 1 experts 6-11), each once; under ``broadcast`` rank 0 reads every file tensor
    once and rank 1 none."""
    from transformers import AutoModelForCausalLM

    folder = moe_assets["qwen3_moe"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                     **EAGER).state_dict()
    results = run_ranks(_load_moe, 2, str(folder))
    keys = _file_keys(folder)
    for mode in ("broadcast", "all_ranks"):
        full = results[0][mode]["full"]
        assert full.keys() == reference.keys(), mode
        for key, value in reference.items():
            assert torch.equal(torch.from_numpy(full[key]), value), (mode, key)
    assert results[0]["broadcast"]["read"] == sorted(keys)  # each once
    assert results[1]["broadcast"]["read"] == []
    experts = [[k for k in r["all_ranks"]["read"] if ".experts." in k] for r in results]
    half = EXPERTS // 2
    for rank, names in enumerate(experts):
        owned = {int(k.split(".experts.")[1].split(".")[0]) for k in names}
        assert owned == set(range(half * rank, half * (rank + 1))), (rank, owned)
        # 2 layers x own experts x (gate, up, down), each read once
        assert len(names) == len(set(names)) == 2 * half * 3, names


# ---------------------------------------------------------------------------------------
# Training on 2 ranks, then export: the per-expert files back, identical logits.
# ---------------------------------------------------------------------------------------
# Our MoE (model.family = "moe"): a tiny debug_moe that Mixtral computes alike (softmax
# router with renormalized top-2 weights, no shared expert).
OUR_MOE = ["--model.name", "debug_moe", "--model.dim", "32", "--model.n_layers", "2",
           "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.num_experts", "4",
           "--model.moe_hidden_dim", "32", "--model.shared_hidden_dim", "0",
           "--training.seq_len", "32", "--training.batch_size", "2", "--training.steps", "2",
           "--training.warmup_steps", "0", "--training.lr", "1e-2", "--metrics.log_every", "1",
           "--parallel.ep", "2", "--checkpoint.export_hf", "true"]


def _our_moe_exported(rank: int, out: str):
    """Train :data:`OUR_MOE` (EP 2) with ``checkpoint.export_hf``; then our logits
    on 2 x 32 fixed tokens (a collective) and, on rank 0, those of the exported folder
    opened by ``from_pretrained`` (transformers' per-expert loop), with the folder's
    file names and the class transformers chose."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from simplefsdp.models import registry
    from simplefsdp.train.__main__ import main

    family, built = registry.get("moe"), []

    def capture(*args, **kwargs):
        built.append(family.build(*args, **kwargs))
        return built[-1]

    registry.register(dataclasses.replace(family, build=capture))
    try:
        main([*OUR_MOE, "--metrics.output_dir", out])
    finally:
        registry.register(family)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = built[0][0](tokens)
    if rank != 0:
        return None
    hf = AutoModelForCausalLM.from_pretrained(Path(out) / "hf", dtype=torch.float32, **EAGER)
    with torch.no_grad():
        theirs = hf(input_ids=tokens).logits
    return {"diff": (ours - theirs).abs().max().item(), "class": type(hf).__name__,
            "files": sorted(_file_keys(Path(out) / "hf"))}


def _train_export_compare(rank: int, world: int, argv: list[str], out: str, data: str):
    from simplefsdp.state_dict import unwrapped_name

    result, (runnable, model) = train_keeping_model(argv)
    trained = {unwrapped_name(k): v.full_tensor() for k, v in model.state_dict().items()}
    ours, theirs, hf = exported_logits(runnable, out, data, **EAGER)
    our_moe = _our_moe_exported(rank, f"{out}/ours")  # the same ranks, our MoE family
    if theirs is None:
        return result.losses, None
    same = {k: torch.equal(v, trained[k]) for k, v in hf.state_dict().items()}
    return result.losses, {"same": same, "trained": sorted(trained), "ours": our_moe,
                           "diff": (ours - theirs).abs().max().item()}


def test_moe_two_ranks_train_then_export_round_trips(moe_assets, tmp_path):
    """FSDP on 2 ranks trains the Qwen3-MoE (the loss falls), then ``export_hf``
    writes the files transformers saves (the same per-expert names as the original
    folder), and ``from_pretrained`` of them holds, bitwise, every trained tensor (the
    round trip moves bytes) and gives the trained model's logits within 1e-5 (float32
    logits of size ~1; the same products, rounded by the BLAS according to the rows'
    memory alignment, see the module docstring: 1.8e-7 seen). Then our MoE family on the
    same ranks exports a folder from_pretrained opens (see the comment below)."""
    folder = moe_assets["qwen3_moe"]
    argv = _argv(tmp_path, folder, moe_assets["jsonl"], "--training.steps", "12",
                 "--training.lr", "3e-3", "--training.warmup_steps", "2",
                 "--checkpoint.export_hf", "true", "--activation_checkpoint.mode", "full")
    (losses, check), _ = run_ranks(_train_export_compare, 2, argv, str(tmp_path),
                                   str(moe_assets["jsonl"]))

    print(f"losses {[round(x, 3) for x in losses]}, export logits max diff {check['diff']:.2e}")
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses  # the random model starts ~ln(321)
    assert _file_keys(tmp_path / "hf") == _file_keys(folder)
    assert sorted(check["same"]) == check["trained"]
    assert all(check["same"].values()), [k for k, v in check["same"].items() if not v]
    assert check["diff"] <= 1e-5, check["diff"]

    # Our MoE on the same 2 ranks (EP 2: one expert pair per rank, gathered for the export)
    # writes a Mixtral folder (Llama attention, softmax top-k router with renormalized
    # weights: our debug_moe's math) with transformers' own per-expert file names;
    # from_pretrained opens it and gives our logits within 1e-5: float32 logits of size ~1
    # from the same weights and operations summed in other orders (our grouped matmul of
    # every expert's rows against transformers' loop over experts; RoPE rotate-half on
    # rows permuted from our interleaved layout).
    ours = check["ours"]
    print(f"our MoE exported as {ours['class']}: logits max diff {ours['diff']:.2e}")
    assert ours["class"] == "MixtralForCausalLM"
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in ours["files"]
    assert "model.layers.1.block_sparse_moe.gate.weight" in ours["files"]
    assert not any("gate_up_proj" in k for k in ours["files"])
    assert ours["diff"] <= 1e-5, ours["diff"]


# ---------------------------------------------------------------------------------------
# Refusals, before any step.
# ---------------------------------------------------------------------------------------
def _moe_errors(rank: int, world: int, cases: list[list[str]]):
    from simplefsdp.errors import ConfigError
    from simplefsdp.train.__main__ import main

    messages = []
    for argv in cases:
        with pytest.raises(ConfigError) as info:
            main(argv)
        messages.append(str(info.value))
    return messages


def test_moe_bad_folders_refused_before_any_step(moe_assets, tmp_path):
    """Experts the adapter cannot run (GELU instead of SiLU) and a folder missing one
    expert's tensor: a ConfigError naming the key, before any step ran."""
    import shutil

    from safetensors.torch import load_file, save_file

    gelu = tmp_path / "gelu"
    shutil.copytree(moe_assets["qwen3_moe"], gelu)
    config = json.loads((gelu / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))

    missing = tmp_path / "missing"
    shutil.copytree(moe_assets["qwen3_moe"], missing)
    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    index = json.loads((missing / "model.safetensors.index.json").read_text())
    file = missing / index["weight_map"].pop(gone)
    tensors = load_file(file)
    del tensors[gone]
    save_file(tensors, file, metadata={"format": "pt"})
    (missing / "model.safetensors.index.json").write_text(json.dumps(index))

    out = tmp_path / "out"
    cases = [_argv(out, gelu, moe_assets["jsonl"]), _argv(out, missing, moe_assets["jsonl"])]
    messages = run_ranks(_moe_errors, 1, cases)[0]
    assert "model.hf_path" in messages[0] and "not SiLU" in messages[0], messages[0]
    assert "model.layers.1.mlp.experts.gate_up_proj" in messages[1], messages[1]
    assert f"[{EXPERTS}, 36, 30]" in messages[1] and "config.json" in messages[1], messages[1]
    assert not (out / "metrics.jsonl").exists()  # no step ran


# ---------------------------------------------------------------------------------------
# Expert parallelism on transformers' experts, with every dp_mode and compiled: 4 ranks.
# ---------------------------------------------------------------------------------------
# name -> the run's flags on 4 ranks; "ep1" (FSDP over 4, no EP) is the reference
LAYOUTS = {
    "ep1": ["--parallel.ep", "1"],
    "ep2_fsdp": ["--parallel.ep", "2"],  # experts: EP 2 x FSDP 2
    "ep2_hsdp": ["--parallel.ep", "2", "--parallel.dp_mode", "hybrid_shard",
                 "--parallel.dp_replicate", "2", "--parallel.dp_shard", "2"],
    "ep2_ddp": ["--parallel.ep", "2", "--parallel.dp_mode", "replicate",
                "--parallel.dp_replicate", "4", "--parallel.dp_shard", "1"],
    "ep2_compiled": ["--parallel.ep", "2", "--compile.enable", "true",
                     "--compile.backend", "aot_eager", "--compile.bucketing", "manual"],
}


def _layouts(rank: int, world: int, argv: list[str], out: str):
    """Train each of :data:`LAYOUTS` (one process group); per layout the losses, the
    metrics rows, every tensor gathered after training (rank 0), and for EP 2 x FSDP 2
    every tensor gathered right after loading (rank 0) and this rank's shard shape of
    the first experts weight."""
    import dataclasses

    import torch._dynamo

    from simplefsdp._torch_compat import dynamo_counters
    from simplefsdp.models import registry
    from simplefsdp.state_dict import unwrapped_name
    from simplefsdp.train.__main__ import main

    def gathered(model):  # a collective
        state = {unwrapped_name(k): v for k, v in model.state_dict().items()}
        full = {k: v.full_tensor().numpy() for k, v in state.items()}
        return full if rank == 0 else None, state

    family, runs = registry.get("hf"), {}
    for name, flags in LAYOUTS.items():
        built, loaded = [], {}

        def capture(*args, built=built, loaded=loaded, name=name, **kwargs):
            built.append(family.build(*args, **kwargs))
            if name == "ep2_fsdp":
                full, state = gathered(built[-1][1])
                gate_up = state["model.layers.0.mlp.experts.gate_up_proj"]
                loaded.update(full=full, local=tuple(gate_up.to_local().shape),
                              mesh=gate_up.device_mesh.mesh_dim_names)
            return built[-1]

        torch._dynamo.reset()
        dynamo_counters().clear()
        registry.register(dataclasses.replace(family, build=capture))
        try:
            result = main([*argv, *flags, "--metrics.output_dir", f"{out}/{name}"])
        finally:
            registry.register(family)
        runs[name] = {"losses": result.losses, "rows": result.metrics["rows"],
                      "full": gathered(built[0][1])[0], "loaded": loaded,
                      "breaks": sum(dynamo_counters()["graph_break"].values()),
                      "graphs": dynamo_counters()["stats"]["unique_graphs"]}
    return runs


@pytest.fixture(scope="module")
def layouts(moe_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_moe_layouts")
    argv = _argv(out, moe_assets["qwen3_moe"], moe_assets["jsonl"], "--training.steps",
                 "2", "--training.warmup_steps", "0", "--training.lr", "3e-3",
                 "--model.load_weights", "all_ranks")  # each rank reads its own experts
    return run_ranks(_layouts, 4, argv, str(out))


def test_moe_ep2_x_fsdp2_loads_every_tensor_bitwise(moe_assets, layouts):
    """EP 2 x FSDP 2 (4 ranks, 12 experts): each rank holds 3 experts, the rows of its
    FSDP rank inside its EP rank's 6 (a ``_StridedShard(0)`` inside ``Shard(0)``); read
    under ``all_ranks``, every gathered tensor equals, bitwise, the one transformers'
    ``from_pretrained`` builds from the same files (the loader moves bytes). With only
    2 ranks one of the two mesh dims has size 1, and the order in which the loader takes
    them does not show."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(moe_assets["qwen3_moe"],
                                                     dtype=torch.float32, **EAGER).state_dict()
    loaded = layouts[0]["ep2_fsdp"]["loaded"]
    assert [r["ep2_fsdp"]["loaded"]["local"] for r in layouts] == [(EXPERTS // 4, 36, 30)] * 4
    assert "ep" in loaded["mesh"] and "dp_shard" in loaded["mesh"], loaded["mesh"]
    assert loaded["full"].keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(torch.from_numpy(loaded["full"][key]), value), key


@pytest.mark.parametrize("layout", ["ep2_fsdp", "ep2_hsdp", "ep2_ddp"])
def test_moe_ep2_matches_ep1(layouts, layout):
    """EP 2 with FSDP (experts: EP 2 x FSDP 2), HSDP (2 replicas x 2 shards) and
    replicate (4 replicas, experts in 2 groups of 2) against the same 4 ranks without EP
    (FSDP over 4, every rank runs every expert on its own tokens): 2 AdamW steps with the
    balance loss (the second on the first's update). Every rank routes its own tokens
    alike, so only reduction orders differ (an expert's rows from two ranks in one
    matmul; gradients summed over other groups): losses and the balance loss within 1e-6
    (float32 rounding of sums of ~1), every tensor after the steps within 1e-5 (AdamW
    moves a weight by ~lr = 3e-3 times g / sqrt(g^2), so a rounding-level gradient
    difference shows as ~1e-9, except where a gradient is near 0 and the ratio is
    ill-conditioned: 1e-5 leaves room for those)."""
    ref, run = layouts[0]["ep1"], layouts[0][layout]
    print(f"{layout}: losses {run['losses']} (ep1 {ref['losses']})")
    assert run["losses"] == pytest.approx(ref["losses"], rel=0, abs=1e-6)
    assert len(run["rows"]) == len(ref["rows"]) == 2  # rank 0 logs every step
    for got, want in zip(run["rows"], ref["rows"], strict=True):
        assert got["aux_loss"] == pytest.approx(want["aux_loss"], rel=0, abs=1e-6)
        assert got["expert_load_max_mean"] == want["expert_load_max_mean"]  # same counts
    assert run["full"].keys() == ref["full"].keys()
    for key, value in ref["full"].items():
        torch.testing.assert_close(torch.from_numpy(run["full"][key]),
                                   torch.from_numpy(value), rtol=0, atol=1e-5, msg=key)


def test_moe_ep2_compiled_matches_eager(layouts):
    """EP 2 x FSDP 2 compiled (aot_eager, our manual bucketing and reordering) is one
    graph on every rank: no graph break (the routed experts' counts of static shape,
    their split sizes unbacked sizes, the exchanges functional collectives, the load
    tally a buffer update) and no recompile over the 2 steps (the second reruns the graph
    on the updated weights). Against the same eager run, 2 AdamW steps: the losses within
    1e-6 (bitwise equal seen) and every tensor within 1e-5. Not bitwise:
    the compiled step computes its gradients in another order than eager autograd (the
    traced aten backward, buckets reduce-scattering many gradients in one collective),
    and every parameter came out different by float32 rounding: at most 1.0e-6 seen
    (experts' down_proj), the bound of the EP parity test above for the same reasons."""
    assert [(r["ep2_compiled"]["breaks"], r["ep2_compiled"]["graphs"]) for r in layouts] \
        == [(0, 1)] * 4
    eager, compiled = layouts[0]["ep2_fsdp"], layouts[0]["ep2_compiled"]
    diffs = {k: float(abs(compiled["full"][k] - v).max()) for k, v in eager["full"].items()}
    worst = max(diffs, key=diffs.get)
    print(f"compiled losses {compiled['losses']} (eager {eager['losses']}); largest tensor "
          f"difference {diffs[worst]:.2e} ({worst}); differing: "
          f"{sorted(k for k, d in diffs.items() if d)}")
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=0, abs=1e-6)
    assert compiled["full"].keys() == eager["full"].keys()
    assert diffs[worst] <= 1e-5, (worst, diffs[worst])


def test_our_moe_export_refused_where_mixtral_differs(tmp_path):
    """Config load refuses ``checkpoint.export_hf`` for our MoE settings Mixtral does not
    compute (a shared expert, sigmoid scores, bias balancing), naming each key."""
    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(None, [*OUR_MOE, "--model.shared_hidden_dim", "32", "--model.score_func",
                           "sigmoid", "--model.load_balance", "bias",
                           "--metrics.output_dir", str(tmp_path)])
    message = str(info.value)
    for key in ("checkpoint.export_hf", "model.shared_hidden_dim = 32",
                "model.score_func = 'sigmoid'", "model.load_balance = 'bias'"):
        assert key in message, message


# ---------------------------------------------------------------------------------------
# One process, no ranks: the balance-loss key and the expert counts under AC.
# ---------------------------------------------------------------------------------------
def _tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_moe_expert_counts_once_under_activation_checkpointing(mode):
    """A checkpointed decoder layer routes its tokens again in backward; the loads
    (``take_loads``) count the forward's routing once: per layer, the bincount of the
    top-k of transformers' own router logits (exact integers), summing to tokens x top_k."""
    from transformers import AutoModelForCausalLM

    from simplefsdp.hf.experts import adapt_experts, take_loads
    from simplefsdp.hf.model import decoder_layers
    from simplefsdp.parallel.activation_checkpoint import apply_ac

    torch.manual_seed(0)
    config = _qwen3_moe_config()
    model = AutoModelForCausalLM.from_config(config)
    assert adapt_experts(model) == 2
    apply_ac(model, mode, layers=decoder_layers(model, config))
    tokens = _tokens()
    out = model(input_ids=tokens, output_router_logits=True, use_cache=False)
    out.logits.sum().backward()  # the recompute runs here
    want = torch.stack([torch.bincount(logits.topk(2, dim=-1).indices.flatten(),
                                       minlength=EXPERTS).float()
                        for logits in out.router_logits])
    loads = take_loads(model)
    assert torch.equal(loads, want), (loads, want)
    assert loads.sum(1).tolist() == [tokens.numel() * 2] * 2  # 32 tokens x top 2, per layer


@pytest.mark.parametrize("coef", [0.0, 0.5, None])
def test_moe_router_aux_loss_coef_overrides_the_folder(moe_assets, coef):
    """``model.router_aux_loss_coef``: 0 turns the folder's balance loss off (no router
    logits, no aux loss), 0.5 weighs it 0.5, left out keeps the folder's (COEF). The loss
    kept for the trainer (``hooks.aux_loss``) against ``coef x`` transformers' own balance
    loss of the folder's model on the same tokens (the same ops: bitwise)."""
    from transformers import AutoModelForCausalLM

    from simplefsdp.config.job import load_config
    from simplefsdp.hf.hooks import aux_loss
    from simplefsdp.hf.model import causal_lm_call, job_config

    folder = moe_assets["qwen3_moe"]
    flags = ["--model.hf_path", str(folder)]
    if coef is not None:
        flags += ["--model.router_aux_loss_coef", str(coef)]
    config = job_config(load_config(None, flags))
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, **EAGER)
    causal_lm_call(model, model)(_tokens())
    if coef == 0.0:
        assert config.output_router_logits is False and aux_loss(model) is None
        return
    reference = AutoModelForCausalLM.from_pretrained(folder, **EAGER)
    want = reference(input_ids=_tokens(), output_router_logits=True, use_cache=False).aux_loss
    assert aux_loss(model) is not None and want > 0
    assert torch.equal(aux_loss(model), (COEF if coef is None else coef) * want)


def test_moe_router_aux_loss_coef_refused(moe_assets, tmp_path):
    """Refused at config load, naming the key: without model.hf_path (our MoE has
    model.aux_loss_coef), below 0, and on a folder whose model has no balance loss."""
    from transformers import LlamaConfig

    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError

    LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64).save_pretrained(tmp_path)
    for flags, message in [
        ([], "model.hf_path is not set; for our MoE presets use model.aux_loss_coef"),
        (["--model.hf_path", str(moe_assets["qwen3_moe"]), "--model.router_aux_loss_coef",
          "-1"], "model.router_aux_loss_coef = -1.0 is out of range: it must be >= 0"),
        (["--model.hf_path", str(tmp_path)], "(LlamaConfig) has no output_router_logits"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(None, flags + (["--model.router_aux_loss_coef", "0.1"]
                                       if "-1" not in flags else []))
        assert message in str(info.value), str(info.value)


def test_blas_rounding_depends_on_where_the_rows_start():
    """The module docstring's reason for comparing with transformers' loop within 1e-5,
    not bitwise: the same (rows, 30) x (30, 36) product (an expert's ``linear`` at this
    file's hidden size) of the same values, its rows placed at 64 float offsets in a
    buffer. Starting on a 16-byte boundary (every 4th float) it is bitwise equal to a
    fresh tensor's; elsewhere, for 2 and 3 rows, the CPU BLAS takes another path and
    rounds differently (on this x86 MKL build every unaligned offset; also under
    MKL_ENABLE_INSTRUCTIONS=AVX2 and SSE4_2), within float32 rounding of the 30-term dot
    products (1e-6 of the sum of |terms|)."""
    torch.manual_seed(0)
    weight = torch.randn(36, 30)
    for rows in (2, 3):
        x = torch.randn(rows, 30)
        fresh = torch.nn.functional.linear(x, weight)
        bound = 1e-6 * (x.abs() @ weight.abs().T)
        unaligned_differ = []
        for offset in range(64):
            buffer = torch.zeros(offset + rows * 30)
            placed = buffer[offset:].view(rows, 30)
            placed.copy_(x)
            got = torch.nn.functional.linear(placed, weight)
            assert ((got - fresh).abs() <= bound).all(), (rows, offset)
            if offset % 4 == 0:
                assert torch.equal(got, fresh), (rows, offset)
            else:
                unaligned_differ.append(not torch.equal(got, fresh))
        assert any(unaligned_differ), f"{rows} rows: bitwise at every offset here"
