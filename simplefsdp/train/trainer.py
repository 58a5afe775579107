"""The training loop: process group, mesh, model, parallelisms, optimizer, loss, logging.

Entry points: ``python -m simplefsdp.train --config configs/debug.toml [--section.key v]``
(the command line is ``__main__.py``: ``main(argv)``), or ``train(cfg)`` from Python;
both return a ``TrainResult``. If a process group already exists (tests) it is used and
left alone.

One optimizer step (token-normalized loss, clipping, the non-finite guard) and the
optimizer with its LR schedule live in ``step.py``; what the run prints (its first and
last lines, the compile notes, torch's warning filter) in ``console.py``; this module
builds what a run needs (``setup``, in named phases) and runs the loop (``_train``: one
step, the metrics window, the checkpoint, the exports).

Before step 1 the run checks what would fail late (``preflight.py``: packages, writable
folders, free space, no overwritten metrics; the dataset's size). A step whose loss or
gradient norm is not finite is not applied and stops the run; SIGTERM/SIGINT finish the
step, save and stop (``guard.py``).

The model comes from its family's entry in ``models.registry`` (built, parallelized,
initialized or loaded; its tokenizer, FLOPs, checkpoint facts and exports): our Llama's
is ``models/llama_family.py``. What a run holds (``Setup``) and returns (``TrainResult``) is
in ``run.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..config.job import PG_TIMEOUT_S, JobConfig
from ..config.lora import lora_targets
from ..corpus import build_loader
from ..corpus.text import Tokenizer
from ..errors import ConfigError
from ..mesh import Coords
from ..models.llama import num_params
from ..models.lora import ADAPTER_FOLDER, init_adapters, save_adapter, trainable_summary
from ..offload import place_shards_on_host
from ..optim import build_optimizer
from ..parallel.activation_checkpoint import quiet_our_checkpoint_warning
from ..parallel.context import cp_batches
from ..parallel.pipeline import build_schedule
from ..parallel.tensor import token_loss_sum
from . import preflight
from .checkpoint import (
    RECORDED_CONFIG,
    CheckpointManager,
    TrainerState,
    checkpoint_dir,
    checkpoint_step,
    config_fingerprint,
    export_safetensors,
    resume_point,
)
from .console import (
    CompileReports,
    compile_start_note,
    compile_summary,
    done_line,
    preempted,
    start_line,
)
from .elastic import init_distributed, shutdown_distributed
from .faults import Injector
from .guard import StopOnSignal
from .layout import resolve_layout
from .metrics import MetricsLogger
from .profiling import StepProfiler
from .run import Setup, TrainResult
from .step import train_step
from .tracker import build_tracker
from .validation import COLUMNS as VALIDATION_COLUMNS
from .validation import held_out_batches, validate
from .watchdog import Watchdog, phase


# ---------------------------------------------------------------------------------------
# Setup: what a run needs, built in named phases.
# ---------------------------------------------------------------------------------------
def _device(cfg: JobConfig) -> torch.device:
    if cfg.job.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


BatchTransform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def train(cfg: JobConfig, batch_transform: BatchTransform | None = None,
          tokenizer: Tokenizer | None = None,
          explicit_keys: set[str] | None = None) -> TrainResult:
    """Run the job described by ``cfg``. ``batch_transform(inputs, targets)`` may rewrite
    each microbatch, e.g. set targets to ``IGNORE_INDEX`` to leave tokens out.
    ``tokenizer`` (any object with ``vocab_size`` and ``encode(text)``) replaces the one
    ``data.tokenizer`` names; its ``vocab_size`` must fit ``model.vocab_size``.
    ``explicit_keys``: the ``section.key`` names the user set, which
    ``parallel.layout = "auto"`` keeps (None: those differing from the defaults)."""
    owns_group = init_distributed(cfg.job.device, PG_TIMEOUT_S)
    try:  # the watchdog from start-up on: a collective timing out anywhere dumps stacks
        with Watchdog(cfg.training.hang_watchdog_s, cfg.metrics.output_dir, dist.get_rank()):
            cfg = resolve_layout(cfg, explicit_keys)  # "auto": the planner's choice
            return _train(cfg, batch_transform, tokenizer)
    finally:
        if owns_group and dist.is_initialized():
            shutdown_distributed()  # the backends' threads joined before returning


def resolved(cfg: JobConfig, world: int) -> JobConfig:
    """``cfg`` with its parallel sizes resolved for ``world`` processes (``dp_shard = -1``
    filled in); the caller's config is left untouched."""
    return dataclasses.replace(cfg, parallel=cfg.parallel.resolve(world))


