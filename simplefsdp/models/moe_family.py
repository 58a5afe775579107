"""The mixture-of-experts decoder (``models/moe.py``) as a model family: our Llama's
family (``llama_family``: built on meta, parallelized, initialized from the seed) with
the ``MoETransformer`` and three additions.

* Expert parallelism (``parallel.ep``): before data parallel, every MoE layer's experts
  are split over the experts' mesh (``ParallelDims.expert_mesh``, ``parallel/expert.py``)
  and ``data_parallel``-sharded there in the job's ``dp_mode``; the rest of the model is
  sharded as a dense one. With ``ep = 1`` the experts are sharded with the rest.
* The router stays float32 under mixed precision: its module glob is added to
  ``training.mixed_precision_fp32_modules`` (gathered, computed and reduced in float32).
* The balance loss (``load_balance = "aux_loss"``) joins the loss in ``step.py``; after each
  optimizer step :func:`_after_step` sums the routed slots per expert over the
  data-parallel ranks, moves the bias (``load_balance = "bias"``) and reports the step's
  figures (``metrics.csv``): ``aux_loss`` (coefficient applied, token-weighted over the
  ranks as the loss is), ``expert_load_max_mean`` (the busiest expert's slots over the
  mean per expert, worst layer; 1 is balanced), ``tokens_dropped`` (routed slots the
  padded dispatch dropped, ``parallel.expert_dispatch = "padded"``; 0 when exact).

Tensor parallelism splits attention and the shared expert as in a dense block; the router
and the routed experts stay whole, each TP rank routing its own part of the sequence
(``parallel/expert.moe_tp_plan``): the experts are sharded over ``dp_shard x cp x tp /
ep`` (``ParallelDims.expert_mesh``), also with ``ep = 1``. Pipeline stages hold whole
blocks; each stage's balance loss joins backward through its output (``pipeline.AuxLossStage``).

Refused at config load, naming the key: MLA attention (``model.attention = "mla"``)
with TP, CP or ``checkpoint.export_hf``; ``ep`` not dividing ``model.num_experts`` (the
ranks: ``ParallelDims``), ``tp`` not dividing ``model.shared_hidden_dim``, a dense preset,
Hugging Face weights (another family's job), ``checkpoint.export_hf`` of a model Mixtral
does not compute alike (``hf.llama_layout.mixtral_refusal``: the export writes a Mixtral
folder) or under PP.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..config.job import JobConfig
from ..errors import ConfigError, config_errors
from ..mesh import ParallelDims
from ..models import moe, registry
from ..parallel.expert import (
    MOE_COLUMNS,
    apply_ep,
    check_expert_split,
    expert_figures,
    set_expert_dispatch,
    set_token_group,
    shard_experts,
)
from ..parallel.expert_tensor import apply_etp
from .llama_family import build_model
from .parallelize import dp_options, parallelize, with_fp32_modules

ROUTER_GLOB = "layers.*.feed_forward.gate"  # every MoE block's router (models/moe.Router)


def _validate(cfg: JobConfig, dims: ParallelDims) -> None:
    m, p = cfg.model, cfg.parallel
    if m.hf_path is not None or m.init_from_hf is not None:
        key = "hf_path" if m.hf_path is not None else "init_from_hf"
        raise ConfigError(f"model.{key} is a Hugging Face folder; model.family = 'moe' trains "
                          f"our MoE from model.name's preset: leave model.{key} out")
    args = m.model_args()
    if not isinstance(args, moe.MoEArgs):
        raise ConfigError(f"model.family = 'moe' needs an MoE preset, but model.name = "
                          f"{m.name!r} is dense; choose one of {', '.join(moe.MOE_PRESETS)}")
    with config_errors():
        check_expert_split(p.ep, args.num_experts, prefix="parallel.")
    if args.mla:
        _validate_mla(cfg, dims)
    if args.shared_hidden_dim % p.tp:
        raise ConfigError(f"parallel.tp = {p.tp} does not divide model.shared_hidden_dim = "
                          f"{args.shared_hidden_dim} (the shared expert is split over TP); "
                          f"change one of them")
    if cfg.checkpoint.export_hf:
        _validate_export(args, p.pp)


def _validate_mla(cfg: JobConfig, dims: ParallelDims) -> None:
    """MLA (``model.attention = "mla"``) is not yet split by tensor or context parallelism
    (their plans and ring/Ulysses cores are written for Llama's q/k/v of one head size) and
    has no Hugging Face export: refused, naming the key."""
    p = cfg.parallel
    for key, on in (("parallel.tp", p.tp > 1), ("parallel.cp_ring / parallel.cp_ulysses",
                                                dims.cp > 1),
                    ("checkpoint.export_hf", cfg.checkpoint.export_hf)):
        if on:
            raise ConfigError(f"{key} is not supported with model.attention = 'mla' yet; "
                              f"turn {key} off (1 / false) or set model.attention = 'gqa'")


def _validate_export(args: moe.MoEArgs, pp: int) -> None:
    """``checkpoint.export_hf`` writes a Mixtral folder from the whole model: refused for
    a model Mixtral does not compute alike and under pipeline parallelism."""
    from ..hf.llama_layout import mixtral_refusal

    why = mixtral_refusal(args)
    if why is not None:
        raise ConfigError(f"checkpoint.export_hf = true cannot be written for {why}; set "
                          f"checkpoint.export_hf = false (export_safetensors works)")
    if pp > 1:
        raise ConfigError(f"checkpoint.export_hf = true with parallel.pp = {pp}: each stage "
                          f"holds part of the model; export from a run with parallel.pp = 1 "
                          f"(or set checkpoint.export_hf = false)")


def _with_router_fp32(cfg: JobConfig) -> JobConfig:
    """``cfg`` with the routers kept in float32 when the model computes in another dtype."""
    args = cfg.model.model_args()
    has_router = args.n_dense_layers < args.n_layers
    return with_fp32_modules(cfg, [ROUTER_GLOB] if has_router else [])


def _shard_experts(model, mesh, cfg: JobConfig) -> None:
    """Expert parallelism, then the experts' data parallel on their own mesh (ep > 1, or
    tp > 1: TP ranks route different tokens, so the experts' gradients are summed over
    them too); under TP the balance loss's statistics over the whole sequences."""
    p = cfg.parallel
    set_token_group(model, mesh)
    set_expert_dispatch(model, p.expert_dispatch, p.expert_capacity_factor)
    if p.ep == 1 and p.tp == 1:
        return
    experts_mesh = ParallelDims.expert_mesh(mesh, p.ep, p.dp_mode, p.etp)
    if p.etp > 1:  # the experts' width split over TP (and their ep split)
        apply_etp(model, experts_mesh)
    elif p.ep > 1:
        apply_ep(model, experts_mesh)
    shard_experts(model, experts_mesh, **dp_options(cfg))


