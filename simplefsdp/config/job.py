"""Job configuration: the trainer's TOML schema, its defaults and its range checks.

Every section is a dataclass below; its field types are the schema, read and
type-checked by ``config.reader`` (a TOML file, then ``--section.key value``
overrides; every error names the key). ``JobConfig.validate`` adds the ranges and the
consistency rules that types cannot express. The defaults are the ``debug`` run, which
trains a tiny model on a laptop CPU: ``load_config(None, [])`` is that run, and so is
``configs/debug.toml``.

    cfg = load_config("configs/llama3_8b.toml", ["--training.steps", "10"])
    cfg.parallel.resolve(world_size)  # fills dp_shard = -1, checks the product
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from ..data_parallel import Mode
from ..errors import ConfigError, choices, config_errors, require
from ..mesh import ParallelDims
from ..models import registry
from ..models.llama import LLAMA3_PRESETS, ModelArgs
from ..models.moe import MOE_PRESETS
from ..models.registry import ModelFamily
from ..reshard_group import check_config as check_reshard_config
from .compile import CompileConfig, check_compile
from .float8 import Float8Config, check_float8
from .keys import (
    check_data,
    check_etp,
    check_expert_dispatch,
    check_hf_balance,
    check_layout_keys,
)
from .lora import LoraConfig, check_lora
from .reader import config_help as help_text
from .reader import read_config, split_argv
from .shapes import check_pipeline, check_seq_len, check_tp
from .watch import ProfilingConfig, ValidationConfig, check_profiling, check_validation

DType = Literal["float32", "bfloat16"]
# The one map from a config's dtype name to torch's (derived from ``DType``).
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in get_args(DType)}
Device = Literal["cpu", "cuda"]
# Activation checkpointing per block (parallel/activation_checkpoint.py).
ACMode = Literal["none", "selective", "full"]
AC_MODES: tuple[str, ...] = get_args(ACMode)
# Every process group's timeout: a hung collective fails after this instead of waiting.
PG_TIMEOUT_S = int(os.environ.get("SIMPLEFSDP_PG_TIMEOUT_S", "600"))


_NOT_MODEL_ARGS = ("family", "name", "hf_path", "init_from_hf", "load_weights",
                   "router_aux_loss_coef")


@dataclass
class ModelConfig:
    """``name`` picks a preset of ``LLAMA3_PRESETS``; any other key overrides one of its
    ``ModelArgs`` fields (left out = the preset's value)."""

    # The model family (``models.registry.FAMILIES``); left out: 'hf' with hf_path, else
    # 'llama'.
    family: str | None = None
    name: str = "debug"  # the preset (LLAMA3_PRESETS, MOE_PRESETS) the keys below override
    dim: int | None = None  # model width (hidden size)
    n_layers: int | None = None  # transformer blocks
    n_heads: int | None = None  # attention (query) heads
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention)
    vocab_size: int | None = None  # embedding rows; must hold every token id
    multiple_of: int | None = None  # the FFN width is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None  # scales the FFN width (Llama 3: 1.3 for 70B)
    norm_eps: float | None = None  # RMSNorm epsilon
    rope_theta: float | None = None  # RoPE base frequency
    max_seq_len: int | None = None  # longest sequence the RoPE table covers
    tie_embeddings: bool | None = None  # the output projection shares the embedding
    # [moe] Mixture of experts (a preset of MOE_PRESETS; models/moe.py): routed experts
    # per MoE block, of which each token takes top_k.
    num_experts: int | None = None
    top_k: int | None = None  # experts per token
    moe_hidden_dim: int | None = None  # width of each routed expert
    shared_hidden_dim: int | None = None  # width of the always-on shared expert; 0: none
    score_func: str | None = None  # router scores: softmax | sigmoid
    norm_topk_prob: bool | None = None  # rescale each token's top-k weights to sum to 1
    # aux_loss: Switch balance loss (times aux_loss_coef) added to the loss; bias: the
    # auxiliary-loss-free per-expert bias, moved after each step; none.
    load_balance: str | None = None
    aux_loss_coef: float | None = None  # weight of the balance loss in the loss
    bias_update_rate: float | None = None  # bias balancing's step per optimizer step
    n_dense_layers: int | None = None  # first blocks that keep the dense FFN
    # [mla] The MoE presets' attention: gqa (our Llama's) | mla (DeepSeek's multi-head
    # latent attention, models/mla.py; deepseek_v3_16b's) with its sizes below.
    attention: str | None = None
    kv_lora_rank: int | None = None  # MLA: width of the compressed key/value latent
    qk_nope_head_dim: int | None = None  # MLA: query/key features per head without RoPE
    qk_rope_head_dim: int | None = None  # MLA: query/key features per head with RoPE
    v_head_dim: int | None = None  # MLA: value features per head
    # [hf] A local Hugging Face causal LM folder, trained with transformers' own class
    # (``name`` and the shape keys above are then unused) ...
    hf_path: str | None = None
    # ... or a Hugging Face Llama folder whose weights initialize the ``name`` preset.
    init_from_hf: str | None = None
    # How those weights are read: rank 0 reads and scatters, or each rank reads its rows.
    load_weights: Literal["broadcast", "all_ranks"] = "broadcast"
    # A Hugging Face MoE's balance loss (hf_path), overriding its config.json: left out,
    # the folder's output_router_logits / router_aux_loss_coef; 0: off (no router logits
    # recorded); > 0: on, with this weight.
    router_aux_loss_coef: float | None = None

    def family_entry(self) -> ModelFamily:
        """This model's entry in the model registry (a ConfigError if unknown)."""
        name = self.family or ("hf" if self.hf_path is not None else
                               "moe" if self.name in MOE_PRESETS else "llama")
        with config_errors():
            return registry.get(name)

    def model_args(self) -> ModelArgs:
        """The preset with the overrides applied (an MoE preset: ``MoEArgs``)."""
        presets = {**LLAMA3_PRESETS, **MOE_PRESETS}
        if self.name not in presets:
            raise ConfigError(f"model.name = {self.name!r} is not a preset; choose one of "
                              f"{choices(presets)}")
        overrides = {f.name: getattr(self, f.name) for f in fields(self)
                     if f.name not in _NOT_MODEL_ARGS and getattr(self, f.name) is not None}
        preset = presets[self.name]
        dense = [k for k in overrides if k not in {f.name for f in fields(preset)}]
        if dense:
            raise ConfigError(f"model.{dense[0]} configures a mixture of experts, but model.name "
                              f"= {self.name!r} is a dense preset; pick an MoE preset "
                              f"({choices(MOE_PRESETS)}) or leave model.{dense[0]} out")
        try:
            return dataclasses.replace(preset, **overrides)
        except ValueError as e:
            raise ConfigError(f"[model]: {e}") from None


