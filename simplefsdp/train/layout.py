"""The trainer's side of ``parallel.layout = "auto"`` (``plan.auto_layout``): rank 0
searches before anything is built, every rank trains the answer.

Rank 0 runs the search in a fresh process (the planner's fake process group) for this
world size, the device profile (``parallel.hardware``; "auto": the CUDA device's, on CPU
``cpu``) and the memory limit (``parallel.memory_limit_gb``; default the profile's, on
CPU the host's memory over the ranks on it), then broadcasts the answer, or the error
every rank raises (a ConfigError: exit status 78 before any work). The others wait in
a barrier whose timeout is the process group's (a long search is not a hang).
"""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..agreement import broadcast_from_rank0
from ..config.job import PG_TIMEOUT_S, JobConfig
from ..errors import ConfigError
from ..hardware import GB, detect_profile, profile_with_memory
from ..plan import auto_layout
from .watchdog import phase

LAYOUT_FILE = "layout.toml"


def plan_profile(cfg: JobConfig, ranks_here: int) -> str:
    """The device profile to plan for, with the memory limit (``NAME@<N>GB``)."""
    p = cfg.parallel
    try:
        name = p.hardware if p.hardware != "auto" else detect_profile(cfg.job.device)
    except ValueError as e:
        raise ConfigError(f"parallel.hardware: {e}") from None
    limit = p.memory_limit_gb
    if limit is None and name == "cpu":  # the host's memory, shared by its ranks
        limit = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
                      / ranks_here, 2)
    return profile_with_memory(name, limit)


def _ranks_per_node(world: int) -> int:
    """Ranks on one node: torchrun's LOCAL_WORLD_SIZE, else the whole world (one host)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def _search_on_rank0(cfg: JobConfig, explicit: set[str], world: int) -> dict[str, Any]:
    """Rank 0's answer (or ``{"error"|"failure": text}``), never raising: the others wait."""
    try:
        per_node = _ranks_per_node(world)
        gpu = plan_profile(cfg, per_node)
        fixed = auto_layout.fixed_layout_keys(cfg, explicit)
        held = ", ".join(f"{k}={v!r}" for k, v in fixed.items()) or "none"
        print(f"[simplefsdp] layout auto: searching the layouts of {world} rank(s) "
              f"({per_node} a node) on {gpu} for {cfg.model.name}; keys kept: {held} "
              f"(the planner's traces take seconds each)...", flush=True)
        outcome = auto_layout.choose_isolated(cfg, world, gpu, per_node, fixed)
        return {**outcome, "gpu": gpu}
    except ConfigError as e:
        return {"error": str(e)}
    except Exception:  # noqa: BLE001 - every rank must hear of it, not wait for it
        return {"failure": traceback.format_exc()}


def _wait_for_rank0() -> None:
    """Hold the other ranks until rank 0 has searched, for up to the trainer's process
    group timeout (gloo's monitored barrier takes its own timeout; a test's group may
    have a shorter one than a search takes)."""
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    else:
        dist.barrier()


def changed_keys(cfg: JobConfig) -> set[str]:
    """The layout keys whose values differ from the defaults: what a caller of
    ``train(cfg)`` (no command line to read) counts as set."""
    default = JobConfig()
    return {k for k in auto_layout.LAYOUT_KEYS
            if auto_layout.get_key(cfg, k) != auto_layout.get_key(default, k)}


def resolve_layout(cfg: JobConfig, explicit: set[str] | None) -> JobConfig:
    """``cfg`` as this run trains it: itself under ``layout = "manual"``; under "auto" the
    search's answer (the same on every rank), announced in one line and written to
    ``<metrics.output_dir>/layout.toml``. ``explicit``: the ``section.key`` names the
    TOML and the command line set (None: ``changed_keys``). Collective."""
    if cfg.parallel.layout != "auto":
        return cfg
    explicit = changed_keys(cfg) if explicit is None else explicit
    rank, world = dist.get_rank(), dist.get_world_size()
    phase("start-up: layout search (rank 0 plans, the others wait)", limit_s=PG_TIMEOUT_S)
    outcome = _search_on_rank0(cfg, explicit, world) if rank == 0 else None
    if world > 1:
        _wait_for_rank0()
    outcome = broadcast_from_rank0(outcome)
    if "error" in outcome:
        raise ConfigError(outcome["error"])
    if "failure" in outcome:
        raise RuntimeError(f"parallel.layout = 'auto': rank 0's search failed:\n"
                           f"{outcome['failure']}")
    chosen = auto_layout.apply_layout(cfg, outcome["layout"])
    chosen.validate(world)
    if rank == 0:
        print(auto_layout.choice_line(outcome, world, outcome["gpu"]), flush=True)
        _write_layout(chosen, outcome, world)
    return chosen


def _write_layout(chosen: JobConfig, outcome: dict[str, Any], world: int) -> Path:
    """``layout.toml``: the whole configuration with the chosen keys, ``layout`` manual."""
    out = Path(chosen.metrics.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"{auto_layout.choice_line(outcome, world, outcome['gpu'])}\n"
              f"Written by parallel.layout = 'auto'; train it again without the search:\n"
              f"python -m simplefsdp.train --config {out / LAYOUT_FILE}")
    path = out / LAYOUT_FILE
    path.write_text(auto_layout.config_toml(chosen, header))
    return path
