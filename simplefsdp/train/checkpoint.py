"""Training checkpoints: save, find the newest complete one, resume, export.

A checkpoint is ``<folder>/step-<N>`` (``N`` = completed steps; ``folder`` is resolved
by :func:`checkpoint_dir`, under the output directory), written with
``simplefsdp.save_checkpoint``, which writes ``step-<N>.tmp`` and renames it only once
every rank has finished: a crash mid-save leaves a ``.tmp`` folder that is never
mistaken for a checkpoint, and the previous one stays the newest complete.

It holds everything a resumed run needs to continue bit for bit:

* ``app``: model and optimizer, sharded (``ModelAndOptimizer``, keyed by parameter name);
* ``trainer``: step, LR scheduler, data loader position (the same on every rank);
* ``rng/rank<r>``: each rank's torch CPU (and CUDA) generator state. Keys are per rank,
  because DCP would otherwise keep one copy of a value that is the same key everywhere.

After the rename the ranks checksum the files (each rank a slice; ``zlib.crc32``,
streamed: about a second per GB and rank, cheaper than a cryptographic hash and enough
to catch truncation and overwritten blocks) and rank 0 writes ``manifest.json`` last,
atomically (tmp + rename): files, sizes, checksums, step and a fingerprint of the model
config. Only a checkpoint with a manifest counts for rotation, so ``keep_latest`` never
deletes the newest one that was completely written.

Resuming is explicit (:func:`resume_point`): with ``checkpoint.resume = true``
(``--resume``) a run continues from the newest checkpoint in its folder whose manifest
verifies (sizes and checksums, read on rank 0; on resume only), saying which newer ones
it skipped and why; with none it starts from step 0 with a note. Without it, a folder that already
holds a complete checkpoint is refused at start-up, before anything is built, so two
runs are never mixed in one folder and no checkpoint is overwritten by accident.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful

import simplefsdp
from simplefsdp.state_dict import ModelAndOptimizer, begin_save, commit_save, is_complete

from ..agreement import broadcast_from_rank0
from ..errors import ConfigError
from .async_save import AsyncMode, CheckpointWriter

_STEP_DIR = re.compile(r"^step-(\d+)$")
_PARTIAL_DIR = re.compile(r"^step-(\d+)\.tmp$")
MANIFEST = "manifest.json"
RECORDED_CONFIG = "config.json"  # the job config the trainer writes next to checkpoints
_CHUNK = 4 << 20


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path."""


class TrainerState(Stateful):
    """Step, LR scheduler and data loader position as one DCP ``Stateful``."""

    def __init__(self, scheduler, loader):
        self.step = 0
        self.scheduler, self.loader = scheduler, loader

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "scheduler": self.scheduler.state_dict(),
                "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])


class RNGState(Stateful):
    """This rank's generator states (CPU, and CUDA when present)."""

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


def checkpoint_dir(folder: str | Path, output_dir: str | Path) -> Path:
    """Where checkpoints go: an absolute ``folder`` as is; a relative one under
    ``output_dir`` (the default ``checkpoints`` is ``outputs/checkpoints``), unless it
    already starts with it (``outputs/x/checkpoints`` with ``output_dir = "outputs/x"``
    stays as it is)."""
    folder, output_dir = Path(folder), Path(output_dir)
    if folder.is_absolute() or folder.parts[:len(output_dir.parts)] == output_dir.parts:
        return folder
    return output_dir / folder