def setup(cfg: JobConfig, tokenizer: Tokenizer | None) -> Setup:
    """Mesh, data, model, optimizer, checkpoint (resumed if asked), metrics."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(cfg)
    cfg = resolved(cfg, world)
    dims = cfg.parallel.dims()  # the run's one view of its layout (Setup.dims)
    mesh = dims.build_mesh(device.type)
    at = dims.coords(rank)
    torch.manual_seed(cfg.training.seed)
    ckpt_folder = checkpoint_dir(cfg.checkpoint.folder, cfg.metrics.output_dir)
    family = cfg.model.family_entry()
    resume_from = _refuse_early(cfg, ckpt_folder, rank)

    phase("start-up: data (tokenizer, token cache)")  # named for a hang's stack dump
    loader, tokenizer = _build_loader(cfg, tokenizer, at)
    held_out = held_out_batches(cfg, tokenizer, at)  # too few held-out windows: refused now
    phase("start-up: building the model (and loading its weights)")
    runnable, model = family.build(cfg, mesh, dims, device)
    if cfg.data.document_mask:  # our Llama (checked): attention stops at each EOS
        model.document_eos = tokenizer.eos_id
    if cfg.lora.enable:  # the adapters' start, from the seed (a resume overwrites it)
        init_adapters(model, cfg.training.seed)
        if rank == 0:
            print(trainable_summary(model), flush=True)
    if cfg.training.cpu_offload:  # built and initialized on the device: shards to the host
        place_shards_on_host(model)  # before the optimizer, which must hold them
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer, scheduler = build_optimizer(model, cfg)
    ckpt, start_step = _checkpointing(cfg, ckpt_folder, resume_from, model, optimizer,
                                      TrainerState(scheduler, loader), params, rank)
    schedule = _pipeline_schedule(cfg, family, runnable, model, mesh, device)
    metrics, tokens_per_step = _metrics(cfg, family, model, device, at, rank, world,
                                        start_step, held_out is not None)
    s = Setup(cfg=cfg, device=device, mesh=mesh, at=at, loader=loader, tokenizer=tokenizer,
              runnable=runnable, model=model, params=params, optimizer=optimizer,
              lr_scheduler=scheduler, pipeline_schedule=schedule, ckpt=ckpt, metrics=metrics,
              start_step=start_step, n_params=_count_params(model, mesh, at), dims=dims,
              family=family, validation=held_out)
    if rank == 0:
        print(start_line(s, world, tokens_per_step), flush=True)
    return s


def _refuse_early(cfg: JobConfig, ckpt_folder: Path, rank: int) -> Path | None:
    """The checkpoint to resume from (None: start afresh), and the checks that cost
    nothing, before anything is built: a refusal here is cheap."""
    resume_from = None
    if cfg.checkpoint.enable:
        resume_from = resume_point(ckpt_folder, cfg.checkpoint.resume, fingerprint(cfg))
    preflight.before_build(cfg, ckpt_folder, rank)
    if cfg.checkpoint.enable and rank == 0:
        _record_config(cfg, ckpt_folder)
    steps = cfg.training.steps
    if resume_from is not None and checkpoint_step(resume_from) >= steps:
        raise ConfigError(f"training.steps = {steps}, but the checkpoint to resume from "
                          f"({resume_from}) is already at step {checkpoint_step(resume_from)}: "
                          f"nothing to do; raise --training.steps above it to train on")
    return resume_from


def _record_config(cfg: JobConfig, ckpt_folder: Path) -> None:
    """The job config next to the checkpoints (``config.json``): ``simplefsdp.generate``
    rebuilds the run's model and tokenizer from it."""
    import json

    ckpt_folder.mkdir(parents=True, exist_ok=True)
    (ckpt_folder / RECORDED_CONFIG).write_text(json.dumps(cfg.to_dict(), indent=1))


