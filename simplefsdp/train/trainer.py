"""The training loop: process group, mesh, model, parallelisms, optimizer, loss, logging.

Entry points: ``python -m simplefsdp.train --config configs/debug.toml [--section.key v]``
(see ``__main__.py``), or ``main(argv)`` / ``train(cfg)`` from Python; both return a
``TrainResult``. If a process group already exists (tests) it is used and left alone.

One optimizer step (token-normalized loss, clipping, the non-finite guard) and the
optimizer with its LR schedule live in ``step.py``; what the run prints (its first and
last lines, the compile notes, torch's warning filter) in ``console.py``; this module
builds what a run needs (``setup``) and runs the loop.

Before step 1 the run checks what would fail late (``preflight.py``: packages, writable
folders, free space, no overwritten metrics; the dataset's size). A step whose loss or
gradient norm is not finite is not applied and stops the run; SIGTERM/SIGINT finish the
step, save and stop (``guard.py``).

The model comes from its family's entry in ``models.registry`` (built, parallelized,
initialized or loaded; its tokenizer, FLOPs, checkpoint facts and exports): our Llama's
is ``llama_family.py``. What a run holds (``Setup``) and returns (``TrainResult``) is
in ``run.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from simplefsdp.mesh import Coords

from ..corpus import build_loader
from ..models.llama import num_params
from ..parallel.context import cp_batches
from . import preflight
from .checkpoint import (
    CheckpointManager,
    TrainerState,
    checkpoint_dir,
    checkpoint_step,
    config_fingerprint,
    export_safetensors,
    resume_point,
)
from .config import PG_TIMEOUT_S, ConfigError, JobConfig, config_help, parse_args
from .console import (
    CompileReports,
    compile_start_note,
    compile_summary,
    done_line,
    preempted,
    quiet_our_checkpoint_warning,
    start_line,
)
from .data import Tokenizer
from .elastic import init_distributed
from .faults import Injector
from .guard import StopOnSignal
from .metrics import MetricsLogger
from .pipeline import build_schedule
from .run import Setup, TrainResult
from .step import build_optimizer, token_loss_sum, train_step
from .tracker import build_tracker
from .validation import COLUMNS as VALIDATION_COLUMNS
from .validation import held_out_batches, validate
from .watchdog import Watchdog, phase

# ---------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------
# The loop.
# ---------------------------------------------------------------------------------------
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
    owns_group = init_distributed(cfg.job.device, PG_TIMEOUT_S)
    try:  # the watchdog from start-up on: a collective timing out anywhere dumps stacks
        with Watchdog(cfg.training.hang_watchdog_s, cfg.metrics.output_dir, dist.get_rank()):
            return _train(cfg, batch_transform, tokenizer)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def setup(cfg: JobConfig, tokenizer: Tokenizer | None) -> Setup:
    """Mesh, data, model, optimizer, checkpoint (resumed if asked), metrics."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device(cfg)
    p = cfg.parallel.resolve(world)
    cfg = dataclasses.replace(cfg, parallel=p)  # dp_shard filled in; the caller's untouched
    t = cfg.training
    dims = p.dims()
    mesh = dims.build_mesh(device.type)
    at = dims.coords(rank)
    torch.manual_seed(t.seed)
    ckpt_folder = checkpoint_dir(cfg.checkpoint.folder, cfg.metrics.output_dir)
    family = cfg.model.family_entry()
    fingerprint = _fingerprint(cfg)
    resume_from = None
    if cfg.checkpoint.enable:  # decided before anything is built: a refusal is cheap
        resume_from = resume_point(ckpt_folder, cfg.checkpoint.resume, fingerprint)
    preflight.before_build(cfg, ckpt_folder, rank)
    if cfg.checkpoint.enable and rank == 0:
        _record_config(cfg, ckpt_folder)
    if resume_from is not None and checkpoint_step(resume_from) >= t.steps:
        raise ConfigError(f"training.steps = {t.steps}, but the checkpoint to resume from "
                          f"({resume_from}) is already at step {checkpoint_step(resume_from)}: "
                          f"nothing to do; raise --training.steps above it to train on")

    phase("start-up: data (tokenizer, token cache)")  # named for a hang's stack dump
    loader, tokenizer = _build_loader(cfg, tokenizer, at)
    held_out = held_out_batches(cfg, tokenizer, at)  # too few held-out windows: refused now
    phase("start-up: building the model (and loading its weights)")
    runnable, model = family.build(cfg, mesh, device)
    if cfg.data.document_mask:  # our Llama (checked): attention stops at each EOS
        model.document_eos = tokenizer.eos_id
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer, scheduler = build_optimizer(model, cfg)
    state = TrainerState(scheduler, loader)

    ckpt = None
    start_step = 0
    if cfg.checkpoint.enable:
        space = preflight.checkpoint_space(params, ckpt_folder, rank)
        preflight.agree([space] if space else [])
        ckpt = CheckpointManager(ckpt_folder, model, optimizer, state,
                                 cfg.checkpoint.every, cfg.checkpoint.keep_latest,
                                 fingerprint, cfg.checkpoint.async_mode)
        if resume_from is not None:
            phase("start-up: resuming from the checkpoint")
            start_step = ckpt.load(resume_from)
            if rank == 0:
                print(f"[simplefsdp] resumed from {resume_from} (step {start_step})",
                      flush=True)

    schedule = None
    if p.pp > 1:  # the loss is a token sum; the loop divides the gradients afterwards
        aux_of = None if family.aux_loss is None else functools.partial(family.aux_loss, model)
        schedule, _ = build_schedule(runnable, mesh["pp"], device, p.pp_microbatches,
                                     token_loss_sum, aux_of)

    tokens_per_step = t.batch_size * t.seq_len * at.dp_size * t.grad_accum_steps
    n_params = _count_params(model, mesh, at)
    columns = family.metric_columns
    columns = columns(cfg, model) if callable(columns) else columns
    metrics = MetricsLogger(cfg.metrics.output_dir, rank=rank, world=world, device=device,
                            flops_per_token=family.flops_per_token(cfg, model, t.seq_len),
                            tokens_per_step=tokens_per_step, total_steps=t.steps,
                            start_step=start_step, tensorboard=cfg.metrics.tensorboard,
                            extra_columns=columns,
                            sparse_columns=VALIDATION_COLUMNS if held_out else (),
                            tracker=build_tracker(cfg, rank))
    s = Setup(cfg, device, mesh, at, loader, tokenizer, runnable, model, params, optimizer,
              scheduler, schedule, ckpt, metrics, start_step, n_params, held_out)
    if rank == 0:
        print(start_line(s, world, tokens_per_step), flush=True)
    return s