@dataclass
class TrainingConfig:
    steps: int = 200  # optimizer steps of the whole run
    batch_size: int = 8  # sequences per data-parallel rank and micro-step
    seq_len: int = 128  # tokens per sequence
    lr: float = 1e-3  # peak AdamW learning rate (after warmup, then cosine decay)
    warmup_steps: int = 20  # steps of linear LR warmup
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    beta1: float = 0.9  # AdamW's decay rate of the gradient's running mean
    beta2: float = 0.95  # AdamW's decay rate of the squared gradient's running mean
    eps: float = 1e-8  # AdamW's term added to the denominator, for numerical stability
    max_norm: float = 1.0  # gradient clipping: the global gradient norm is scaled to at most this
    grad_accum_steps: int = 1  # micro-steps (forward + backward) per optimizer step
    # "every_microstep" reduces each micro-step's gradients; "last_microstep" accumulates
    # them unreduced (full-size gradient memory) and reduces the sum once, on the last
    # micro-step: 1/grad_accum_steps of the reduce-scatters/all-reduces.
    gradient_sync: Literal["every_microstep", "last_microstep"] = "every_microstep"
    # Keep parameter shards, gradients and optimizer state in host memory (pinned); each
    # read copies a shard to the GPU before its all-gather and the optimizer steps on the
    # CPU (data_parallel's offload_policy, FSDP2's CPUOffloadPolicy). CUDA jobs only.
    cpu_offload: bool = False
    seed: int = 0  # initialization and data order
    mixed_precision_param: DType = "float32"  # dtype of gathered params and compute
    mixed_precision_reduce: DType = "float32"  # dtype of gradient reduction
    # Module FQN globs (fnmatch, e.g. "*.router", "norm") kept in float32 (gathered,
    # computed and reduced) whatever mixed_precision_param/_reduce say; each must match.
    mixed_precision_fp32_modules: list[str] = field(default_factory=list)
    # A step phase or collective waiting longer than this dumps every rank's Python
    # stacks and fails the job (train/watchdog.py); 0 turns the watchdog off.
    hang_watchdog_s: float = 180.0


