"""The training loop: process group, mesh, model, parallelisms, optimizer, loss, logging.

Entry points: ``python -m simplefsdp.train --config configs/debug.toml [--section.key v]``
(see ``__main__.py``), or ``main(argv)`` / ``train(cfg)`` from Python; both return a
``TrainResult``. If a process group already exists (tests) it is used and left alone.

One optimizer step (token-normalized loss, clipping, the non-finite guard) lives in
``step.py``; this module builds what a run needs (``setup``) and runs the loop.

Before step 1 the run checks what would fail late (``preflight.py``: packages, writable
folders, free space, no overwritten metrics; the dataset's size). A step whose loss or
gradient norm is not finite is not applied and stops the run; SIGTERM/SIGINT finish the
step, save and stop (``guard.py``).

Initialization does not depend on the parallel layout: on CPU every rank initializes
the full model from ``training.seed`` and keeps its shards; on CUDA parameters are
initialized as DTensors, whose random ops use offsets into one stream.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import operator
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import simplefsdp
from simplefsdp.compiler.cost.state import optimizer_state_bytes, sharded_param_bytes
from simplefsdp.state_dict import unwrapped_name

from ..hf import hooks as hf_hooks
from ..models.llama import Transformer, flops_per_token, num_params
from . import preflight
from .checkpoint import (
    CheckpointManager,
    TrainerState,
    checkpoint_dir,
    checkpoint_step,
    config_fingerprint,
    export_safetensors,
    remove_partial,
    resume_point,
)
from .config import PG_TIMEOUT_S, ConfigError, JobConfig, config_help, parse_args
from .data import TextDataset, Tokenizer
from .guard import Preempted, StopOnSignal
from .metrics import MetricsLogger
from .parallelize import parallelize
from .pipeline import build_schedule, split_stage
from .step import OPTIMIZER, token_loss_sum, train_step


@dataclass
class TrainResult:
    """What a run did; ``losses[i]`` is the global loss of step ``start_step + i + 1``."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    start_step: int = 0
    steps: int = 0
    wall_time_s: float = 0.0
    num_params: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    output_dir: str = ""


# ---------------------------------------------------------------------------------------
# Process group.
# ---------------------------------------------------------------------------------------
def init_distributed(device_type: str) -> bool:
    """Initialize the default process group from torchrun's environment, or a world of
    one without it. Returns True if this call created it (and so should destroy it)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("job.device = 'cuda' but CUDA is not available; use "
                              "--job.device cpu")
        torch.cuda.set_device(local_rank)
    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain `python -m simplefsdp.train`: a world of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return True


# ---------------------------------------------------------------------------------------
# torch's warning about our own checkpointed regions.
# ---------------------------------------------------------------------------------------
# torch logs this once per process when it compiles a torch.utils.checkpoint region that
# has a context_fn, asking the user to make sure the region holds no in-place op. Ours do
# not: the data-parallel gather (recomputed in backward, even with ac = none) and our
# selective AC policy on blocks without in-place ops. Left alone, every compiled run and
# the planner print it on every rank, and the user can do nothing about it.
_CONTEXT_FN_WARNING = re.compile(
    r"\s*Detected that context_fn is passed to torch\.utils\.checkpoint under torch\.compile")
_CONTEXT_FN_LOGGER = "torch._higher_order_ops.wrap"  # where torch logs it
_IN_PLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                       operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                       operator.iand, operator.ior, operator.ixor, operator.ilshift,
                       operator.irshift, operator.imatmul}


def _our_context_fns() -> tuple:
    """The checkpoint context functions this library passes (looked up when needed)."""
    import importlib

    # the module by name: ``simplefsdp.data_parallel`` the attribute is the function
    gather = importlib.import_module("simplefsdp.data_parallel")
    from . import parallelize as ours

    return tuple(fn for fn in (getattr(gather, "_gather_policy_contexts", None),
                               getattr(ours, "_selective_context", None)) if fn is not None)


def _has_in_place_op(region: nn.Module) -> bool:
    """Whether a checkpointed region's graph (as Dynamo captured it) writes in place:
    ``x.relu_()``, ``torch.relu_``, ``x += y``, ``x[i] = y``, an ``out=`` argument."""
    for module in region.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.op not in ("call_function", "call_method"):
                continue
            name = node.target if isinstance(node.target, str) else \
                getattr(node.target, "__name__", "")
            if node.target in _IN_PLACE_FUNCTIONS or "out" in node.kwargs or \
                    (name.endswith("_") and not name.endswith("__")) or \
                    name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"):
                return True
    return False


class _OurCheckpointRegions(logging.Filter):
    """Drops torch's context_fn warning where the region is ours and holds no in-place
    op; any other region's warning passes, as does everything else on that logger.

    It reads the region from the frame of torch's ``tag_activation_checkpoint_impl``
    (torch 2.13), which logs the warning; where that frame is not found (another torch),
    the warning passes. torch logs it once per process: after ours is dropped, a later
    region of someone else's in the same process is not warned about (in the trainer and
    the planner every region is ours)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _CONTEXT_FN_WARNING.match(record.getMessage()):
            return True
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "tag_activation_checkpoint_impl" and \
                    frame.f_globals.get("__name__") == _CONTEXT_FN_LOGGER:
                fn, region = frame.f_locals.get("context_fn"), frame.f_locals.get("gmod")
                ours = any(fn is mine for mine in _our_context_fns())
                return not (ours and isinstance(region, nn.Module) and
                            not _has_in_place_op(region))
            frame = frame.f_back
        return True