def _checkpointing(cfg: JobConfig, folder: Path, resume_from: Path | None, model: nn.Module,
                   optimizer, state: TrainerState, params: list, rank: int
                   ) -> tuple[CheckpointManager | None, int]:
    """(the checkpoint manager or None, the step to start after): checks the free space,
    then loads ``resume_from`` when given."""
    if not cfg.checkpoint.enable:
        return None, 0
    # the checkpoint holds every parameter (frozen ones too), optimizer state for ``params``
    space = preflight.checkpoint_space(list(model.parameters()), folder, rank, params)
    preflight.agree([space] if space else [])
    c = cfg.checkpoint
    ckpt = CheckpointManager(folder, model, optimizer, state, c.every, c.keep_latest,
                             fingerprint(cfg), c.async_mode)
    if resume_from is None:
        return ckpt, 0
    phase("start-up: resuming from the checkpoint")
    start_step = ckpt.load(resume_from)
    if rank == 0:
        print(f"[simplefsdp] resumed from {resume_from} (step {start_step})", flush=True)
    return ckpt, start_step


def _pipeline_schedule(cfg: JobConfig, family, runnable: nn.Module, model: nn.Module, mesh,
                       device: torch.device):
    """The pipeline schedule under PP (its loss a token sum: the loop divides the
    gradients afterwards); None without."""
    p = cfg.parallel
    if p.pp == 1:
        return None
    aux_of = None if family.aux_loss is None else functools.partial(family.aux_loss, model)
    schedule, _ = build_schedule(runnable, mesh["pp"], device, p.pp_microbatches,
                                 token_loss_sum, aux_of)
    return schedule


def _metrics(cfg: JobConfig, family, model: nn.Module, device: torch.device, at: Coords,
             rank: int, world: int, start_step: int, validating: bool
             ) -> tuple[MetricsLogger, int]:
    """(the metrics logger, tokens per optimizer step over all ranks); ``validating``:
    the rows have validation's columns."""
    t = cfg.training
    tokens_per_step = t.batch_size * t.seq_len * at.dp_size * t.grad_accum_steps
    columns = family.metric_columns
    columns = columns(cfg, model) if callable(columns) else columns
    metrics = MetricsLogger(cfg.metrics.output_dir, rank=rank, world=world, device=device,
                            flops_per_token=family.flops_per_token(cfg, model, t.seq_len),
                            tokens_per_step=tokens_per_step, total_steps=t.steps,
                            start_step=start_step, tensorboard=cfg.metrics.tensorboard,
                            extra_columns=columns,
                            sparse_columns=VALIDATION_COLUMNS if validating else (),
                            tracker=build_tracker(cfg, rank))
    return metrics, tokens_per_step


def fingerprint(cfg: JobConfig) -> str:
    """The model config a checkpoint was written for (a Hugging Face model: its folder;
    with ``[lora]``, its adapters' shape too)."""
    facts = cfg.model.family_entry().fingerprint(cfg)
    if cfg.lora.enable:
        lo = cfg.lora
        facts = {**facts, "lora": {"rank": lo.rank, "alpha": lo.alpha,
                                   "target_modules": lora_targets(cfg)}}
    return config_fingerprint(facts)


