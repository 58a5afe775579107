"""The measurement loop, run on every rank of an initialized process group.

1. Every variant is built once from the same initial weights (see ``variants.py``).
2. Steps run interleaved: step ``i`` of every variant, then step ``i + 1``, with the
   variant order rotated each step, so machine-load drift hits all variants alike.
   Each variant gets the same per-rank batches in the same order.
3. The first step of each variant compiles (its time minus the median is the compile
   time); the second lets lazy set-up settle (DDP rebuilds its buckets then); the last
   warm-up step runs under the profiler (collectives, memory); the
   ``steps`` after it are timed (``perf_counter`` between a barrier and the loss's
   ``.item()``; the slowest rank's time counts).

A variant that raises (while building or in any step) is dropped on *all* ranks: after
each build and each step the ranks agree, over a separate gloo group, whether any of
them failed. A rank that fails before a collective its peers are inside leaves them
waiting until the process group's timeout, which then fails them too: slow, never hung.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

import simplefsdp as sf

from .._torch_compat import disable_compile_caches, dynamo_counters, raise_recompile_limits
from ..calibrate import calibration_used
from ..corpus.text import TextDataset
from ..models.llama import num_params
from . import measure
from .config import BenchConfig
from .variants import (
    VARIANTS,
    BuildContext,
    Built,
    VariantSpec,
    VariantUnavailable,
    model_class,
)


class Control:
    """Barriers and agreement between ranks, on their own gloo group (so they never
    interleave with the model's collectives); trivial for a single (fake) process."""

    def __init__(self, fake: bool, timeout_s: float):
        import datetime

        self.fake = fake
        self.group = None if fake else dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def barrier(self) -> None:
        if not self.fake:
            dist.barrier(group=self.group)

    def any(self, flag: bool) -> bool:
        if self.fake:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def gather(self, obj: object) -> list:
        if self.fake:
            return [obj]
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj, group=self.group)
        return out


@dataclass
class _Live:
    """One variant while it runs on this rank."""

    spec: VariantSpec
    built: Built
    optimizer: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)  # every step, warm-up included
    optimizer_times: list[float] = field(default_factory=list)  # their optimizer steps
    losses: list[float] = field(default_factory=list)
    collectives: dict[str, int] = field(default_factory=dict)
    held: int = 0
    transient: int | None = None  # bytes; the least over the profiled warm-up steps
    blocked_s: float = 0.0  # profiled step: time blocked in collectives and their waits
    all_to_all_s: float = 0.0  # of which in all-to-alls (measure.profiled_step)
    late_compiles: int = 0  # graphs Dynamo compiled during measured steps (should be 0)


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    first = text[0] if text else type(e).__name__
    return first[:400]


def _setup_torch(cfg: BenchConfig, local_world: int) -> None:
    import os

    threads = cfg.bench.threads or max(1, (os.cpu_count() or 1) // max(local_world, 1))
    torch.set_num_threads(threads)
    if not cfg.bench.compile_cache:  # a cold compile every run: comparable compile times
        disable_compile_caches()
    # One compiled code object (Transformer.forward, TransformerBlock.forward) per variant
    # and block: stay far from the recompile limit.
    raise_recompile_limits(256)


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """Every variant's AdamW: the fused kernel (one op per step for all parameters).

    The default on CPU is a Python loop of ~10 ops per parameter, and on DTensor
    parameters (ours, FSDP2) each op pays DTensor's dispatch: on the debug model the
    loop costs ~14 ms per step on our replicate parameters against ~2 ms on torch DDP's
    plain ones, the fused step 2.4 ms against 0.65 ms. Every variant gets the same
    kernel, so the comparison stays fair; the README recommends it to users too.
    """
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=True)


def _batches(cfg: BenchConfig, rank: int, world: int, device: torch.device):
    total = cfg.bench.warmup + cfg.bench.steps
    t = cfg.training
    loader = TextDataset().loader("train", t.batch_size, t.seq_len, dp_rank=rank,
                                  dp_world=world, seed=t.seed)
    return [tuple(t.to(device) for t in next(loader)) for _ in range(total)]


