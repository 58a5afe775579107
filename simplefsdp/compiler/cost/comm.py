"""Communication model: ``T = alpha + beta * bytes`` per collective kind.

Calibrated on the live process group (:func:`calibrate`), read from a disk cache, or
taken from a table of known fabrics (:func:`default_comm_model`); :func:`get_comm_model`
picks among the three. Calibration and the cache lookup are collective and run in
eager code, when the backend is built, never inside a compiler pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..._torch_compat import disable_current_modes
from ...agreement import (
    agree_across_ranks,
    broadcast_from_rank0,
    group_device,
    is_fake_group,
    nothing_to_agree,
)
from ...hardware import KNOWN_FABRICS
from ..collectives import COLLECTIVE_KINDS
from . import drift
from .fit import robust_fit
from .probes import (
    _normalize_kind,
    _resolve_group,
    measure_collectives,
    measure_compute_slowdown,
    measure_copy,
    measure_hidden_fraction,
)

__all__ = ["COLLECTIVE_KINDS", "CommModel", "calibrate", "default_comm_model",
           "get_comm_model", "read_comm_model"]



@dataclass(frozen=True)
class CommModel:
    """Per-kind ``(alpha_s, beta_s_per_byte)``: ``predict(kind, n) = alpha + beta * n``.

    For ``all_gather`` and ``reduce_scatter`` ``n`` is the full (unsharded) tensor size in
    bytes, i.e. the all-gather's output or the reduce-scatter's input; for ``all_reduce``
    it is the size of the reduced tensor. ``hidden_fraction`` is the fraction of concurrent
    computation that actually hides a collective: ~1 where communication has its own
    engine (NCCL on GPUs), ~0 where collectives and compute share the same cores (gloo on
    a small CPU host); ``calibrate`` measures it. ``copy_s_per_byte``: a bucket's
    copy-in/copy-out cost per byte copied (device memory bandwidth; ``measure_copy``).
    ``max_bytes``: the largest collective the figures were measured on (None: no
    bound); the planner makes no bucket larger, since the fit says nothing beyond it
    (README: cost model defaults).
    ``compute_slowdown``: how much slower computation runs when every rank of the group
    computes at once than on one rank alone (>= 1; ``measure_compute_slowdown``): ~1 with
    a device per rank, above 1 where ranks share a host's cores and memory bandwidth. The
    simulated step scales its compute by it, so its estimate of the time beyond
    computation is comparable with a measured step minus a one-rank compute-only step.
    ``source``, ``world_size`` and ``group`` (the group's ranks relative to its first,
    e.g. ``(0, 2)`` for a 2x2 mesh's column) describe where the figures came from and
    take no part in equality.
    """

    all_gather: tuple[float, float]
    reduce_scatter: tuple[float, float]
    all_reduce: tuple[float, float]
    hidden_fraction: float = 1.0
    copy_s_per_byte: float = 0.0
    max_bytes: float | None = None
    compute_slowdown: float = 1.0
    world_size: int = dataclasses.field(default=1, compare=False)
    source: str = dataclasses.field(default="unknown", compare=False)
    group: tuple[int, ...] | None = dataclasses.field(default=None, compare=False)

    def params(self, kind: str) -> tuple[float, float]:
        """``(alpha_s, beta_s_per_byte)`` of one kind (aliases such as
        ``all_gather_into_tensor`` are accepted)."""
        return getattr(self, _normalize_kind(kind))

    def predict(self, kind: str, nbytes: float) -> float:
        """Predicted seconds for one collective of ``kind`` over ``nbytes`` bytes."""
        alpha, beta = self.params(kind)
        return alpha + beta * float(nbytes)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(getattr(self, k)) for k in COLLECTIVE_KINDS} | {
            "hidden_fraction": self.hidden_fraction, "copy_s_per_byte": self.copy_s_per_byte,
            "max_bytes": self.max_bytes, "compute_slowdown": self.compute_slowdown,
            "world_size": self.world_size, "source": self.source,
            "group": None if self.group is None else list(self.group)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CommModel:
        pairs = {k: (float(d[k][0]), float(d[k][1])) for k in COLLECTIVE_KINDS}
        return cls(**pairs, hidden_fraction=float(d.get("hidden_fraction", 1.0)),
                   copy_s_per_byte=float(d.get("copy_s_per_byte", 0.0)),
                   max_bytes=None if d.get("max_bytes") is None else float(d["max_bytes"]),
                   compute_slowdown=float(d.get("compute_slowdown", 1.0)),
                   world_size=int(d.get("world_size", 1)), source=str(d.get("source", "unknown")),
                   group=None if d.get("group") is None else tuple(int(r) for r in d["group"]))

    def with_kind_from(self, kind: str, other: CommModel) -> CommModel:
        """This model with ``kind``'s figures taken from ``other`` (a model calibrated on
        another process group): HSDP reduce-scatters over the shard group and all-reduces
        the shards over the replicate group, so its plan reads each kind from its group."""
        kind = _normalize_kind(kind)
        return dataclasses.replace(self, **{kind: other.params(kind)},
                                   source=f"{self.source}+{kind}:{other.source}")


def default_comm_model(world_size: int, fabric: str = "gloo_cpu_loopback") -> CommModel:
    """A ``CommModel`` from ``KNOWN_FABRICS[fabric]`` for a ring over ``world_size`` ranks."""
    spec = KNOWN_FABRICS[fabric]
    n = max(int(world_size), 1)
    ring = (n - 1) / n
    bw = spec.bus_bandwidth_Bps
    # all-reduce = reduce-scatter + all-gather: twice the latency and twice the bytes.
    return CommModel(
        all_gather=(spec.alpha_s, ring / bw),
        reduce_scatter=(spec.alpha_s, ring / bw),
        all_reduce=(2 * spec.alpha_s, 2 * ring / bw),
        hidden_fraction=spec.hidden_fraction,
        copy_s_per_byte=1.0 / spec.copy_Bps,
        max_bytes=spec.max_bytes,
        world_size=n,
        source=f"default:{fabric}",
    )


def read_comm_model(path: str | os.PathLike) -> CommModel:
    """The model in a calibration file: a cache file as :func:`get_comm_model` writes it
    (``key``, ``model``, ...; ``python -m simplefsdp.calibrate`` lists them) or a bare
    ``CommModel.to_dict()``. ``source`` names the file. Raises ``OSError`` when it cannot
    be read and ``ValueError`` when it holds no model, saying what is missing."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    model = data.get("model", data) if isinstance(data, dict) else None
    try:
        found = CommModel.from_dict(model)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        raise ValueError(f"{path} holds no comm model: a calibration file has "
                         f"{', '.join(COLLECTIVE_KINDS)} as [alpha_s, beta_s_per_byte] "
                         f"(under \"model\" in a cache file)") from None
    return dataclasses.replace(found, source=f"file:{path}")


