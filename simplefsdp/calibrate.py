"""``python -m simplefsdp.calibrate``: the cached calibrations, their age, the probe's
reading now, and a fresh calibration on request.

    python -m simplefsdp.calibrate                 # list the cache, probe 2 gloo ranks
    python -m simplefsdp.calibrate --no-probe      # list only (starts no processes)
    python -m simplefsdp.calibrate --refresh       # recalibrate 2 ranks, store, list

The cache folder is ``$SIMPLEFSDP_CACHE_DIR`` or ``~/.cache/simplefsdp``
(``compiler.cost.comm.cache_dir``). The probe and a refresh run on ``--nproc`` gloo
ranks on this host with ``--threads`` torch threads each (default: cores / ranks, as
the benchmark), i.e. the layout the benchmark and the trainer calibrate for.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .compiler.cost import comm, drift


def describe(record: dict[str, Any], path: Path, now: float | None = None) -> str:
    """One cache file in a few lines: where, for what layout, how old, its figures."""
    key, model = record.get("key", {}), record.get("model", {})
    created = record.get("created")
    now = time.time() if now is None else now
    age = "unknown (written before ages were stored)" if created is None else \
        f"{(now - created) / 3600:.1f} h"
    figures = comm.cached_figures(record)
    matmul = figures["matmul_s"]
    ag = model.get("all_gather", [0.0, 0.0])
    return "\n".join([
        f"{path}",
        f"  layout: world {key.get('world_size')}, group {key.get('group')}, backend "
        f"{key.get('backend')}, device {key.get('device_type')} ({key.get('device_name')}), "
        f"torch {key.get('torch_version')}",
        f"  age: {age}",
        f"  compute_slowdown {figures['compute_slowdown']:.3f}, hidden_fraction "
        f"{model.get('hidden_fraction', 1.0):.3f}, all_gather alpha {ag[0] * 1e6:.1f} us "
        f"beta {ag[1] * 1e9:.3f} ns/B, probe matmul "
        + ("-" if matmul is None else f"{matmul * 1e6:.1f} us"),
    ])


def calibration_used(model: comm.CommModel) -> dict[str, Any]:
    """Which calibration ``model`` (a backend's comm model on the default process group)
    came from, for a report: ``source`` ("cache", "calibrated" when this run calibrated,
    "default:..." for the fabric table), ``file`` and ``age_s`` of the cached record for
    this layout (None without one), ``compute_slowdown``. Needs the process group."""
    import torch.distributed as dist

    path, record = None, None
    if dist.is_available() and dist.is_initialized() and not model.source.startswith("default"):
        key = comm.cache_key()
        path, record = comm.cache_path(key), comm.load_record(key)
    created = (record or {}).get("created")
    return {"source": model.source, "file": None if record is None else str(path),
            "age_s": None if created is None else time.time() - created,
            "compute_slowdown": model.compute_slowdown}


def list_cache(folder: Path) -> list[str]:
    """:func:`describe` of every calibration file in ``folder`` (unreadable ones named)."""
    out = []
    for path in sorted(folder.glob("comm_model_*.json")):
        try:
            out.append(describe(json.loads(path.read_text()), path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            out.append(f"{path}\n  unreadable: {type(e).__name__}: {e}")
    return out or [f"no calibration cached in {folder}"]


def probe_report(refresh: bool = False) -> str | None:
    """On every rank of the default process group (collective): recalibrate and store
    first if ``refresh``, then the probe's reading and its verdict on the cached
    calibration for this layout; the text on rank 0, None on the others."""
    import torch
    import torch.distributed as dist

    group, cpu = dist.group.WORLD, torch.device("cpu")
    key, lines = comm.cache_key(), []
    if refresh:
        model, reference = comm.calibrate_steadily(group, cpu)
        if dist.get_rank() == 0:
            comm._store_cached(key, model, reference)
        lines.append(f"recalibrated: compute_slowdown {model.compute_slowdown:.3f}")
    record = comm.load_record(key) if dist.get_rank() == 0 else None
    reading = drift.read_probe(group, cpu)
    if dist.get_rank() != 0:
        return None
    lines.append(f"probe now ({reading['probe_s']:.2f} s, {dist.get_world_size()} ranks x "
                 f"{torch.get_num_threads()} thread(s)): compute_slowdown "
                 f"{reading['compute_slowdown']:.3f}, matmul {reading['matmul_s'] * 1e6:.1f} us, "
                 f"collectives {reading['collective_s'] * 1e6:.1f} us, "
                 f"fixed work {reading['busy_s'] * 1e3:.2f} ms")
    if record is None:
        lines.append(f"no cached calibration for this layout ({comm.cache_path(key)})")
        return "\n".join(lines)
    off = drift.disagreements(comm.cached_figures(record), reading)
    lines.append("verdict: " + ("; ".join(off) + ": the next run recalibrates" if off
                                else f"the cache holds (compute within {drift.MARGIN:.0%}, "
                                     f"collectives within {drift.LOAD_MARGIN:.0%})"))
    return "\n".join(lines)


def _rank_main(rank: int, world: int, port: int, threads: int, refresh: bool,
               queue: Any) -> None:
    import torch
    import torch.distributed as dist

    from .net import join_local_group

    torch.set_num_threads(threads)
    join_local_group("gloo", port, rank, world, datetime.timedelta(seconds=120))
    try:
        text = probe_report(refresh)
        if text is not None:
            queue.put(text)
    finally:
        dist.destroy_process_group()


def _probe_ranks(world: int, threads: int, refresh: bool) -> str:
    import multiprocessing as mp

    from .net import host_store

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = host_store(world, datetime.timedelta(seconds=120))
    procs = [ctx.Process(target=_rank_main, args=(r, world, store.port, threads, refresh,
                                                  queue))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"probe ranks failed (exit codes {[p.exitcode for p in procs]})")
    return queue.get(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simplefsdp.calibrate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--refresh", action="store_true",
                        help="recalibrate on --nproc ranks and replace the cached figures")
    parser.add_argument("--no-probe", action="store_true",
                        help="only list the cache (starts no processes)")
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank (0: CPU cores / ranks, as the benchmark)")
    args = parser.parse_args(argv)
    if args.nproc < 2:
        parser.error("--nproc: at least 2 (one rank has no collectives to calibrate)")
    if args.refresh and args.no_probe:
        parser.error("--refresh runs ranks: drop --no-probe")
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    probe = None if args.no_probe else _probe_ranks(args.nproc, threads, args.refresh)
    print("\n".join(list_cache(comm.cache_dir())))
    if probe:
        print(probe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