@dataclass
class ParallelConfig:
    """Mesh sizes; their product must equal the world size (``dp_shard = -1``: the rest).
    The rules are ``simplefsdp.mesh.ParallelDims``'s (:meth:`dims`)."""

    dp_replicate: int = 1  # data-parallel replicas (hybrid_shard, replicate)
    dp_shard: int = -1  # ranks each parameter is sharded over; -1: the rest of the world
    tp: int = 1  # tensor (+ sequence) parallel ranks, innermost: keep within a node
    pp: int = 1  # pipeline stages, outermost
    # Context parallelism (long sequences): each sequence split over cp_ring * cp_ulysses
    # ranks of one data-parallel slice, which also shard the parameters with dp_shard.
    cp_ring: int = 1  # ring attention ranks: load-balanced chunks
    cp_ulysses: int = 1  # Ulysses ranks: heads traded for sequence (all-to-all), inside ring
    # How the ring's K/V reach every rank (parallel/ring.py): "allgather" (the whole ring's
    # K/V held per layer, kept for backward; the least communication) or "ring" (passed
    # point to point, overlapping attention: two blocks held, its own kept for backward;
    # backward passes them around again with their dK/dV). Only with cp_ring > 1.
    cp_rotate: Literal["allgather", "ring"] = "allgather"
    # expert-parallel ranks (MoE models), dividing model.num_experts and the ranks their
    # groups come out of: dp_shard x cp x tp (dp_replicate where those are 1)
    ep: int = 1
    # Expert tensor parallelism (MoE models): 1, or parallel.tp to split each routed
    # expert's width over the TP ranks (gate_up column-wise, down row-wise); each TP rank
    # then stores and computes its slice for the routed slots of its whole TP group, and
    # parallel.ep divides dp_shard (TP peers hold the same experts). Needs the exact
    # dispatch.
    etp: int = 1
    # How MoE layers send tokens to their experts (also with ep = 1). "exact": every routed
    # slot, uneven split sizes known at run time (unbacked sizes under torch.compile).
    # "padded": each rank sends every expert exactly C rows, C = ceil(expert_capacity_factor
    # x its routed slots / model.num_experts); an expert's slots beyond C are dropped (their
    # routed output is 0) and counted in metrics.csv's tokens_dropped. Static shapes.
    expert_dispatch: Literal["exact", "padded"] = "exact"
    # The padded dispatch's capacity over an even share (> 0; num_experts drops nothing).
    expert_capacity_factor: float = 1.25
    # fully_shard: FSDP over dp_shard; hybrid_shard: HSDP, shards over dp_shard and
    # replicas over dp_replicate; replicate: DDP over dp_replicate.
    dp_mode: Mode = "fully_shard"
    pp_microbatches: int = 1  # microbatches per pipeline step; divides training.batch_size
    # Free gathered parameters after forward and gather again in backward. "auto": on
    # without PP, off with PP (1F1B runs several forwards before a backward: resharding
    # would gather the same parameters once per microbatch); true / false are honoured.
    # An int N (fully_shard, a divisor of dp_shard strictly between 1 and it; no TP, CP
    # or PP): keep parameters sharded over groups of N neighbouring ranks after forward
    # (e.g. a node), so backward gathers within the group (FSDP2's int, ZeRO++'s hpZ).
    reshard_after_forward: bool | int | Literal["auto"] = "auto"
    # With tp > 1: the output projection's logits stay split over the vocabulary on the TP
    # ranks and the cross-entropy runs over the pieces (torch's loss_parallel), instead
    # of gathering every token's whole-vocabulary logits on every TP rank.
    loss_parallel: bool = True
    # manual: the sizes above as written. auto: before building anything, rank 0 runs the
    # planner's search (python -m simplefsdp.plan --search) for this job on the world size
    # and the device profile parallel.hardware, and every rank trains its fastest layout
    # that fits parallel.memory_limit_gb (parallel sizes, dp_mode, pp_microbatches,
    # activation_checkpoint.mode, training.batch_size); those of them set in the TOML or
    # on the command line are kept. The choice is printed and written to
    # <metrics.output_dir>/layout.toml, which repeats the run without the search.
    layout: Literal["manual", "auto"] = "manual"
    # layout = "auto": usable memory per rank, decimal GB (as compile.memory_limit_gb).
    # None: the device profile's (a GPU's memory; on CPU the host's memory over its ranks).
    memory_limit_gb: float | None = None
    # layout = "auto": the device profile planned for, a key of hardware.GPU_PROFILES
    # (h100-sxm, h100-96gb, h200, a100-80gb, cpu); "auto": the CUDA device's, on CPU "cpu".
    hardware: str = "auto"

    def dims(self) -> ParallelDims:
        """These sizes as ``ParallelDims`` (errors name the ``parallel.`` keys); raises a
        ConfigError if a size is out of range or not supported yet."""
        with config_errors():
            return ParallelDims(pp=self.pp, dp_replicate=self.dp_replicate,
                                dp_shard=self.dp_shard, cp_ring=self.cp_ring,
                                cp_ulysses=self.cp_ulysses, tp=self.tp, ep=self.ep,
                                prefix="parallel.")

    def resolve(self, world_size: int) -> ParallelConfig:
        """A copy with ``dp_shard`` filled in; raises if the sizes cannot multiply to
        ``world_size`` or if ``dp_mode`` does not fit them."""
        dims = self.dims()
        with config_errors():
            dims = dims.resolve(world_size)
            dims.check_mode(self.dp_mode)
        return dataclasses.replace(self, dp_shard=dims.dp_shard)

    @property
    def microbatches(self) -> int:
        """Microbatches a step's batch is split into: ``pp_microbatches`` under PP, else
        one (the one owner of the rule; ``pp_microbatches`` means nothing without PP)."""
        return self.pp_microbatches if self.pp > 1 else 1

    @property
    def reshard(self) -> bool | int:
        """``reshard_after_forward`` with "auto" resolved (the one owner of the rule)."""
        if self.reshard_after_forward == "auto":
            return self.pp == 1
        return self.reshard_after_forward

    @property
    def vocab_sharded_loss(self) -> bool:
        """Whether the loss runs on vocabulary-sharded logits: ``loss_parallel`` with
        ``tp > 1`` (the one owner of the rule; without TP the logits are whole anyway)."""
        return self.loss_parallel and self.tp > 1