FAKE_GPUS_PER_NODE = 8  # a fake group's world is laid out on nodes of this many GPUs


def _local_world_size(world_size: int, device: torch.device, fake: bool = False) -> int:
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is not None:
        return int(env)
    if fake and device.type == "cuda":
        return min(world_size, FAKE_GPUS_PER_NODE)
    if device.type == "cuda":
        return min(world_size, max(torch.cuda.device_count(), 1))
    return world_size


def _pick_fabric(world_size: int, device: torch.device, fake: bool = False) -> str:
    if device.type != "cuda":
        return "gloo_cpu_loopback"
    return "nvlink_h100" if world_size <= _local_world_size(world_size, device, fake) \
        else "infiniband_ndr"


DEFAULT_CPU_SIZES = tuple(4096 * 4 ** i for i in range(7))  # 4 KiB .. 16 MiB
DEFAULT_CUDA_SIZES = tuple(2 ** 20 * 4 ** i for i in range(5))  # 1 MiB .. 256 MiB


def calibrate(group: dist.ProcessGroup | None = None, sizes: Sequence[int] | None = None,
              repeats: int = 5, device: torch.device | str | None = None, warmup: int = 2,
              dtype: torch.dtype = torch.float32,
              kinds: Iterable[str] = COLLECTIVE_KINDS) -> CommModel:
    """Time each collective kind on ``group`` and fit ``alpha + beta * bytes`` per kind.

    Collective: every rank of ``group`` must call it. Each rank takes the median of
    ``repeats`` timings per (kind, size) after ``warmup`` rounds (``measure_collectives``,
    sizes interleaved); the per-rank medians are combined with an all-reduce MAX (a
    collective finishes when its slowest rank does) and only then fitted, in pure Python,
    so every rank returns bit-identical figures (:func:`robust_fit`: Theil-Sen through
    the medians, sizes off by 2x dropped, least squares on the rest). Kinds not in
    ``kinds`` keep the fabric defaults. ``sizes`` default to 4 KiB..16 MiB on CPU,
    1 MiB..256 MiB on CUDA (the largest becomes ``max_bytes``). The hidden fraction is
    ``measure_hidden_fraction`` at the largest size, the MIN across ranks; the copy cost
    ``measure_copy`` at the largest size, the MAX across ranks; the compute slowdown
    ``measure_compute_slowdown``.
    """
    group = _resolve_group(group)
    dev = group_device(group, device)
    ws = dist.get_world_size(group)
    if sizes is None:
        sizes = DEFAULT_CUDA_SIZES if dev.type == "cuda" else DEFAULT_CPU_SIZES
    sizes = [int(s) for s in sizes]
    kinds = [_normalize_kind(k) for k in kinds]
    with disable_current_modes():
        dist.barrier(group)
    measured = measure_collectives([(k, n) for k in kinds for n in sizes], group, dev, dtype,
                                   repeats, warmup)
    agreed = agree_across_ranks(measured, group, op="max")
    fitted = dict(dataclasses.asdict(default_comm_model(ws, _pick_fabric(ws, dev))))
    for i, kind in enumerate(kinds):
        times = agreed[i * len(sizes):(i + 1) * len(sizes)]
        fitted[kind] = robust_fit(sizes, times)[0]
    fitted["hidden_fraction"] = agree_across_ranks(
        [measure_hidden_fraction(group, dev, max(sizes), repeats, dtype)], group, op="min")[0]
    fitted["copy_s_per_byte"] = agree_across_ranks(
        [measure_copy(dev, max(sizes), repeats, dtype, group=group)], group, op="max")[0]
    fitted["compute_slowdown"] = measure_compute_slowdown(group, dev)
    fitted["max_bytes"] = float(max(sizes))
    fitted["source"] = "calibrated"
    fitted["world_size"] = ws
    fitted["group"] = group_layout(group)
    return CommModel(**fitted)