COMPILE_NOTE = ("[simplefsdp] compile: the routed experts are traced into each MoE "
                "block's graph (the exact dispatch's split sizes as unbacked sizes, its "
                "all-to-alls as functional collectives; parallel.expert_dispatch = 'padded' "
                "has static shapes); under selective activation checkpointing a routed "
                "block keeps its token exchanges' and its experts' matmuls' outputs")
# Not one graph by force: nothing breaks under no or selective AC; under full AC each
# block's own call is compiled inside its eager checkpoint
# (``parallel.activation_checkpoint.compile_checkpointed_blocks``).
FULLGRAPH = False


def _parallelize(model, mesh, dims: ParallelDims, cfg: JobConfig):
    """The dense model's parallelisms with expert parallelism before data parallel;
    compiled as :data:`COMPILE_NOTE` says."""
    if cfg.compile.enable and dist.get_rank() == 0:
        print(COMPILE_NOTE, flush=True)
    return parallelize(model, mesh, dims, _with_router_fp32(cfg), before_dp=_shard_experts,
                       fullgraph=FULLGRAPH)


def _after_step(s, step_aux: torch.Tensor | None) -> dict[str, float]:
    """The bias update and the step's figures (see the module docstring). Two all-reduces
    over every rank. The loads go into a table of all the model's blocks (a pipeline
    stage fills its own rows), summed over every rank: each routed different tokens (TP
    ranks each their part of the sequence: ``parallel/expert.moe_tp_plan``). The balance
    loss is the whole slice's on each TP rank, so only TP rank 0's share counts."""
    own, args = s.at.tp == 0, s.cfg.model.model_args()
    rows = _moe_block_ids(s.model)
    table = torch.zeros(args.n_layers, args.num_experts, device=s.device)
    if rows:
        table[rows] = torch.stack([m.tokens_per_expert for m in moe.moe_layers(s.model)])
    dist.all_reduce(table)  # every rank, also a stage without MoE blocks
    moe.update_expert_bias(s.model, reduce=lambda _: table[rows])  # then zeroed
    dropped = torch.zeros((), device=s.device)
    for layer in moe.moe_layers(s.model):
        dropped += layer.tokens_dropped
        layer.tokens_dropped.zero_()
    return expert_figures(table[table.sum(1) > 0], step_aux if own else None, s.device,
                          dropped)


def _moe_block_ids(model) -> list[int]:
    """The block index (``layers.<i>``: the whole model's numbering, also in a pipeline
    stage) of each MoE layer of ``model``, in ``moe.moe_layers`` order."""
    return [int(name) for name, block in model.layers.items()
            for _ in moe.moe_layers(block)]


def _export(cfg: JobConfig, model, tokenizer):
    """``checkpoint.export_hf``: a Mixtral folder ``from_pretrained`` opens (``hf.hooks``)."""
    if not cfg.checkpoint.export_hf:
        return None
    from ..hf.hooks import export_moe

    return export_moe(cfg, model, tokenizer)


_llama = registry.get("llama")

registry.register(registry.ModelFamily(
    name="moe",
    validate=_validate,
    build=functools.partial(build_model, model_cls=moe.MoETransformer,
                            parallelize_fn=_parallelize),
    parallelize=_parallelize,
    tokenizer=_llama.tokenizer,
    check_tokenizer=_llama.check_tokenizer,
    convert=None,
    # activated parameters: router, top-k experts, shared expert (MoEArgs.ffn_matmul_params)
    flops_per_token=_llama.flops_per_token,
    fingerprint=_llama.fingerprint,
    export=_export,
    fullgraph=FULLGRAPH,
    context_parallel=True,
    expert_parallel=True,
    aux_loss=moe.aux_loss,
    after_step=_after_step,
    metric_columns=MOE_COLUMNS,
))
