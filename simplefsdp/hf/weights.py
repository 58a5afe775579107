"""Read a safetensors folder one tensor, or one row range, at a time, and load a sharded
model from it without any rank ever holding the whole model.

A folder is either sharded (``model.safetensors.index.json`` maps each tensor to its
file) or a single ``model.safetensors``. Files are memory-mapped (``safe_open``): a row
slice reads only those rows.

Two ways to load a model whose parameters are ``data_parallel`` DTensors
(``Shard(0)`` or ``Replicate`` on the data-parallel mesh, shards possibly uneven):

- ``all_ranks``: every rank reads exactly its own rows of every tensor.
- ``broadcast``: rank 0 reads each tensor once and ``dist.scatter`` sends each rank its
  rows (padded to one size, as scatter needs); one tensor is in flight at a time.
"""

from __future__ import annotations

import difflib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._torch_compat import StridedShard
from ..mesh import ParallelDims, dim0_rows
from . import HFError

LoadMode = Literal["broadcast", "all_ranks"]
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class WeightFiles:
    """The tensors of a safetensors folder by name; shapes come from the file headers."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self._safe_open = safe_open
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise HFError(f"{index}: not a safetensors index ({e})") from None
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        elif (self.folder / SINGLE).is_file():
            with safe_open(self.folder / SINGLE, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), self.folder / SINGLE)
        else:
            raise HFError(f"{self.folder}: no {SINGLE} and no {INDEX}; weights must be "
                          f"safetensors (save them with save_pretrained(..., "
                          f"safe_serialization=True))")
        for file in sorted(set(self.files.values())):
            if not file.is_file():
                raise HFError(f"{index}: names the weight file {file.name}, which is missing")
        self._open: dict[Path, object] = {}

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._open:
            self._open[file] = self._safe_open(file, framework="pt")
        return self._open[file]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of tensor ``name`` (dim 0), read from the memory map."""
        handle = self._handle(name)
        if start == 0 and stop == self.shape(name)[0]:
            return handle.get_tensor(name)
        return handle.get_slice(name)[start:stop]

    def tensor(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def missing_error(self, name: str, model_key: str) -> HFError:
        close = difflib.get_close_matches(name, list(self.files), n=1)
        hint = f" (closest there: {close[0]!r})" if close else ""
        where = self.folder / (INDEX if (self.folder / INDEX).is_file() else SINGLE)
        return HFError(f"{where}: the model's {model_key!r} needs the weight {name!r}, which "
                       f"is not in the files{hint}; is this folder the model config.json "
                       f"describes?")


@dataclass(frozen=True)
class Source:
    """Where a model tensor comes from: ``key`` in the files; ``rope_heads`` set means
    the rows are Hugging Face Llama's rotate-half order and are turned into Meta's
    interleaved order within each of that many heads (see :mod:`.convert`);
    ``converted`` set means transformers builds it from several file tensors
    (``key`` is the first; :class:`.conversion.Converted` reads and checks it)."""

    key: str
    rope_heads: int | None = None
    converted: object | None = None


@dataclass
class LoadReport:
    tensors: int = 0
    bytes_read: int = 0  # by this rank
    seconds: float = 0.0
    peak_rss_bytes: int = 0  # this process's peak resident memory while loading (VmHWM)
    # ... of which memory-mapped file pages are not private memory: the peak of the
    # anonymous (private) resident memory, sampled after each tensor and scatter.
    peak_anon_bytes: int = 0

    def sample(self) -> None:
        self.peak_anon_bytes = max(self.peak_anon_bytes, _status_kib("RssAnon") * 1024)


# ---------------------------------------------------------------------------------------
# Resident memory.
# ---------------------------------------------------------------------------------------
def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (VmHWM), or ru_maxrss where /proc is absent."""
    peak = _status_kib("VmHWM")
    if peak:
        return peak * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------------
# Which rows a rank holds.
# ---------------------------------------------------------------------------------------
def row_range(rows: int, mesh, placements, coordinate: list[int]) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a tensor with ``rows`` rows that the rank at
    ``coordinate`` of ``mesh`` holds: ``torch.chunk`` semantics, as ``Shard(0)`` uses. A
    ``_StridedShard(0)`` splits the piece the plain ``Shard(0)`` dims leave (experts:
    ``data_parallel`` shards each expert-parallel rank's experts again)."""
    start, stop = 0, rows
    for dim in sorted(range(len(placements)), key=lambda d: isinstance(placements[d],
                                                                        StridedShard)):
        placement = placements[dim]
        if isinstance(placement, Replicate):
            continue
        if not (isinstance(placement, (Shard, StridedShard)) and placement.dim == 0):
            raise HFError(f"sharded loading handles Shard(0) and Replicate placements, not "
                          f"{placement}; tensor parallelism is not supported for these models")
        lo, hi = dim0_rows(stop - start, mesh.size(dim), coordinate[dim])
        start, stop = start + lo, start + hi
    return start, stop


def _rank_coordinates(mesh) -> dict[int, list[int]]:
    layout = mesh.mesh
    return {int(layout[idx]): list(idx) for idx in
            (tuple(i.tolist()) for i in torch.nonzero(torch.ones_like(layout)))}


# ---------------------------------------------------------------------------------------
# Loading.
# ---------------------------------------------------------------------------------------
def hf_rows_to_meta(block: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of ``heads`` whole heads in rotate-half order -> Meta's interleaved order."""
    rows, rest = block.shape[0], block.shape[1:]
    half = rows // heads // 2
    return block.reshape(heads, 2, half, *rest).transpose(1, 2).reshape(rows, *rest)


def meta_rows_to_hf(block: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`hf_rows_to_meta`."""
    rows, rest = block.shape[0], block.shape[1:]
    half = rows // heads // 2
    return block.reshape(heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _read_rows(files: WeightFiles, src: Source, start: int, stop: int,
               total: int) -> tuple[torch.Tensor, int]:
    """Rows ``[start, stop)`` of ``src`` and the bytes read from the files for them."""
    if src.converted is not None:
        return src.converted.read_rows(files, start, stop)
    if src.rope_heads is None:
        rows = files.rows(src.key, start, stop)
        return rows, rows.numel() * rows.element_size()
    head = total // src.rope_heads  # read whole heads, reorder, keep the asked rows
    first, last = start // head, -(-stop // head)
    block = hf_rows_to_meta(files.rows(src.key, first * head, last * head), last - first)
    return block[start - first * head: stop - first * head], block.numel() * block.element_size()


def unique_tensors(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """``(names, tensor)`` for every distinct parameter and persistent buffer, in state
    dict order; a tied weight is one entry with all of its names."""
    from simplefsdp.state_dict import unwrapped_name

    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(value), ([], value))[0].append(unwrapped_name(key))
    return list(by_id.values())


def check_sources(model: nn.Module, files: WeightFiles,
                  sources: dict[str, Source]) -> dict[int, Source]:
    """Every parameter has a tensor of its shape in the files (buffers may be absent:
    they keep their computed values; so may LoRA adapters, which the base model's folder
    cannot hold: ``models.lora.init_adapters`` sets them). Returns the source of each
    tensor, by id."""
    from ..models.lora import is_adapter

    chosen: dict[int, Source] = {}
    for names, value in unique_tensors(model):
        if is_adapter(names[0]):
            continue
        found = [sources[n] for n in names if n in sources and sources[n].key in files]
        if not found:
            if not isinstance(value, nn.Parameter):
                continue
            first = sources.get(names[0], Source(names[0]))
            raise files.missing_error(first.key, names[0])
        src = found[0]
        shape = src.converted.file_shape(files) if src.converted else files.shape(src.key)
        if shape != tuple(value.shape):
            what = f"{src.key!r}" if src.converted is None else \
                f"{src.key!r} and the rest converted into {names[0]!r}"
            raise HFError(f"{files.folder / files.files[src.key].name}: {what} has shape "
                          f"{list(shape)} but the model's {names[0]!r} has "
                          f"{list(value.shape)}; the weights do not match config.json")
        chosen[id(value)] = src
    return chosen


@torch.no_grad()
def load_sharded(model: nn.Module, folder: str | Path, mode: LoadMode,
                 sources: dict[str, Source] | None = None) -> LoadReport:
    """Fill ``model`` (parameters already sharded and materialized) from ``folder``.

    ``sources`` maps a model name to its :class:`Source` (default: the same name). A
    collective: every rank calls it, with the same model. Checks every name and shape
    before reading any data.
    """
    if mode not in ("broadcast", "all_ranks"):
        raise HFError(f"model.load_weights = {mode!r}: choose 'broadcast' or 'all_ranks'")
    reset_peak_rss()
    started = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    sources = sources or {}
    reader = mode == "all_ranks" or rank == 0
    files = WeightFiles(folder)
    chosen = check_sources(model, files, {**{n: Source(n) for names, _ in
                                             unique_tensors(model) for n in names}, **sources})
    report = LoadReport()
    for _, value in unique_tensors(model):
        src = chosen.get(id(value))
        if src is None:
            continue
        report.tensors += 1
        report.sample()
        if isinstance(value, DTensor):
            _load_dtensor(value, files, src, mode, rank, world, reader, report)
        else:  # a buffer or an unsharded parameter: every rank gets all of it
            if reader:
                rows = value.shape[0] if value.dim() else 0
                if rows:
                    data, read = _read_rows(files, src, 0, rows, rows)
                else:
                    data = files.tensor(src.key)
                    read = data.numel() * data.element_size()
                report.bytes_read += read
                value.copy_(data)
            if mode == "broadcast" and world > 1:
                dist.broadcast(value, src=0)
    report.sample()
    report.seconds = time.perf_counter() - started
    report.peak_rss_bytes = peak_rss_bytes()
    return report


def _load_dtensor(value: DTensor, files: WeightFiles, src: Source, mode: LoadMode, rank: int,
                  world: int, reader: bool, report: LoadReport) -> None:
    mesh, placements = value.device_mesh, value.placements
    local = value.to_local()
    total = value.shape[0]
    if mode == "all_ranks":
        start, stop = row_range(total, mesh, placements, ParallelDims.coordinate(mesh))
        if stop > start:
            rows, read = _read_rows(files, src, start, stop, total)
            report.bytes_read += read
            local.copy_(rows)
            report.sample()
        return
    if mesh.size() != world:
        raise HFError("load_weights = 'broadcast' needs the model sharded over all ranks "
                      "(no tensor or pipeline parallelism); use 'all_ranks'")
    coords = _rank_coordinates(mesh)
    ranges = [row_range(total, mesh, placements, coords[g]) for g in range(world)]
    chunk = max(stop - start for start, stop in ranges)
    if chunk == 0:
        return
    received = torch.empty((chunk, *value.shape[1:]), dtype=local.dtype, device=local.device)
    pieces = None
    if rank == 0:
        full, read = _read_rows(files, src, 0, total, total)
        report.bytes_read += read
        full = full.to(device=local.device, dtype=local.dtype)
        pieces = []
        for start, stop in ranges:
            piece = torch.zeros_like(received)
            piece[: stop - start] = full[start:stop]
            pieces.append(piece)
        report.sample()  # rank 0's high point: the tensor and its padded pieces
        del full
    if world > 1:
        dist.scatter(received, pieces, src=0)
    else:
        received = pieces[0]
    local.copy_(received[: local.shape[0]])