def group_layout(group: dist.ProcessGroup | None = None) -> tuple[int, ...]:
    """``group``'s global ranks relative to its first (``(0, 1)``, ``(0, 2)``): the same
    for every group along one mesh dimension, different between dimensions, so it tells
    an HSDP mesh's shard groups from its replicate groups (their speeds differ)."""
    ranks = dist.get_process_group_ranks(_resolve_group(group))
    return tuple(r - ranks[0] for r in ranks)


def cache_dir() -> Path:
    """``$SIMPLEFSDP_CACHE_DIR`` or ``~/.cache/simplefsdp``."""
    env = os.environ.get("SIMPLEFSDP_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "simplefsdp"


def cache_key(group: dist.ProcessGroup | None = None,
              device: torch.device | str | None = None) -> dict[str, Any]:
    """What a calibration depends on: the group's size and layout (``group_layout``), node
    size, backend, device, torch version (and the format, raised whenever the stored
    fields or how they are measured change: an older cache is not reused)."""
    group = _resolve_group(group)
    dev = group_device(group, device)
    ws = dist.get_world_size(group)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine() or "cpu"
    return {
        "world_size": ws,
        "local_world_size": _local_world_size(ws, dev),
        "backend": str(dist.get_backend(group)),
        "device_type": dev.type,
        "device_name": name,
        "torch_version": torch.__version__,
        "group": list(group_layout(group)),
        # 8: the file holds its creation time and the probe's reference; 9: the reference
        # holds collective_s (an older file, possibly timed under load, is not reused)
        "format": 9,
    }


def cache_path(key: dict[str, Any], folder: Path | None = None) -> Path:
    """The file a calibration for ``key`` lives in (a hash of the key in the name)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (folder if folder is not None else cache_dir()) / f"comm_model_{digest}.json"


def load_record(key: dict[str, Any]) -> dict[str, Any] | None:
    """The cache file of ``key`` as stored (``key``, ``model``, ``created``: Unix time,
    ``probe``: the probe's reading right after calibrating), or None when absent,
    unreadable or written for another key."""
    try:
        data = json.loads(cache_path(key).read_text())
        if data.get("key") != key:
            return None
        CommModel.from_dict(data["model"])  # readable, or the file counts as absent
        return data
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


def _store_cached(key: dict[str, Any], model: CommModel,
                  probe: dict[str, float] | None = None) -> None:
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"key": key, "model": model.to_dict(), "created": time.time(),
                              "probe": probe}, indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(payload)
            os.replace(tmp, path)  # atomic on POSIX: readers see the old or the new file
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only home must not break training; the next run calibrates again


def cached_figures(record: dict[str, Any]) -> dict[str, float | None]:
    """What the probe checks in a cache record: its ``compute_slowdown``, and the
    ``matmul_s``, ``collective_s`` and ``busy_s`` read right after it was calibrated
    (None when not stored)."""
    probe = record.get("probe") or {}
    return {"compute_slowdown": float(record["model"].get("compute_slowdown", 1.0)),
            "matmul_s": probe.get("matmul_s"), "collective_s": probe.get("collective_s"),
            "busy_s": probe.get("busy_s")}


def get_comm_model(group: dist.ProcessGroup | None = None, calibrate_on_miss: bool = True,
                   cache: bool = True, writer: int | None = None,
                   **calibrate_kwargs: Any) -> CommModel:
    """The communication model for ``group``: cached, freshly calibrated, or defaults.

    * ``cache=True``: rank 0 looks up ``cache_path(cache_key(group))`` and broadcasts what
      it found, so all ranks agree even when only some of them see the file. With
      ``calibrate_on_miss=True`` a found calibration is first checked by the probe
      (``drift.read_probe``, well under a second, collective): a figure off by more than
      ``drift.MARGIN`` counts as a miss (a warning says which), so a calibration taken
      on a busy machine is replaced instead of misleading every later run.
    * on a miss with ``calibrate_on_miss=True``: every rank runs :func:`calibrate`
      (collective) and the group's rank 0 (or the global rank ``writer``) stores the
      result (tmp file + rename), its creation time and the probe's reading right after
      it (the reference later probes compare with) when ``cache=True``.
    * ``calibrate_on_miss=False``: nothing is timed; a cached calibration is still used when
      ``cache=True``, otherwise the ``KNOWN_FABRICS`` default for the group's fabric.

    Collective whenever the default process group exists: call it on every rank.
    Without one (single process) it returns the CPU default for one rank. On a fake
    process group nothing is timed or cached (its collectives move no data): the fabric
    table's model for its world size and device (CUDA: nodes of
    ``FAKE_GPUS_PER_NODE``).
    """
    if not dist.is_available() or not dist.is_initialized():
        return default_comm_model(1)
    group = _resolve_group(group)
    dev = group_device(group, calibrate_kwargs.get("device"))
    ws = dist.get_world_size(group)
    if is_fake_group(group):
        return default_comm_model(ws, _pick_fabric(ws, dev, fake=True))
    key = cache_key(group, dev)
    is_rank0 = dist.get_rank(group) == 0
    now = None  # the probe's reading, when the cache check took one
    if cache:
        record = broadcast_from_rank0(load_record(key) if is_rank0 else None, group)
        if record is not None:
            found = dataclasses.replace(CommModel.from_dict(record["model"]), source="cache")
            if not calibrate_on_miss:
                return found  # nothing timed (e.g. mid-compile): the cache as it is
            # every rank has rank 0's record and the same agreed reading: one verdict
            now = drift.read_probe(group, dev)
            off = drift.disagreements(cached_figures(record), now)
            if not off:
                return found
            warnings.warn(f"simplefsdp: the cached calibration {cache_path(key)} disagrees "
                          f"with this machine ({'; '.join(off)}): recalibrating", stacklevel=2)
    if not calibrate_on_miss:
        return default_comm_model(ws, _pick_fabric(ws, dev))
    if not cache:
        return calibrate(group, **calibrate_kwargs)
    model, reference = calibrate_steadily(group, before=now, **calibrate_kwargs)
    if is_rank0 if writer is None else dist.get_rank() == writer:
        _store_cached(key, model, reference)
    return model


# How many times a calibration is taken before the least loaded one is kept anyway: one
# retry clears load that came or went once; more would cost seconds each on a host whose
# load keeps changing, where no try is steady.
CALIBRATION_TRIES = 2


def calibrate_steadily(group: dist.ProcessGroup | None = None,
                       device: torch.device | str | None = None,
                       before: dict[str, float] | None = None,
                       **calibrate_kwargs: Any) -> tuple[CommModel, dict[str, float]]:
    """:func:`calibrate` between two probe readings (``drift.read_probe``; ``before``: one
    just taken), and the reading after it, which a cache stores as the reference later
    probes compare with. Load that came or went while the calibration ran (another job
    starting, a compile on the same cores) shows as the two readings disagreeing beyond
    ``drift.LOAD_MARGIN`` in a figure that sees load (``drift.LOAD_FIGURES``): the figures
    would hold for neither host, so the calibration is taken again, up to
    ``CALIBRATION_TRIES`` times. If no try is steady, the one whose reading after it was
    the least loaded (the lowest ``busy_s``: ranks woken from a collective get the cores
    first, so ``collective_s`` can read like an idle host under load, while the fixed
    work of every rank at once cannot) is kept, with a warning. Collective; the readings
    are agreed across ranks, so every rank takes the same decisions."""
    group = _resolve_group(group)
    dev = group_device(group, device)
    tries = []
    for attempt in range(CALIBRATION_TRIES):
        if before is None or attempt > 0:
            before = drift.read_probe(group, dev)
        model = calibrate(group, device=dev, **calibrate_kwargs)
        after = drift.read_probe(group, dev)
        # hardware and thread count cannot change meanwhile: only the load figures
        moved = drift.disagreements({k: before[k] for k in drift.LOAD_FIGURES}, after)
        if not moved:
            return model, after
        tries.append((after["busy_s"], attempt, model, after, moved))
    _, attempt, model, after, moved = min(tries)
    warnings.warn(f"simplefsdp: the host's load changed during each of {CALIBRATION_TRIES} "
                  f"calibrations ({'; '.join(moved)}); keeping try {attempt + 1}, the least "
                  "loaded", stacklevel=2)
    return model, after


def get_comm_models(mesh: Any, **kwargs: Any) -> dict[str, CommModel]:
    """One :func:`get_comm_model` per dimension of a ``DeviceMesh`` (dimensions of one rank
    have no collectives and are left out), keyed by the dimension's name: an HSDP mesh's
    ``dp_shard`` and ``dp_replicate`` groups, or a TP group, run at different speeds
    (e.g. within a node vs across nodes), so each is calibrated (and cached, see
    :func:`cache_key`) on its own group. Every group along a dimension has the same
    layout, hence the same cache file: only global rank 0 writes it, and every rank ends
    up with rank 0's figures (one broadcast), so all ranks plan alike. Collective: call
    it on every rank."""
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    mine = {name: get_comm_model(mesh.get_group(i), writer=0, **kwargs)
            for i, name in enumerate(names) if mesh.size(i) > 1}
    if nothing_to_agree():
        return mine
    agreed = broadcast_from_rank0({k: m.to_dict() for k, m in mine.items()})
    return {k: CommModel.from_dict(d) for k, d in agreed.items()}