def _build_loader(cfg: JobConfig, tokenizer: Tokenizer | None, at: Coords):
    """This data-parallel rank's training batches and the tokenizer; refuses a corpus
    smaller than one global batch and a tokenizer that does not fit the model."""
    t, family = cfg.training, cfg.model.family_entry()
    if tokenizer is None:
        tokenizer = family.tokenizer(cfg)
    elif not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must have vocab_size and encode(text) (the "
                        f"simplefsdp.corpus.text.Tokenizer protocol), got "
                        f"{type(tokenizer).__name__}")
    family.check_tokenizer(cfg, tokenizer)
    loader = build_loader(cfg, tokenizer, at.dp, at.dp_size,
                          min_windows=t.batch_size * at.dp_size * t.grad_accum_steps)
    return loader, tokenizer


def _count_params(model: nn.Module, mesh, at: Coords) -> int:
    """Parameters of the whole model (summed over pipeline stages)."""
    n = torch.tensor(float(num_params(model)))
    if at.pp_size > 1:
        dist.all_reduce(n, group=mesh["pp"].get_group())
    return int(n.item())


# ---------------------------------------------------------------------------------------
# The loop.
# ---------------------------------------------------------------------------------------
@dataclass
class _Window:
    """The steps since the last metrics row: each one's (loss contribution, grad norm,
    lr, family figures), kept on the device until one all-reduce flushes them."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    pending: list[tuple[torch.Tensor, torch.Tensor, float, dict]] = field(
        default_factory=list)

    def flush(self, s: Setup, step: int, logs: bool, result: TrainResult) -> None:
        """One all-reduce for every step since the last flush; a metrics row (the mean
        loss since the previous row) when ``logs``."""
        phase("metrics all-reduce")
        stacked = torch.stack([c for c, *_ in self.pending])
        dist.all_reduce(stacked)
        result.losses.extend(stacked.tolist())
        result.grad_norms.extend(float(g) for _, g, *_ in self.pending)
        if logs:
            if s.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - self.start
            window = result.losses[-self.steps:]
            s.metrics.log(step, sum(window) / len(window), result.grad_norms[-1],
                          self.pending[-1][2], self.steps, elapsed, self.pending[-1][3])
            self.start, self.steps = time.perf_counter(), 0
        self.pending.clear()


def _next_batches(s: Setup, step: int, batch_transform: BatchTransform | None) -> list:
    """This step's microbatches: transformed if asked, cut to this rank's part of each
    sequence under context parallelism."""
    # The first step waits out the ranks' start-up skew (and compiles): long, not hung;
    # the group's timeout bounds it.
    phase("next batch", step, PG_TIMEOUT_S if step == s.start_step + 1 else None)
    t = s.cfg.training
    batches = [next(s.loader) for _ in range(t.grad_accum_steps)]
    if batch_transform is not None:
        batches = [batch_transform(inputs, targets) for inputs, targets in batches]
    if s.dims.cp > 1:  # this rank's part of every sequence (its context ranks')
        batches = cp_batches(batches, s.mesh, t.seq_len)
    return batches


def _step(s: Setup, step: int, batches: list, compiling: CompileReports | None,
          stop_requested: bool):
    """``train_step``; the first step under compile collects the compiler's reports
    and notes their summary. (contribution, grad norm, stop, family figures)."""
    if compiling is None:
        return train_step(s, step, batches, stop_requested)
    started = time.perf_counter()
    with compiling:
        out = train_step(s, step, batches, stop_requested)
    s.metrics.note(compile_summary(compiling.reports, s.cfg, time.perf_counter() - started,
                                   step))
    return out


def _validate(s: Setup, step: int, window: _Window, result: TrainResult
              ) -> dict[str, float]:
    """Validation's figures when this step evaluates (``validation.every``), else {};
    its time is left out of the window's throughput."""
    phase("validation (held-out forward, loss all-reduce)")
    started = time.perf_counter()
    held_out = validate(s, step)
    if held_out:
        result.val_losses[step] = held_out["val_loss"]
        window.start += time.perf_counter() - started
    return held_out


