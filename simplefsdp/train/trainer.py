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
import os
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
    model_facts = dataclasses.asdict(args)  # a Hugging Face model: its folder names it
    if cfg.model.hf_path is not None:
        model_facts = {"hf_path": str(Path(cfg.model.hf_path).resolve())}
    fingerprint = config_fingerprint(model_facts)
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
    s = setup(cfg, tokenizer)
    cfg, metrics, ckpt = s.cfg, s.metrics, s.ckpt
    t = cfg.training
    result = TrainResult(start_step=s.start_step, steps=t.steps, num_params=s.n_params,
                         output_dir=str(cfg.metrics.output_dir))
    pending: list[tuple[torch.Tensor, torch.Tensor, float]] = []  # since the last report
    window_start, window_steps = time.perf_counter(), 0

    with StopOnSignal() as signal_:
        try:
            for step in range(s.start_step + 1, t.steps + 1):
                batches = [next(s.loader) for _ in range(t.grad_accum_steps)]
                if batch_transform is not None:
                    batches = [batch_transform(inputs, targets) for inputs, targets in batches]
                contribution, grad_norm, stop = train_step(s, step, batches, signal_.requested)
                pending.append((contribution, grad_norm, s.scheduler.get_last_lr()[0]))
                window_steps += 1
                metrics.advance()

                is_last = step == t.steps or stop
                logs = step % cfg.metrics.log_every == 0 or is_last
                if logs or (ckpt and ckpt.due(step)):
                    # One all-reduce for every step since the last report.
                    stacked = torch.stack([c for c, _, _ in pending])
                    dist.all_reduce(stacked)
                    values = stacked.tolist()
                    result.losses.extend(values)
                    result.grad_norms.extend(float(g) for _, g, _ in pending)
                    if logs:
                        if s.device.type == "cuda":
                            torch.cuda.synchronize()
                        elapsed = time.perf_counter() - window_start
                        metrics.log(step, sum(values) / len(values), result.grad_norms[-1],
                                    pending[-1][2], window_steps, elapsed)
                        window_start, window_steps = time.perf_counter(), 0
                    pending.clear()
                if ckpt is not None and (ckpt.due(step) or is_last):
                    ckpt.save(step)
                if stop:
                    raise _preempted(s, step, signal_.signum)
        finally:
            metrics.close()

    if cfg.checkpoint.export_safetensors:
        export_safetensors(s.model, Path(cfg.metrics.output_dir) / "model.safetensors",
                           s.pp_group)
    hf_hooks.export(cfg, s.model, s.tokenizer)
    result.metrics = metrics.summary()
    result.wall_time_s = time.perf_counter() - started
    if dist.get_rank() == 0 and result.losses:
        rows = result.metrics["rows"]
        tps = rows[-1]["tokens_per_s"] if rows else float("nan")
        print(f"[simplefsdp] done: steps {s.start_step}->{t.steps}, final loss "
              f"{result.losses[-1]:.4f}, {tps:.0f} tokens/s, "
              f"{result.wall_time_s:.1f}s", flush=True)
    return result


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
    """``python -m simplefsdp.train [--config FILE] [--section.key value ...]``."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(config_help())
        return None
    return train(parse_args(argv), batch_transform, tokenizer)