def _train_step(live: _Live, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    logits = live.built.model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    started = time.perf_counter()  # the optimizer's host time: exact on CPU
    live.optimizer.step()
    live.optimizer.zero_grad(set_to_none=True)
    live.optimizer_times.append(time.perf_counter() - started)
    return loss.item()  # synchronizes (CUDA) and ends the timed region


def run_benchmark(cfg: BenchConfig, rank: int, world: int, fake: bool,
                  local_world: int = 1) -> dict | None:
    """Build, run and measure every selected variant; rank 0 returns the raw results
    (see ``report.summarize``), the other ranks None."""
    _setup_torch(cfg, local_world)
    device = torch.device(cfg.job.device, torch.cuda.current_device()) if cfg.job.device == "cuda" \
        else torch.device("cpu")
    control = Control(fake, cfg.bench.timeout_s)
    args = cfg.model_args()
    fsdp_mesh = sf.make_mesh(dp_shard=world, device_type=cfg.job.device)["dp_shard"]
    replicate_mesh = sf.make_mesh(dp_replicate=world, dp_shard=1, device_type=cfg.job.device)
    torch.manual_seed(cfg.training.seed)
    reference = model_class(args)(args)
    reference.init_weights()
    ctx = BuildContext(args, {k: v.detach().clone() for k, v in reference.state_dict().items()},
                       fsdp_mesh, replicate_mesh, device, cfg.compile.backend)
    n_params = num_params(reference)
    del reference
    batches = _batches(cfg, rank, world, device)

    failed: dict[str, str] = {}
    live: list[_Live] = []
    for name in cfg.selected_variants():
        spec = VARIANTS[name]
        error = None
        try:
            built = spec.build(ctx)
            optimizer = make_optimizer(built.model, cfg.training.lr)
            if built.before_step is not None:
                optimizer.register_step_pre_hook(lambda *_, f=built.before_step: f())
            if built.after_step is not None:
                optimizer.register_step_post_hook(lambda *_, f=built.after_step: f())
        except Exception as e:  # noqa: BLE001 - recorded, the others go on
            error = _error_text(e)
            expected = isinstance(e, VariantUnavailable | ValueError)  # a refused setting
            if not expected:  # a bug: every rank's traceback
                print(f"[bench rank {rank}] building {name} failed: "
                      f"{traceback.format_exc()}", file=sys.stderr)
            elif rank == 0:  # a refused setting: every rank refuses alike, say it once
                print(f"[bench] {name} unavailable: {error}", flush=True)
        if _agree_failed(control, name, error, failed):
            continue
        live.append(_Live(spec, built, optimizer))

    profiled = range(2, cfg.bench.warmup)  # after the compile and the settling step
    total, started = cfg.bench.warmup + cfg.bench.steps, time.perf_counter()
    if rank == 0:
        print(f"[bench] {len(live)} variants: {', '.join(v.spec.name for v in live)}; "
              f"{cfg.bench.warmup} warm-up steps (the first compiles), then "
              f"{cfg.bench.steps} measured", flush=True)
    for i in range(total):
        if rank == 0 and i > 0:
            print(f"[bench] step {i}/{total} of every variant done "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
        shift = i % max(len(live), 1)
        for v in live[shift:] + live[:shift]:
            error = None
            control.barrier()
            try:
                if not v.spec.rank0_only or rank == 0:
                    graphs = _graphs_compiled()
                    _one_step(v, batches[i], i in profiled, device)
                    if i >= cfg.bench.warmup:
                        v.late_compiles += _graphs_compiled() - graphs
            except Exception as e:  # noqa: BLE001
                error = _error_text(e)
                print(f"[bench rank {rank}] {v.spec.name} step {i} failed:\n"
                      f"{traceback.format_exc()}", file=sys.stderr)
            _agree_failed(control, v.spec.name, error, failed)
        if any(v.spec.name in failed for v in live):
            live = [v for v in live if v.spec.name not in failed]
            gc.collect()
    control.barrier()
    mine = {v.spec.name: _record(v) for v in live}
    everyone = control.gather(mine)
    if rank != 0:
        return None
    return {"n_params": n_params, "failed": failed,
            "variants": _merge(cfg, [v.spec.name for v in live], everyone)}


def _graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    return int(dynamo_counters()["stats"].get("unique_graphs", 0))


def _agree_failed(control: Control, name: str, error: str | None,
                  failed: dict[str, str]) -> bool:
    """Whether any rank failed ``name``; records the first rank's message."""
    if not control.any(error is not None):
        return False
    messages = control.gather(error)
    failed[name] = next((f"rank {r}: {m}" for r, m in enumerate(messages) if m),
                        "failed on another rank")
    return True


def _one_step(v: _Live, batch, profiled: bool, device: torch.device) -> None:
    inputs, targets = batch
    if profiled:
        v.held = measure.held_bytes(v.built.model, v.optimizer)
        loss, v.collectives, transient, v.blocked_s, v.all_to_all_s = measure.profiled_step(
            lambda: _train_step(v, inputs, targets), device)
        # the least over the profiled steps: the CPU profiler's misses only add bytes
        v.transient = transient if v.transient is None else min(v.transient, transient)
        v.times.append(float("nan"))
    else:
        start = time.perf_counter()
        loss = _train_step(v, inputs, targets)
        v.times.append(time.perf_counter() - start)
    v.losses.append(loss)


def _record(v: _Live) -> dict:
    rec = {"times": v.times, "optimizer_times": v.optimizer_times, "losses": v.losses,
           "collectives": v.collectives,
           "held": v.held, "transient": v.transient or 0, "late_compiles": v.late_compiles,
           "blocked_s": v.blocked_s, "all_to_all_s": v.all_to_all_s}
    backend = v.built.backend
    if backend is not None and getattr(backend, "reports", None) is not None:
        rec["passes"] = [{"graph": r.graph, "collectives_before": r.collectives_before,
                          "collectives_after": r.collectives_after,
                          "buckets": len(r.buckets), "moves": len(r.moves),
                          "bucket_names": [f"{b['kind']} {b['name']} x{b['count']}"
                                           for b in r.buckets if b["count"] > 1],
                          "decisions": len(r.decisions),
                          "estimated_exposed_s": r.estimated_exposed_s,
                          "pass_s": r.pass_seconds} for r in backend.reports]
    if getattr(backend, "comm_model", None) is not None:  # auto/greedy: the cost model's
        rec["calibration"] = calibration_used(backend.comm_model)
    return rec


def _merge(cfg: BenchConfig, names: list[str], everyone: list[dict]) -> dict[str, dict]:
    """Combine the ranks' records: slowest rank per step, mean loss, largest memory."""
    out = {}
    for name in names:
        spec = VARIANTS[name]
        recs = [r[name] for r in everyone]
        if spec.rank0_only:
            recs = recs[:1]
        times = [max(ts) for ts in zip(*(r["times"] for r in recs), strict=True)]
        # the slowest rank's step without its optimizer step (what the compiled graphs
        # and the auto-wrapping estimate cover)
        graphs = [max(r["times"][i] - r["optimizer_times"][i] for r in recs)
                  for i in range(len(times))]
        losses = [statistics.fmean(ls) for ls in zip(*(r["losses"] for r in recs), strict=True)]
        measured = times[cfg.bench.warmup:]
        out[name] = {
            "first_step_s": times[0],
            "step_times_s": measured,
            "median_step_s": statistics.median(measured),
            "median_graphs_s": statistics.median(graphs[cfg.bench.warmup:]),
            "losses": losses,
            "collectives_per_step": recs[0]["collectives"],
            "held_bytes": max(r["held"] for r in recs),
            "transient_bytes": max(r["transient"] for r in recs),
            "peak_bytes": max(r["held"] + r["transient"] for r in recs),
            "comm_blocked_s": max(r["blocked_s"] for r in recs),
            "all_to_all_s": max(r["all_to_all_s"] for r in recs),
            "passes": recs[0].get("passes"),
            "calibration": recs[0].get("calibration"),
            "compiles_in_measured_steps": max(r["late_compiles"] for r in recs),
        }
    return out