def quiet_our_checkpoint_warning() -> logging.Filter:
    """Install (once per process) the filter of torch's warning about our checkpointed
    regions; the trainer, the planner and the benchmark call it before compiling."""
    logger = logging.getLogger(_CONTEXT_FN_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, _OurCheckpointRegions):
            return existing
    quiet = _OurCheckpointRegions()
    logger.addFilter(quiet)
    return quiet


# ---------------------------------------------------------------------------------------
# Model.
# ---------------------------------------------------------------------------------------
@torch.no_grad()
def _copy_full_init(model: nn.Module, cfg: JobConfig) -> None:
    """Overwrite every (sharded) parameter with its piece of a full model initialized
    from the seed on this rank: the same weights for every parallel layout."""
    torch.manual_seed(cfg.training.seed)
    with torch.device("meta"):
        reference = Transformer(cfg.model.model_args())
    reference.to_empty(device="cpu")
    reference.init_weights()
    full = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        source = full[unwrapped_name(name)]
        if isinstance(param, DTensor):
            piece = distribute_tensor(source, param.device_mesh, param.placements,
                                      src_data_rank=None).to_local()
            param.to_local().copy_(piece)
        else:
            param.copy_(source)


def build_model(cfg: JobConfig, mesh, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """(module to call, the underlying Transformer/stage): built on meta, split for PP,
    parallelized, then materialized on ``device`` and initialized."""
    args = cfg.model.model_args()
    with torch.device("meta"):
        model = Transformer(args)
    split_stage(model, cfg.parallel.pp, mesh["pp"].get_local_rank())
    runnable = parallelize(model, mesh, cfg)
    model.to_empty(device=device)
    with simplefsdp.disable_active_parametrization():
        with warnings.catch_warnings():  # CPU DTensor random ops; overwritten just below
            warnings.filterwarnings("ignore", message="DTensor random operators")
            torch.manual_seed(cfg.training.seed)
            model.init_weights()  # also recomputes the non-persistent RoPE buffer
        if device.type == "cpu":
            _copy_full_init(model, cfg)
    return runnable, model


# ---------------------------------------------------------------------------------------
# Optimizer, schedule, clipping.
# ---------------------------------------------------------------------------------------
def lr_lambda(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to
    ``min_ratio`` at ``total``."""
    import math

    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg: JobConfig):
    import functools

    t = cfg.training
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach kernels need every DTensor of one call on one mesh; with TP the params
    # live on two meshes (DP-only and DP x TP), so fall back to the per-tensor loop.
    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    optimizer = OPTIMIZER(params, lr=t.lr, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=t.weight_decay, foreach=len(meshes) <= 1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(lr_lambda, warmup=t.warmup_steps, total=t.steps))
    return optimizer, scheduler


# ---------------------------------------------------------------------------------------
# The loop.
# ---------------------------------------------------------------------------------------
class _Coords:
    """This rank's place in the ``(pp, dp_replicate, dp_shard, tp)`` mesh."""

    def __init__(self, mesh):
        self.pp, self.tp = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
        self.pp_size = mesh["pp"].size()
        rep, shard = mesh["dp_replicate"], mesh["dp_shard"]
        self.dp = rep.get_local_rank() * shard.size() + shard.get_local_rank()
        self.dp_size = rep.size() * shard.size()
        self.first, self.last = self.pp == 0, self.pp == self.pp_size - 1


def _device(cfg: JobConfig) -> torch.device:
    if cfg.job.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


BatchTransform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def train(cfg: JobConfig, batch_transform: BatchTransform | None = None,
          tokenizer: Tokenizer | None = None) -> TrainResult:
    """Run the job described by ``cfg``. ``batch_transform(inputs, targets)`` may rewrite
    each microbatch, e.g. set targets to ``IGNORE_INDEX`` to leave tokens out.
    ``tokenizer`` (any object with ``vocab_size`` and ``encode(text)``) replaces the one
    ``data.tokenizer`` names; its ``vocab_size`` must fit ``model.vocab_size``."""
    owns_group = init_distributed(cfg.job.device)
    try:
        return _train(cfg, batch_transform, tokenizer)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Setup:
    """Everything the loop needs, built once by :func:`setup`."""

    cfg: JobConfig  # with parallel sizes resolved
    device: torch.device
    mesh: Any
    at: _Coords
    loader: Any
    tokenizer: Tokenizer
    runnable: nn.Module  # what the loop calls (compiled / pipeline stage)
    model: nn.Module  # the underlying Transformer (or stage)
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    schedule: Any  # the pipeline schedule, None without PP
    ckpt: CheckpointManager | None
    metrics: MetricsLogger
    start_step: int
    n_params: int

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["pp"].get_group() if self.cfg.parallel.pp > 1 else None


def setup(cfg: JobConfig, tokenizer: Tokenizer | None) -> Setup:
    """Mesh, data, model, optimizer, checkpoint (resumed if asked), metrics."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(cfg)
    p = cfg.parallel.resolve(world)
    cfg = dataclasses.replace(cfg, parallel=p)  # dp_shard filled in; the caller's untouched
    t = cfg.training
    mesh = simplefsdp.make_mesh(dp_shard=p.dp_shard, dp_replicate=p.dp_replicate, tp=p.tp,
                                pp=p.pp, device_type=device.type)
    at = _Coords(mesh)
    torch.manual_seed(t.seed)
    ckpt_folder = checkpoint_dir(cfg.checkpoint.folder, cfg.metrics.output_dir)
    args = cfg.model.model_args()
    fingerprint = _fingerprint(cfg)
    resume_from = None
    if cfg.checkpoint.enable:  # decided before anything is built: a refusal is cheap
        resume_from = resume_point(ckpt_folder, cfg.checkpoint.resume, fingerprint)
    _check_before_build(cfg, ckpt_folder, rank)
    if resume_from is not None and checkpoint_step(resume_from) >= t.steps:
        raise ConfigError(f"training.steps = {t.steps}, but the checkpoint to resume from "
                          f"({resume_from}) is already at step {checkpoint_step(resume_from)}: "
                          f"nothing to do; raise --training.steps above it to train on")

    loader, tokenizer = _build_loader(cfg, tokenizer, at)
    runnable, model = hf_hooks.build_model(cfg, mesh, device, default=build_model)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer, scheduler = build_optimizer(model, cfg)
    state = TrainerState(scheduler, loader)

    ckpt = None
    start_step = 0
    if cfg.checkpoint.enable:
        space = _space_problem(params, ckpt_folder, rank)
        preflight.agree([space] if space else [])
        ckpt = CheckpointManager(ckpt_folder, model, optimizer, state,
                                 cfg.checkpoint.every, cfg.checkpoint.keep_latest,
                                 fingerprint)
        if resume_from is not None:
            start_step = ckpt.load(resume_from)
            if rank == 0:
                print(f"[simplefsdp] resumed from {resume_from} (step {start_step})",
                      flush=True)

    schedule = None
    if p.pp > 1:  # the loss is a token sum; the loop divides the gradients afterwards
        schedule, _ = build_schedule(runnable, mesh["pp"], device, p.pp_microbatches,
                                     token_loss_sum)

    tokens_per_step = t.batch_size * t.seq_len * at.dp_size * t.grad_accum_steps
    n_params = _count_params(model, mesh, at)
    metrics = MetricsLogger(cfg.metrics.output_dir, rank=rank, world=world, device=device,
                            flops_per_token=hf_hooks.flops_per_token(cfg, model, t.seq_len)
                            or flops_per_token(args, t.seq_len),
                            tokens_per_step=tokens_per_step, total_steps=t.steps,
                            start_step=start_step, tensorboard=cfg.metrics.tensorboard)
    if rank == 0:
        print(f"[simplefsdp] {n_params / 1e6:.2f}M params, world {world}: pp={p.pp} "
              f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} tp={p.tp} "
              f"({p.dp_mode}), ac={cfg.activation_checkpoint.mode}, "
              f"compile={cfg.compile.enable}, {tokens_per_step} tokens/step, "
              f"steps {start_step}->{t.steps}; peak {metrics.peak / 1e9:.1f} GFLOP/s "
              f"({metrics.peak_source})", flush=True)
    return Setup(cfg, device, mesh, at, loader, tokenizer, runnable, model, params, optimizer,
                  scheduler, schedule, ckpt, metrics, start_step, n_params)


def _fingerprint(cfg: JobConfig) -> str:
    """The model config a checkpoint was written for (a Hugging Face model: its folder)."""
    model_facts = dataclasses.asdict(cfg.model.model_args())
    if cfg.model.hf_path is not None:
        model_facts = {"hf_path": str(Path(cfg.model.hf_path).resolve())}
    return config_fingerprint(model_facts)


def _build_loader(cfg: JobConfig, tokenizer: Tokenizer | None, at: _Coords):
    """This data-parallel rank's training batches and the tokenizer; refuses a corpus
    smaller than one global batch and a tokenizer that does not fit the model."""
    t, vocab_size = cfg.training, cfg.model.model_args().vocab_size
    if tokenizer is None:
        tokenizer = hf_hooks.choose_tokenizer(cfg)
    elif not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must have vocab_size and encode(text) (the "
                        f"simplefsdp.train.data.Tokenizer protocol), got "
                        f"{type(tokenizer).__name__}")
    hf_hooks.check_vocab(cfg, tokenizer)
    if cfg.model.hf_path is None and tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"the tokenizer ({type(tokenizer).__name__}) has "
                          f"{tokenizer.vocab_size} tokens but model.vocab_size = "
                          f"{vocab_size}; raise model.vocab_size")
    dataset = hf_hooks.build_dataset(cfg, tokenizer) or TextDataset(cfg.data.dataset, tokenizer)
    loader = dataset.loader("train", t.batch_size, t.seq_len, dp_rank=at.dp,
                            dp_world=at.dp_size, seed=t.seed,
                            min_windows=t.batch_size * at.dp_size * t.grad_accum_steps)
    return loader, tokenizer


def _check_before_build(cfg: JobConfig, ckpt_folder: Path, rank: int) -> None:
    """Packages, writable folders, no overwritten metrics; leftover ``.tmp`` saves go."""
    problems = preflight.missing_packages(cfg)
    if rank == 0:
        problems += [p for p in (
            preflight.unwritable(Path(cfg.metrics.output_dir), "metrics.output_dir",
                                 ".write-probe"),
            preflight.overwrites_metrics(cfg)) if p]
    if cfg.checkpoint.enable:  # every rank writes its own shards there
        problem = preflight.unwritable(ckpt_folder, "checkpoint.folder",
                                       f".write-probe-rank{rank}")
        problems += [problem] if problem else []
    preflight.agree(problems)
    if cfg.checkpoint.enable and rank == 0:
        for path in remove_partial(ckpt_folder):
            print(f"[simplefsdp] removed {path}, left by a save that did not finish",
                  flush=True)


def _space_problem(params: list[nn.Parameter], folder: Path, rank: int) -> str | None:
    """Free space vs one checkpoint: parameters plus AdamW's two states, all ranks."""
    local = sharded_param_bytes(params) + optimizer_state_bytes(OPTIMIZER, params)
    total = torch.tensor(float(local), dtype=torch.float64)
    dist.all_reduce(total)
    return preflight.too_little_space(folder, float(total)) if rank == 0 else None


def _train(cfg: JobConfig, batch_transform: BatchTransform | None,
           tokenizer: Tokenizer | None) -> TrainResult:
    started = time.perf_counter()
    if cfg.compile.enable:
        quiet_our_checkpoint_warning()
    s = setup(cfg, tokenizer)
    cfg, metrics, ckpt = s.cfg, s.metrics, s.ckpt
    t = cfg.training
    rank0 = dist.get_rank() == 0
    result = TrainResult(start_step=s.start_step, steps=t.steps, num_params=s.n_params,
                         output_dir=str(cfg.metrics.output_dir))
    pending: list[tuple[torch.Tensor, torch.Tensor, float]] = []  # since the last flush
    window_start, window_steps = time.perf_counter(), 0
    saved: Path | None = None  # the newest checkpoint written
    compiling = _CompileReports() if cfg.compile.enable else None
    if compiling is not None and rank0:
        print(f"[simplefsdp] step {s.start_step + 1} compiles the model (torch.compile, "
              f"{cfg.compile.backend}, bucketing {cfg.compile.bucketing}): expect it to "
              f"take a while (a minute or more on CPU); later steps reuse the compiled "
              f"graphs", flush=True)
    metrics.start_progress()

    with StopOnSignal() as signal_:
        try:
            for step in range(s.start_step + 1, t.steps + 1):
                batches = [next(s.loader) for _ in range(t.grad_accum_steps)]
                if batch_transform is not None:
                    batches = [batch_transform(inputs, targets) for inputs, targets in batches]
                step_started = time.perf_counter()
                if compiling is not None:
                    with compiling:
                        contribution, grad_norm, stop = train_step(s, step, batches,
                                                                   signal_.requested)
                    metrics.note(_compile_summary(compiling.reports, cfg,
                                                  time.perf_counter() - step_started, step))
                    compiling = None
                else:
                    contribution, grad_norm, stop = train_step(s, step, batches,
                                                               signal_.requested)
                pending.append((contribution, grad_norm, s.scheduler.get_last_lr()[0]))
                window_steps += 1
                metrics.advance()

                is_last = step == t.steps or stop
                logs = step % cfg.metrics.log_every == 0 or is_last
                if logs or (ckpt and ckpt.due(step)):
                    # One all-reduce for every step since the last flush.
                    stacked = torch.stack([c for c, _, _ in pending])
                    dist.all_reduce(stacked)
                    result.losses.extend(stacked.tolist())
                    result.grad_norms.extend(float(g) for _, g, _ in pending)
                    if logs:  # the row's loss: the mean since the previous row
                        if s.device.type == "cuda":
                            torch.cuda.synchronize()
                        elapsed = time.perf_counter() - window_start
                        window = result.losses[-window_steps:]
                        metrics.log(step, sum(window) / len(window), result.grad_norms[-1],
                                    pending[-1][2], window_steps, elapsed)
                        window_start, window_steps = time.perf_counter(), 0
                    pending.clear()
                if ckpt is not None and (ckpt.due(step) or is_last):
                    saved = ckpt.save(step)
                if stop:
                    raise _preempted(s, step, signal_.signum)
        finally:
            metrics.close()

    outputs = [metrics.csv_path, *metrics.written]
    if cfg.checkpoint.export_safetensors:
        path = Path(cfg.metrics.output_dir) / "model.safetensors"
        export_safetensors(s.model, path, s.pp_group)
        outputs.append(path)
    exported = hf_hooks.export(cfg, s.model, s.tokenizer)
    result.metrics = metrics.summary()
    result.wall_time_s = time.perf_counter() - started
    if rank0 and result.losses:
        if metrics.tensorboard_dir is not None:
            outputs.append(metrics.tensorboard_dir)
        if saved is not None:
            outputs.append(saved)
        if exported is not None:
            outputs.append(exported)
        print(_done_line(s.start_step, t.steps, result, outputs), flush=True)
    return result


def _done_line(start_step: int, steps: int, result: TrainResult, outputs: list) -> str:
    """The end-of-run lines: the loss as ``metrics.csv``'s last row and the progress bar
    show it (the mean over the last logging window), the last step's own loss, where
    every output went."""
    rows = result.metrics.get("rows") or []
    last = rows[-1] if rows and int(rows[-1]["step"]) == steps else None
    tps = f"{last['tokens_per_s']:.0f} tokens/s" if last else "no metrics row"
    if last is not None:
        first = int(rows[-2]["step"]) + 1 if len(rows) > 1 else start_step + 1
        first = max(first, start_step + 1)
        span = f"step {steps}" if first == steps else f"steps {first}-{steps}"
        loss = (f"loss {last['loss']:.4f} (mean of {span}, as in metrics.csv and the "
                f"progress bar; step {steps} alone: {result.losses[-1]:.4f})")
    else:
        loss = f"loss {result.losses[-1]:.4f} (step {steps})"
    where = ", ".join(str(p) for p in outputs)
    return (f"[simplefsdp] done: steps {start_step}->{steps} in {result.wall_time_s:.1f} s, "
            f"{loss}, {tps}\n[simplefsdp] outputs: {where}")


class _CompileReports(logging.Handler):
    """The reports our compile backend logs for each graph it compiles (one object per
    graph, at INFO on the ``simplefsdp.compiler`` logger; see ``compiler/backend.py``),
    collected while the first step compiles. Where that logger is not already shown at
    INFO, the records go to this handler alone: nobody sees them twice."""

    LOGGER = "simplefsdp.compiler"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reports: list[Any] = []
        self._saved: tuple[int, bool] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        for arg in args:
            if hasattr(arg, "graph") and hasattr(arg, "buckets"):
                self.reports.append(arg)

    def __enter__(self) -> _CompileReports:
        logger = logging.getLogger(self.LOGGER)
        self._saved = (logger.level, logger.propagate)
        if not logger.isEnabledFor(logging.INFO):
            logger.setLevel(logging.INFO)
            logger.propagate = False
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._saved[0])
        logger.propagate = self._saved[1]


def _compile_summary(reports: list, cfg: JobConfig, seconds: float, step: int) -> str:
    """One line on what the first step's compile did: per graph, its collectives and
    buckets; for planned bucketing (auto, greedy) the predicted exposed communication and
    whether the plan came from the plan cache."""
    head = f"[simplefsdp] step {step} compiled and ran in {seconds:.1f} s"
    planned = cfg.compile.bucketing in ("auto", "greedy")
    if not reports:
        warm = "; its plans came from the plan cache" if planned else ""
        return (f"{head}; our passes did not run: Inductor's cache held these graphs (a "
                f"warm compile{warm})")
    parts = []
    for r in reports:
        before = sum(getattr(r, "collectives_before", {}).values())
        n = len(r.buckets)
        part = f"{r.graph} {before} collectives -> {n} bucket{'' if n == 1 else 's'}"
        exposed = getattr(r, "estimated_exposed_s", None)
        if exposed is not None:
            part += f", predicted exposed communication {exposed * 1e3:.2f} ms"
        if planned:
            cached = any("plan cache" in note for note in getattr(r, "notes", ()))
            part += (", plan from the plan cache (hit)" if cached else
                     ", plan decided now and cached for the next run (miss)")
        parts.append(part)
    return (f"{head} (bucketing {cfg.compile.bucketing}): " + "; ".join(parts) +
            " (details: the simplefsdp.compiler logger at INFO)")


def _preempted(s: Setup, step: int, signum: int | None) -> Preempted:
    """The error a signalled run stops with: where it saved, how to continue."""
    import signal

    name = signal.Signals(signum).name if signum else "a signal on another rank"
    where = (f"saved checkpoint step-{step} in {s.ckpt.folder}; repeat the command with "
             f"--resume to continue" if s.ckpt is not None else
             "checkpoints are off (checkpoint.enable = false), so nothing was saved")
    return Preempted(f"stopped by {name} after step {step}: {where}",
                     signum or signal.SIGTERM)


def _count_params(model: nn.Module, mesh, at: _Coords) -> int:
    """Parameters of the whole model (summed over pipeline stages)."""
    n = torch.tensor(float(num_params(model)))
    if at.pp_size > 1:
        dist.all_reduce(n, group=mesh["pp"].get_group())
    return int(n.item())


def main(argv: list[str] | None = None,
         batch_transform: BatchTransform | None = None,
         tokenizer: Tokenizer | None = None) -> TrainResult | None:
    """``python -m simplefsdp.train [--config FILE] [--section.key value ...]``; with
    ``--check [--world-size N]``, validate the config for N processes and return None."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(config_help())
        return None
    check, world_size, argv = _check_flags(argv)
    if check:
        check_config(argv, world_size)
        return None
    return train(parse_args(argv, _launched_world()), batch_transform, tokenizer)


def _launched_world() -> int:
    """The number of processes this run has: the process group's, torchrun's, or 1."""
    if dist.is_initialized():
        return dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


def _check_flags(argv: list[str]) -> tuple[bool, int, list[str]]:
    """``--check`` and ``--world-size N`` taken out of ``argv``."""
    check, world, rest, i = False, None, [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name == "--check":
            check = True
        elif name == "--world-size":
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError("--world-size needs a number of processes")
                value, i = argv[i + 1], i + 1
            try:
                world = int(value)
            except ValueError:
                raise ConfigError(f"--world-size {value!r}: expected a number of "
                                  f"processes") from None
            if world < 1:
                raise ConfigError(f"--world-size {world}: expected at least 1 process")
        else:
            rest.append(argv[i])
        i += 1
    if world is not None and not check:
        raise ConfigError("--world-size goes with --check; a run's world size is its "
                          "number of processes (torchrun --nproc_per_node)")
    return check, world if world is not None else _launched_world(), rest


def check_config(argv: list[str], world_size: int) -> JobConfig:
    """``--check``: read and validate the config for ``world_size`` processes without
    launching anything: keys, types, ranges, the parallel sizes against the world, the
    model's shapes, the packages it needs, and an earlier run's metrics or checkpoints
    in the output folders. Prints one line and returns the config (sizes resolved);
    raises a ConfigError naming the first problem found."""
    cfg = parse_args(argv, world_size)
    p = cfg.parallel.resolve(world_size)
    cfg = dataclasses.replace(cfg, parallel=p)
    problems = preflight.missing_packages(cfg)
    problems += [q for q in [preflight.overwrites_metrics(cfg)] if q]
    if problems:
        raise ConfigError("; ".join(problems))
    if cfg.checkpoint.enable:
        folder = checkpoint_dir(cfg.checkpoint.folder, cfg.metrics.output_dir)
        resume_point(folder, cfg.checkpoint.resume, _fingerprint(cfg))
    print(f"[simplefsdp] configuration ok for {world_size} process"
          f"{'es' if world_size > 1 else ''}: pp={p.pp} dp_replicate={p.dp_replicate} "
          f"dp_shard={p.dp_shard} tp={p.tp} ({p.dp_mode}), "
          f"ac={cfg.activation_checkpoint.mode}, compile={cfg.compile.enable}, "
          f"steps {cfg.training.steps}, outputs in {cfg.metrics.output_dir}/", flush=True)
    return cfg