def _record_config(cfg: JobConfig, ckpt_folder: Path) -> None:
    """The job config next to the checkpoints (``config.json``): ``simplefsdp.generate``
    rebuilds the run's model and tokenizer from it."""
    import json

    ckpt_folder.mkdir(parents=True, exist_ok=True)
    (ckpt_folder / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))


def _fingerprint(cfg: JobConfig) -> str:
    """The model config a checkpoint was written for (a Hugging Face model: its folder)."""
    return config_fingerprint(cfg.model.family_entry().fingerprint(cfg))


def _build_loader(cfg: JobConfig, tokenizer: Tokenizer | None, at: Coords):
    """This data-parallel rank's training batches and the tokenizer; refuses a corpus
    smaller than one global batch and a tokenizer that does not fit the model."""
    t, family = cfg.training, cfg.model.family_entry()
    if tokenizer is None:
        tokenizer = family.tokenizer(cfg)
    elif not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must have vocab_size and encode(text) (the "
                        f"simplefsdp.train.data.Tokenizer protocol), got "
                        f"{type(tokenizer).__name__}")
    family.check_tokenizer(cfg, tokenizer)
    loader = build_loader(cfg, tokenizer, at.dp, at.dp_size,
                          min_windows=t.batch_size * at.dp_size * t.grad_accum_steps)
    return loader, tokenizer