def list_checkpoints(folder: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``folder`` as (step, path), oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and is_complete(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def remove_partial(folder: str | Path) -> list[Path]:
    """Delete leftover ``step-<N>.tmp`` folders (saves that never finished); returns them.
    Call on one rank, before any save starts."""
    folder = Path(folder)
    removed = []
    if folder.is_dir():
        for path in folder.iterdir():
            if _PARTIAL_DIR.match(path.name):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def config_fingerprint(model_args: Any) -> str:
    """A short hash of the model's shape: a checkpoint only fits a model with the same."""
    text = json.dumps(model_args, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _checksum(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _data_files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(path: Path, step: int, fingerprint: str) -> None:
    """Checksum every file of the checkpoint at ``path`` (each rank a slice) and write
    ``manifest.json`` on rank 0, last and atomically. A collective."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    names = _data_files(path)
    mine = {name: {"size": (path / name).stat().st_size, "crc32": _checksum(path / name)}
            for name in names[rank::world]}
    pieces: list[Any] = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(pieces, mine)
    else:
        pieces = [mine]
    if rank == 0:
        files = {k: v for piece in pieces for k, v in piece.items()}
        manifest = {"format": 1, "step": step, "fingerprint": fingerprint,
                    "checksum": "zlib.crc32", "files": files}
        tmp = path / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, path / MANIFEST)


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def verify(path: str | Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted, or None if its manifest holds
    and every file has the recorded size and checksum."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        return f"no {MANIFEST} (the save did not finish, or an older simplefsdp wrote it)"
    manifest = read_manifest(path)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return f"{MANIFEST} is unreadable"
    for name, want in sorted(manifest["files"].items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, the manifest says {want['size']} (truncated?)"
        if _checksum(file) != want["crc32"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def _choose(folder: str | Path, resume: bool, fingerprint: str | None) -> list[Any]:
    """Rank 0's part of :func:`resume_point`: [chosen path, newest path, error]."""
    found = list_checkpoints(folder)
    newest = str(found[-1][1]) if found else None
    if not resume:
        return [None, newest, None]
    skipped = []
    for _, path in reversed(found):
        reason = verify(path)
        if reason is None:
            written_for = (read_manifest(path) or {}).get("fingerprint")
            if fingerprint is not None and written_for != fingerprint:
                return [None, newest, f"{path} was written for a different model (its model "
                                      f"config fingerprint differs); resume with the model "
                                      f"config it was trained with, or start afresh in "
                                      f"another --checkpoint.folder"]
            return [str(path), newest, None]
        print(f"[simplefsdp] --resume: skipping {path}: {reason}", flush=True)
        if (path / MANIFEST).is_file():  # written, then damaged (an unfinished save is not)
            skipped.append(f"{path.name}: {reason}")
    if skipped:
        return [None, newest, f"--resume: none of the {len(skipped)} checkpoints in {folder} "
                              f"verifies ({'; '.join(skipped)}); move them away (or choose "
                              f"another --checkpoint.folder) to start afresh"]
    return [None, None, None]


def _cause(error: BaseException) -> str:
    """A short account of a failed save: DCP's CheckpointException holds one exception
    per failed rank (``failures``); anything else is itself."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        def first(value: Any) -> Any:
            return value[0] if isinstance(value, tuple) else value

        return "; ".join(f"rank {rank}: {first(value)!r:.300}"
                         for rank, value in sorted(failures.items())[:4])
    return f"{error!r:.600}"


def checkpoint_step(path: str | Path) -> int:
    return int(_STEP_DIR.match(Path(path).name).group(1))


def resume_point(folder: str | Path, resume: bool,
                 fingerprint: str | None = None) -> Path | None:
    """The checkpoint to start from: with ``resume``, the newest one in ``folder`` that
    verifies (see :func:`verify`; newer ones that do not are named on stdout and
    skipped), else None. A collective: rank 0 looks and broadcasts its choice, so every
    rank decides alike (and raises alike) even if a checkpoint completes while they look.

    Raises a ConfigError if ``folder`` holds a complete checkpoint and ``resume`` is off,
    if ``resume`` is on and complete checkpoints exist but none verifies, or if the one
    that verifies was written for a model with another ``fingerprint``.
    """
    looks = not dist.is_initialized() or dist.get_rank() == 0
    choice = _choose(folder, resume, fingerprint) if looks else [None, None, None]
    chosen, newest, error = broadcast_from_rank0(choice)
    if error is not None:
        raise ConfigError(error)
    if newest is not None and not resume:
        raise ConfigError(
            f"{folder} already holds a complete checkpoint ({Path(newest).name}) from an "
            f"earlier run; pass --resume (checkpoint.resume = true) to continue from it, "
            f"or choose another --checkpoint.folder (or --metrics.output_dir) to start afresh")
    if chosen is None:
        if resume and looks:
            print(f"[simplefsdp] --resume: no complete checkpoint in {folder}; starting "
                  f"from step 0", flush=True)
        return None
    return Path(chosen)


class CheckpointManager:
    """Saves every ``every`` steps, keeps the newest ``keep_latest``, resumes.

    With ``async_mode`` "async"/"async_pinned" (``async_save.py``) a save returns once
    the state is staged; the checkpoint is completed (renamed, manifest written) at the
    first step end where every rank's write has finished (:meth:`poll`), before the next
    save, or at the end (``save(..., wait=True)``/:meth:`finish`). Until then the newest
    verified checkpoint is the previous one, whatever happens to the process.
    """

    def __init__(self, folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 trainer_state: TrainerState, every: int, keep_latest: int,
                 fingerprint: str = "", async_mode: AsyncMode = "sync"):
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        self.params = [p for p in model.parameters()]
        self.every, self.keep_latest = every, keep_latest
        self.trainer_state = trainer_state
        self.app = ModelAndOptimizer(model, optimizer)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.writer = CheckpointWriter(async_mode)
        self.pending: tuple[int, Path, Future | None] | None = None  # step, target, write
        # Called as on_phase("save" | "manifest", step) inside a save (fault injection).
        self.on_phase: Callable[[str, int], None] = lambda phase, step: None

    def _state(self, with_rng: bool = True) -> dict[str, Any]:
        state: dict[str, Any] = {"app": self.app, "trainer": self.trainer_state}
        if with_rng:
            state[f"rng/rank{self.rank}"] = RNGState()
        return state

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, wait: bool = False) -> Path | None:
        """Save after ``step`` completed steps (a collective: every rank calls it); the
        checkpoint's path once complete, or None while an asynchronous write is in flight
        (``wait``: complete it before returning). A pending save completes first.

        Refuses (NonFiniteError) to save parameters that are not finite. A failed write
        removes its ``.tmp`` folder and raises a CheckpointError naming the path."""
        from .guard import NonFiniteError, all_finite

        if not all_finite(self.params):
            raise NonFiniteError(f"the parameters after step {step} are not finite (NaN or "
                                 f"inf); no checkpoint written, the newest good one stays")
        self.finish()
        self.trainer_state.step = step
        target = self.folder / f"step-{step}"
        with self._failing(target):
            write = self.writer.start(self._state(), begin_save(target))
            self.on_phase("save", step)
        self.pending = (step, target, write)
        return self.finish() if wait or write is None else None

    def poll(self) -> Path | None:
        """At a step end: complete the pending save if every rank's write has finished
        (one small all-reduce while a save is pending, so all ranks decide alike)."""
        if self.pending is None:
            return None
        done = torch.tensor(float(self.pending[2] is None or self.pending[2].done()))
        if dist.is_initialized():
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self.finish() if done.item() > 0 else None

    def finish(self) -> Path | None:
        """Wait for the pending save, rename it into place and write its manifest (a
        collective); its path, or None if nothing was pending."""
        if self.pending is None:
            return None
        step, target, write = self.pending
        self.pending = None
        with self._failing(target):
            if write is not None:
                write.result()
            path = commit_save(target)
            self.on_phase("manifest", step)
            write_manifest(path, step, self.fingerprint)
        if self.rank == 0:
            self._prune(step)
        return path

    @contextlib.contextmanager
    def _failing(self, target: Path):
        """A failure inside: the ``.tmp`` folder goes and a CheckpointError names it."""
        try:
            yield
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one
            if self.rank == 0:
                shutil.rmtree(target.with_name(target.name + ".tmp"), ignore_errors=True)
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            cause = _cause(e)
            full = any(s in cause for s in ("No space left", "unexpected pos",
                                            f"[Errno {errno.ENOSPC}]"))
            hint = ("the disk is full: free space or point --checkpoint.folder elsewhere"
                    if full else "check that the folder is writable and has free space")
            raise CheckpointError(f"saving checkpoint {target} failed ({hint}); its partial "
                                  f"files were removed. Cause: {cause}") from e

    def _prune(self, step: int) -> None:
        """Keep the newest ``keep_latest`` checkpoints up to ``step`` that have a manifest
        (the one just written first among them); older ones go. Newer ones (left by a
        run that went further, when resuming fell back past them) are not counted."""
        if self.keep_latest <= 0:
            return
        finished = [p for s, p in list_checkpoints(self.folder)
                    if s <= step and (p / MANIFEST).is_file()]
        for path in finished[:-self.keep_latest]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path: str | Path) -> int:
        """Load the checkpoint at ``path`` (from :func:`resume_point`, the same on every
        rank) into the model, optimizer, trainer state and RNG; returns its step."""
        path = Path(path)
        try:
            keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
            # RNG states are per rank: load ours if this checkpoint has it (same world size).
            with_rng = any(k.startswith(f"rng/rank{self.rank}.") for k in keys)
            simplefsdp.load_checkpoint(path, self._state(with_rng))
        except Exception as e:
            raise CheckpointError(f"loading checkpoint {path} failed: {e!r:.600}") from e
        return self.trainer_state.step


def export_safetensors(model: nn.Module, path: str | Path,
                       pp_group: dist.ProcessGroup | None = None) -> Path | None:
    """Global rank 0 writes the consolidated model (a collective: every rank calls it).

    A tied weight (``output.weight`` is ``tok_embeddings.weight``) is written once; the
    file's metadata records ``tied:output.weight = tok_embeddings.weight``.

    With pipeline stages (``pp_group`` of more than one rank) each stage's leading rank
    consolidates its stage and sends it to rank 0, which merges the stages' keys.
    """
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    pp = dist.get_world_size(pp_group) if pp_group is not None else 1
    if pp == 1:
        full = simplefsdp.full_state_dict(model)
    else:
        # Every rank of a stage gathers the stage; rank 0's pipeline peers send theirs.
        full = simplefsdp.full_state_dict(model, rank0_only=False)
        # The ranks that share global rank 0's data/tensor-parallel coordinates form
        # its PP group: exactly one rank per stage.
        if 0 in dist.get_process_group_ranks(pp_group):
            stages: list[Any] | None = [None] * pp if rank == 0 else None
            dist.gather_object(full, stages, dst=0, group=pp_group)
            if rank == 0:
                full = {k: v for stage in stages for k, v in stage.items()}
    if rank != 0:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, tied, seen = {}, {}, {}
    for key, value in full.items():  # a tied weight is stored once, its alias noted
        ptr = value.untyped_storage().data_ptr()
        if ptr in seen and full[seen[ptr]].shape == value.shape:
            tied[key] = seen[ptr]
            continue
        seen[ptr] = key
        tensors[key] = value.contiguous()
    metadata = {"format": "pt", **{f"tied:{k}": v for k, v in tied.items()}}
    save_file(tensors, str(path), metadata=metadata)
    return path