@dataclass
class ActivationCheckpointConfig:
    # none; selective: keep attention and every other matmul, recompute the rest; full:
    # recompute each block in backward.
    mode: ACMode = "none"


@dataclass
class DataConfig:
    # The shipped corpus, or .txt / .jsonl / .parquet data: a file, a folder or a glob;
    # several, comma-separated, are a mixture sampled by data.weights.
    dataset: str = "shakespeare"
    # 'byte', a tokenizer.json (or its folder), a tiktoken file; 'auto': the
    # model.hf_path folder's own tokenizer, else 'byte'.
    tokenizer: str = "auto"
    text_field: str = "text"  # the document text's field in .jsonl / .parquet rows
    # Token caches (one folder per source, files and tokenizer); "": $SIMPLEFSDP_CACHE_DIR
    # /tokens, default ~/.cache/simplefsdp/tokens.
    cache_dir: str = ""
    weights: list[float] = field(default_factory=list)  # mixture weight per dataset source
    tokenize_workers: int = 0  # processes tokenizing a new cache; 0: every core
    streaming: bool = False  # tokenize on the fly, no cache, no validation split
    document_mask: bool = False  # attend within documents only; positions restart at EOS


@dataclass
class MetricsConfig:
    log_every: int = 10  # steps between metrics rows (metrics.csv, the console)
    output_dir: str = "outputs"  # metrics.csv, TensorBoard logs, checkpoints and exports
    tensorboard: bool = False  # also write TensorBoard event files
    # Also send every metrics row (and the whole config) to Weights & Biases, from rank 0
    # (pip install wandb; WANDB_MODE=offline records without a network).
    wandb: bool = False