def _train(cfg: JobConfig, batch_transform: BatchTransform | None,
           tokenizer: Tokenizer | None) -> TrainResult:
    started = time.perf_counter()
    if cfg.compile.enable:
        quiet_our_checkpoint_warning()
    s = setup(cfg, tokenizer)
    cfg, metrics, ckpt = s.cfg, s.metrics, s.ckpt
    t, p = cfg.training, cfg.parallel
    rank0 = dist.get_rank() == 0
    result = TrainResult(start_step=s.start_step, steps=t.steps, num_params=s.n_params,
                         output_dir=str(cfg.metrics.output_dir))
    # (loss contribution, grad norm, lr, family figures) of each step since the last flush
    pending: list[tuple[torch.Tensor, torch.Tensor, float, dict]] = []
    window_start, window_steps = time.perf_counter(), 0
    saved: Path | None = None  # the newest checkpoint written
    compiling = CompileReports() if cfg.compile.enable else None
    if compiling is not None and rank0:
        print(compile_start_note(cfg, s.start_step + 1), flush=True)
    metrics.start_progress()

    faults = Injector(dist.get_rank())  # SIMPLEFSDP_FAULT (restart tests); else inert
    faults.arm(s.model, s.optimizer)
    if ckpt is not None:
        ckpt.on_phase = faults.point
    with StopOnSignal() as signal_:
        try:
            for step in range(s.start_step + 1, t.steps + 1):
                faults.step = step
                # The first step waits out the ranks' start-up skew (and compiles): long,
                # not hung; the group's timeout bounds it.
                phase("next batch", step, PG_TIMEOUT_S if step == s.start_step + 1 else None)
                batches = [next(s.loader) for _ in range(t.grad_accum_steps)]
                if batch_transform is not None:
                    batches = [batch_transform(inputs, targets) for inputs, targets in batches]
                if p.dims().cp > 1:  # this rank's part of every sequence (its context ranks')
                    batches = cp_batches(batches, s.mesh, t.seq_len)
                step_started = time.perf_counter()
                lr = s.scheduler.get_last_lr()[0]  # this step's; train_step advances it
                if compiling is not None:
                    with compiling:
                        contribution, grad_norm, stop, stats = train_step(
                            s, step, batches, signal_.requested)
                    metrics.note(compile_summary(compiling.reports, cfg,
                                                  time.perf_counter() - step_started, step))
                    compiling = None
                else:
                    contribution, grad_norm, stop, stats = train_step(s, step, batches,
                                                                      signal_.requested)
                phase("validation (held-out forward, loss all-reduce)")
                evaluating = time.perf_counter()
                held_out = validate(s, step)  # {} unless this step evaluates
                window_start += time.perf_counter() - evaluating  # tokens/s: training's
                result.val_losses.update({step: held_out["val_loss"]} if held_out else {})
                pending.append((contribution, grad_norm, lr, {**stats, **held_out}))
                window_steps += 1
                metrics.advance()

                is_last = step == t.steps or stop
                logs = step % cfg.metrics.log_every == 0 or is_last or bool(held_out)
                if logs or (ckpt and ckpt.due(step)):
                    # One all-reduce for every step since the last flush.
                    phase("metrics all-reduce")
                    stacked = torch.stack([c for c, *_ in pending])
                    dist.all_reduce(stacked)
                    result.losses.extend(stacked.tolist())
                    result.grad_norms.extend(float(g) for _, g, *_ in pending)
                    if logs:  # the row's loss: the mean since the previous row
                        if s.device.type == "cuda":
                            torch.cuda.synchronize()
                        elapsed = time.perf_counter() - window_start
                        window = result.losses[-window_steps:]
                        metrics.log(step, sum(window) / len(window), result.grad_norms[-1],
                                    pending[-1][2], window_steps, elapsed, pending[-1][3])
                        window_start, window_steps = time.perf_counter(), 0
                    pending.clear()
                if ckpt is not None:  # a save's length is the group timeout's business
                    phase("checkpoint (save, or the all-reduce asking if one is written)",
                          limit_s=PG_TIMEOUT_S)
                    if ckpt.due(step) or is_last:
                        saved = ckpt.save(step, wait=is_last) or saved
                    else:
                        saved = ckpt.poll() or saved
                if stop:
                    raise preempted(s, step, signal_.signum)
        finally:
            metrics.close()

    outputs = [metrics.csv_path, *metrics.written]
    if cfg.checkpoint.export_safetensors:
        path = Path(cfg.metrics.output_dir) / "model.safetensors"
        export_safetensors(s.model, path, s.pp_group)
        outputs.append(path)
    exported = cfg.model.family_entry().export(cfg, s.model, s.tokenizer)
    result.metrics = metrics.summary()
    result.wall_time_s = time.perf_counter() - started
    if rank0 and result.losses:
        if metrics.tensorboard_dir is not None:
            outputs.append(metrics.tensorboard_dir)
        if saved is not None:
            outputs.append(saved)
        if exported is not None:
            outputs.append(exported)
        print(done_line(s.start_step, t.steps, result, outputs), flush=True)
    return result


def _count_params(model: nn.Module, mesh, at: Coords) -> int:
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
          f"dp_shard={p.dp_shard} tp={p.tp} {f'ep={p.ep} ' if p.ep > 1 else ''}"
          f"({p.dp_mode}), "
          f"ac={cfg.activation_checkpoint.mode}, compile={cfg.compile.enable}, "
          f"steps {cfg.training.steps}, outputs in {cfg.metrics.output_dir}/", flush=True)
    return cfg