def _checkpoint(s: Setup, step: int, is_last: bool, saved: Path | None) -> Path | None:
    """Save when due (and at the end), else poll an asynchronous save; the newest
    checkpoint written."""
    # a save's length is the group timeout's business
    phase("checkpoint (save, or the all-reduce asking if one is written)",
          limit_s=PG_TIMEOUT_S)
    if s.ckpt.due(step) or is_last:
        return s.ckpt.save(step, wait=is_last) or saved
    return s.ckpt.poll() or saved


def _train(cfg: JobConfig, batch_transform: BatchTransform | None,
           tokenizer: Tokenizer | None) -> TrainResult:
    started = time.perf_counter()
    if cfg.compile.enable:
        quiet_our_checkpoint_warning()
    s = setup(cfg, tokenizer)
    cfg, ckpt = s.cfg, s.ckpt
    result = TrainResult(start_step=s.start_step, steps=cfg.training.steps,
                         num_params=s.n_params, output_dir=str(cfg.metrics.output_dir))
    window, saved = _Window(), None  # saved: the newest checkpoint written
    compiling = CompileReports() if cfg.compile.enable else None
    if compiling is not None and dist.get_rank() == 0:
        print(compile_start_note(cfg, s.start_step + 1), flush=True)
    s.metrics.start_progress()
    faults = Injector(dist.get_rank())  # SIMPLEFSDP_FAULT (restart tests); else inert
    faults.arm(s.model, s.optimizer)
    if ckpt is not None:
        ckpt.on_phase = faults.point
    profiler = StepProfiler(cfg, dist.get_rank(), dist.get_world_size(), s.device)
    with StopOnSignal() as signal_:
        try:
            for step in range(s.start_step + 1, cfg.training.steps + 1):
                faults.step = step
                profiler.before(step)
                batches = _next_batches(s, step, batch_transform)
                lr = s.lr_scheduler.get_last_lr()[0]  # this step's; train_step advances it
                contribution, grad_norm, stop, stats = _step(s, step, batches, compiling,
                                                             signal_.requested)
                compiling = None
                profiler.after(step)
                held_out = _validate(s, step, window, result)
                window.pending.append((contribution, grad_norm, lr, {**stats, **held_out}))
                window.steps += 1
                s.metrics.advance()
                is_last = step == cfg.training.steps or stop
                logs = step % cfg.metrics.log_every == 0 or is_last or bool(held_out)
                if logs or (ckpt and ckpt.due(step)):
                    window.flush(s, step, logs, result)
                if ckpt is not None:
                    saved = _checkpoint(s, step, is_last, saved)
                if stop:
                    raise preempted(s, step, signal_.signum)
        finally:
            profiler.close()
            s.metrics.close()
    result.profile_files = [str(p) for p in profiler.written]
    _finish(s, result, saved, started)
    if dist.get_rank() == 0 and profiler.summary():
        print(profiler.summary(), flush=True)
    return result


def _finish(s: Setup, result: TrainResult, saved: Path | None, started: float) -> None:
    """The exports the config asks for, the run's figures and its last line."""
    cfg, metrics = s.cfg, s.metrics
    outputs = [metrics.csv_path, *metrics.written]
    if cfg.checkpoint.export_safetensors:
        path = Path(cfg.metrics.output_dir) / "model.safetensors"
        export_safetensors(s.model, path, s.pp_group)
        outputs.append(path)
    if cfg.lora.enable:  # the adapters as a peft folder
        outputs.append(save_adapter(s.model, Path(cfg.metrics.output_dir) / ADAPTER_FOLDER,
                                    cfg.model.hf_path))
    exported = s.family.export(cfg, s.model, s.tokenizer)
    result.metrics = metrics.summary()
    result.wall_time_s = time.perf_counter() - started
    if dist.get_rank() == 0 and result.losses:
        if metrics.tensorboard_dir is not None:
            outputs.append(metrics.tensorboard_dir)
        if saved is not None:
            outputs.append(saved)
        if exported is not None:
            outputs.append(exported)
        print(done_line(s.start_step, cfg.training.steps, result, outputs), flush=True)