@dataclass
class CheckpointConfig:
    enable: bool = False  # write sharded checkpoints (torch.distributed.checkpoint)
    every: int = 100  # steps between checkpoints
    folder: str = "checkpoints"  # a relative path lies under metrics.output_dir
    keep_latest: int = 2  # 0 keeps them all
    export_safetensors: bool = False  # also write a full-model .safetensors at the end
    export_hf: bool = False  # also write <metrics.output_dir>/hf, a Hugging Face model folder
    # Continue from the newest complete checkpoint in ``folder`` (``--resume``). Off, a
    # folder that already holds complete checkpoints is an error, not silently reused.
    resume: bool = False
    # How the files are written (train/async_save.py): "sync" stops training for the
    # whole write; "async"/"async_pinned" only for a copy of the state, then write in
    # the background; the checkpoint counts (manifest) once the write has finished.
    async_mode: Literal["sync", "async", "async_pinned"] = "sync"


@dataclass
class JobSection:
    device: Device = "cpu"  # cpu (gloo) or cuda (NCCL, one GPU per rank)
    name: str = "debug"  # a label for the run (nothing in the trainer reads it)


@dataclass
class JobConfig:
    """The whole job: one attribute per TOML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    data: DataConfig = field(default_factory=DataConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    job: JobSection = field(default_factory=JobSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def validate(self, world_size: int | None = None) -> None:
        """Range and consistency checks that types alone cannot express. With
        ``world_size``, the parallel sizes must multiply to it, checked before the model's
        shapes: a world the sizes cannot fill is the first thing to fix."""
        t, p = self.training, self.parallel
        args = self.model.model_args()
        for key in ("steps", "batch_size", "seq_len", "grad_accum_steps"):
            require(getattr(t, key) >= 1, f"training.{key}", getattr(t, key), ">= 1")
        require(t.lr > 0, "training.lr", t.lr, "> 0")
        require(t.warmup_steps >= 0, "training.warmup_steps", t.warmup_steps, ">= 0")
        require(t.weight_decay >= 0, "training.weight_decay", t.weight_decay, ">= 0")
        require(t.max_norm > 0, "training.max_norm", t.max_norm, "> 0")
        for key in ("beta1", "beta2"):
            require(0 <= getattr(t, key) < 1, f"training.{key}", getattr(t, key), "in [0, 1)")
        require(t.eps > 0, "training.eps", t.eps, "> 0")
        require(t.hang_watchdog_s >= 0, "training.hang_watchdog_s", t.hang_watchdog_s,
                ">= 0 (0 turns the watchdog off)")
        hf_model = self.model.hf_path is not None  # its shapes are in its config.json
        check_hf_balance(self.model)
        if not hf_model:
            check_seq_len(t.seq_len, args)
        require(p.pp_microbatches >= 1, "parallel.pp_microbatches", p.pp_microbatches, ">= 1")
        if t.gradient_sync == "last_microstep" and p.pp > 1:
            raise ConfigError("training.gradient_sync = 'last_microstep' is not supported with "
                              f"parallel.pp = {p.pp} yet: use training.gradient_sync = "
                              "'every_microstep' (the default) with pipeline parallelism")
        if world_size is not None:
            p = p.resolve(world_size)  # the world first; then dp_mode on the sizes
        dims = p.dims()  # the sizes' one view while validating; a run builds its own
        with config_errors():
            dims.check_mode(p.dp_mode)
        check_reshard_config(p, dims)
        if t.cpu_offload and self.job.device == "cpu":
            raise ConfigError("training.cpu_offload = true moves shards from the device to the "
                              "host, but job.device = 'cpu' has no device memory to free: set "
                              "job.device = 'cuda' or training.cpu_offload = false")
        if p.pp > 1 and t.batch_size % p.pp_microbatches:
            raise ConfigError(f"training.batch_size = {t.batch_size} must be divisible by "
                              f"parallel.pp_microbatches = {p.pp_microbatches}")
        require(self.metrics.log_every >= 1, "metrics.log_every", self.metrics.log_every,
                 ">= 1")
        require(self.checkpoint.every >= 1, "checkpoint.every", self.checkpoint.every, ">= 1")
        require(self.checkpoint.keep_latest >= 0, "checkpoint.keep_latest",
                 self.checkpoint.keep_latest, ">= 0 (0 keeps all)")
        if self.checkpoint.resume and not self.checkpoint.enable:
            raise ConfigError("checkpoint.resume = true (--resume) needs checkpoint.enable = "
                              "true: pass --checkpoint.enable true as well")
        if not hf_model:
            _check_shapes(args, p)
        _check_cp(self, args, dims)
        check_compile(self.compile)
        check_layout_keys(p)
        check_data(self)
        check_validation(self.validation, self.data.streaming)
        check_profiling(self.profiling, t.steps, self.job.device)
        name = self.data.tokenizer
        if name not in ("auto", "byte") and not Path(name).exists():
            raise ConfigError(f"data.tokenizer = {name!r}: choose 'auto', 'byte', or the path "
                              f"of a tokenizer.json, a folder holding one, or a tiktoken file")
        family = self.model.family_entry()
        if p.ep > 1 and not family.expert_parallel:
            raise ConfigError(f"parallel.ep = {p.ep} needs a mixture-of-experts model, but "
                              f"model.family = {family.name!r} (model.name = "
                              f"{self.model.name!r}) has no routed experts; pick an MoE preset "
                              f"({choices(MOE_PRESETS)}) or set parallel.ep = 1")
        check_expert_dispatch(p, family.name)
        check_etp(self, family.name, dims)
        check_lora(self)
        check_float8(self)
        family.validate(self, dims)


def _check_cp(cfg: JobConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """Context parallelism: the family must have CP attention (our Llama and MoE; Hugging
    Face Llama-family models, whose heads ``hf.context_parallel.check_config`` checks); the
    sequence and heads must split (``ParallelDims.check_cp``), named by their keys."""
    p = cfg.parallel
    if p.cp_rotate != "allgather" and p.cp_ring == 1:
        raise ConfigError(f"parallel.cp_rotate = {p.cp_rotate!r} passes K/V around a ring, but "
                          f"parallel.cp_ring = 1 has none: set parallel.cp_ring > 1 or "
                          f"parallel.cp_rotate = 'allgather'")
    if dims.cp == 1:
        return
    family = cfg.model.family_entry()
    if not family.context_parallel:
        raise ConfigError(f"parallel.cp_ring / parallel.cp_ulysses > 1 need a model family with "
                          f"context-parallel attention; model.family = {family.name!r} has none "
                          f"(our Llama has), or set both to 1")
    if cfg.model.hf_path is not None:  # its heads are in config.json (hf.context_parallel)
        return
    with config_errors():
        dims.check_cp(cfg.training.seq_len, args.n_heads, "training.seq_len", "model.n_heads")


def _check_shapes(args: ModelArgs, p: ParallelConfig) -> None:
    """The model's shapes must split over ``tp`` and ``pp``: checked here, before any
    process group exists, so every rank fails at once with the same message."""
    check_tp(args, p.tp)
    check_pipeline(args, p.pp)


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                world_size: int | None = None) -> JobConfig:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides``; validated
    (for ``world_size`` processes, if given: see ``JobConfig.validate``)."""
    cfg = read_config(JobConfig(), path, overrides)
    cfg.validate(world_size)
    return cfg


ALIASES = {"--resume": "--checkpoint.resume=true"}
USAGE = ("python -m simplefsdp.train [--config FILE.toml] [--resume] [--section.key value ...]\n"
         "       python -m simplefsdp.train --check [--world-size N] [--config FILE.toml] "
         "[--section.key value ...]\n"
         "  (or torchrun [torchrun options] -m simplefsdp.train ...)\n"
         "  --check validates the config for N processes (default 1) and exits, launching "
         "nothing")


def parse_args(argv: list[str], world_size: int | None = None) -> JobConfig:
    """Command line -> config: ``[--config FILE] [--resume] [--section.key value ...]``,
    validated for ``world_size`` processes if given.

    ``--resume`` is short for ``--checkpoint.resume true``.
    """
    return load_config(*split_argv(argv, ALIASES), world_size=world_size)


def config_help() -> str:
    """Every key with its type and default, for ``--help``."""
    return help_text(JobConfig(), USAGE, ALIASES)
