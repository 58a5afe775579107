"""Tokenize a source once into memory-mapped token files, shared by every rank of a node.

A source's cache is a folder ``<data.cache_dir>/<name>-<key>/`` holding

- ``tokens.bin``: every document's tokens followed by EOS (when the tokenizer has one),
  back to back, ``uint16`` when the vocabulary fits in 65,536 ids, else ``uint32``;
- ``doc_ends.npy``: ``int64`` end offset of each document in ``tokens.bin``;
- ``meta.json``: counts, dtype, what the key was made of, tokenizing time.

The key hashes each file's path, size and mtime, the tokenizer's fingerprint (its
serialized content), the EOS id, ``data.text_field`` and the dtype: a changed file or
tokenizer is a new folder. A build writes ``<folder>.tmp-<pid>`` and renames it last, so
a killed build never leaves a folder that looks complete (a dead build's temporary folder
is removed by the next build). The files are cut into chunks (a ``.txt`` file, 4 MB of
``.jsonl`` lines, a parquet row group) that workers tokenize in batches: threads of this
process when the tokenizer says its ``encode_batch`` leaves the GIL
(``parallel_batches``: Hugging Face and tiktoken files), else forked processes (the
byte tokenizer, a user's Python tokenizer).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing as mp
import os
import pickle
import re
import shutil
import sys
import time
from dataclasses import dataclass
from multiprocessing.pool import ThreadPool
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from . import fast_bpe
from .sources import Source, documents, jsonl_lines, parquet_rows, parse_jsonl

FORMAT_VERSION = 1
CHUNK_BYTES = 4 << 20  # .jsonl bytes per worker task
ENCODE_BATCH = 256  # documents per encode_batch call
PROGRESS_EVERY_S = 2.0


def default_cache_dir() -> Path:
    """``$SIMPLEFSDP_CACHE_DIR/tokens``, default ``~/.cache/simplefsdp/tokens``."""
    root = os.environ.get("SIMPLEFSDP_CACHE_DIR") or Path.home() / ".cache" / "simplefsdp"
    return Path(root) / "tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype for ids below ``vocab_size``."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ConfigError(f"data.tokenizer: a vocabulary of {vocab_size} ids does not fit the "
                      f"uint32 token cache; use a tokenizer with at most 2**32 ids")


def tokenizer_fingerprint(tokenizer) -> str:
    """A string that changes when the tokenizer's encoding does: its ``fingerprint``
    attribute, else a hash of its pickle."""
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if fingerprint:
        return str(fingerprint)
    try:
        return "pickle:" + hashlib.sha256(pickle.dumps(tokenizer)).hexdigest()
    except Exception:  # noqa: BLE001 - any pickling failure means the same thing
        raise ConfigError(f"data.cache_dir: the tokenizer ({type(tokenizer).__name__}) cannot "
                          f"key the token cache: give it a `fingerprint` attribute, a string "
                          f"that changes whenever its encoding does") from None


@dataclass(frozen=True)
class CacheSpec:
    """What a source's cache is made of; ``folder`` is where it lives."""

    source: Source
    fingerprint: str
    eos_id: int | None
    text_field: str
    dtype: np.dtype
    cache_dir: Path

    @property
    def folder(self) -> Path:
        facts = {"version": FORMAT_VERSION, "tokenizer": self.fingerprint, "eos": self.eos_id,
                 "text_field": self.text_field, "dtype": self.dtype.name,
                 "files": [[str(f), f.stat().st_size, f.stat().st_mtime_ns]
                           for f in self.source.files]}
        key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:20]
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(self.source.name).name)[:40] or "data"
        return self.cache_dir / f"{stem}-{key}"


class TokenFile:
    """A finished cache, memory-mapped: ``tokens`` and ``doc_ends`` read pages on demand."""

    def __init__(self, folder: Path):
        meta = json.loads((folder / "meta.json").read_text())
        self.folder, self.meta = folder, meta
        self.tokens = np.memmap(folder / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r",
                                shape=(meta["tokens"],))
        self.doc_ends = np.load(folder / "doc_ends.npy", mmap_mode="r")


def is_complete(folder: Path) -> bool:
    return (folder / "meta.json").is_file()  # written last, inside the renamed folder


# ---------------------------------------------------------------------------------------
# Building.
# ---------------------------------------------------------------------------------------
def chunks(files: tuple[Path, ...], field: str) -> list[tuple[int, int, int]]:
    """``(file index, start, stop)`` work items: a whole .txt file, ~CHUNK_BYTES of .jsonl
    lines (byte offsets at line starts), a parquet row group (rows)."""
    out = []
    for index, file in enumerate(files):
        if file.suffix == ".txt":
            out.append((index, 0, 1))
        elif file.suffix == ".parquet":
            import pyarrow.parquet as pq

            meta, row = pq.ParquetFile(file).metadata, 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                out.append((index, row, row + n))
                row += n
        else:
            size, start = file.stat().st_size, 0
            with open(file, "rb") as f:
                while start < size:
                    f.seek(min(start + CHUNK_BYTES, size))
                    f.readline()  # to the next line start
                    stop = min(f.tell(), size)
                    out.append((index, start, stop))
                    start = stop
    return out


def _chunk_texts(files, field, index, start, stop):
    file = files[index]
    if file.suffix == ".txt":
        return [text for _, text in documents((file,), field)]
    if file.suffix == ".parquet":
        return [text for _, text in parquet_rows(file, field, start, stop)]
    return [parse_jsonl(file, off, line, field) for off, line in jsonl_lines(file, start, stop)]


_WORK: dict = {}  # set in the building process before the workers fork


def _encode(tok, texts: list[str], eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The documents' ids back to back, each followed by ``eos`` (int64), and their
    lengths; one batch call and one array per batch (per-document arrays cost more
    than BPE itself)."""
    encode_batch = getattr(tok, "encode_batch", None)
    ids = encode_batch(texts) if encode_batch else [tok.encode(t) for t in texts]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    if ids and isinstance(ids[0], np.ndarray):  # the fast path's arrays: no per-id Python
        flat = np.concatenate(ids).astype(np.int64)
    else:
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64,
                           count=int(lengths.sum()))
    if eos is None:
        return flat, lengths
    return np.insert(flat, np.cumsum(lengths), eos), lengths + 1


def _tokenize_chunk(task: tuple[int, tuple[int, int, int]]) -> tuple[int, np.ndarray]:
    """Tokenize one chunk into ``chunk-<i>.bin``; returns (i, document lengths)."""
    i, (index, start, stop) = task
    w = _WORK
    texts = [t for t in _chunk_texts(w["files"], w["field"], index, start, stop) if t]
    lengths, vocab = [], w["vocab_size"]
    with open(w["tmp"] / f"chunk-{i:06d}.bin", "wb") as out:
        for b in range(0, len(texts), ENCODE_BATCH):
            arr, lens = _encode(w["tokenizer"], texts[b:b + ENCODE_BATCH], w["eos"])
            if arr.size and (arr.min() < 0 or arr.max() >= vocab):
                raise ConfigError(f"data.tokenizer: the tokenizer gave id {int(arr.max())}, "
                                  f"outside its vocab_size = {vocab}; fix the tokenizer's "
                                  f"vocab_size")
            out.write(arr.astype(w["dtype"]).tobytes())
            lengths.append(lens)
    return i, np.concatenate(lengths) if lengths else np.zeros(0, np.int64)


def _chunk_bytes(files: tuple[Path, ...], chunk: tuple[int, int, int]) -> float:
    """A chunk's share of its file's bytes (for the progress line)."""
    index, start, stop = chunk
    file = files[index]
    if file.suffix in (".jsonl", ".json"):
        return stop - start
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = max(pq.ParquetFile(file).metadata.num_rows, 1)
        return file.stat().st_size * (stop - start) / rows
    return file.stat().st_size


def build(spec: CacheSpec, tokenizer, workers: int, vocab_size: int) -> TokenFile:
    """Tokenize ``spec.source`` into its cache folder (if not already there); map it."""
    final = spec.folder
    if is_complete(final):
        return TokenFile(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(final)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = _tokenize(spec, tokenizer, workers, vocab_size, tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same cache first: use theirs
            if not is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return TokenFile(final)


def _tokenize(spec: CacheSpec, tokenizer, workers: int, vocab_size: int, tmp: Path) -> dict:
    src = spec.source
    tasks = list(enumerate(chunks(src.files, spec.text_field)))
    started = last = time.perf_counter()  # the fast path's checks count as tokenizing
    cpu_started = _cpu_seconds()
    fast, refused = fast_bpe.convert(tokenizer)
    encoder = "tiktoken" if fast else type(tokenizer).__name__
    print(f"[simplefsdp] tokenizing {src.name} with {encoder}"
          + (" (converted from the tokenizer.json; checked to give its ids)" if fast else
             f" (tiktoken fast path not used: {refused})"), file=sys.stderr, flush=True)
    _WORK.update(files=src.files, field=spec.text_field, eos=spec.eos_id, dtype=spec.dtype,
                 tokenizer=fast or tokenizer, tmp=tmp, vocab_size=vocab_size)
    total, done = src.num_bytes, 0
    lengths: list[np.ndarray] = [np.zeros(0, np.int64)] * len(tasks)
    workers = max(1, min(workers, len(tasks)))
    threads = bool(getattr(fast or tokenizer, "parallel_batches", False))
    if mp.current_process().daemon and not threads:  # a daemon may not fork: work here
        workers = 1
    pool = None
    if workers > 1 and threads:  # encode_batch leaves the GIL: threads over chunks
        pool = ThreadPool(workers)
    elif workers > 1:  # fork: the workers inherit the tokenizer, whatever its class
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        pool = mp.get_context("fork").Pool(workers)
    try:
        results = pool.imap_unordered(_tokenize_chunk, tasks) if pool else \
            map(_tokenize_chunk, tasks)
        for i, lens in results:
            lengths[i], done = lens, done + _chunk_bytes(src.files, tasks[i][1])
            now = time.perf_counter()
            if now - last >= PROGRESS_EVERY_S and done < total:
                rate = done / max(now - started, 1e-9)
                print(f"[simplefsdp] tokenizing {src.name}: {done / 1e6:.1f}/{total / 1e6:.1f} "
                      f"MB, {rate / 1e6:.1f} MB/s, ETA {(total - done) / rate:.0f} s",
                      file=sys.stderr, flush=True)
                last = now
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        _WORK.clear()
    with open(tmp / "tokens.bin", "wb") as out:  # chunks in order, then dropped
        for i, _ in tasks:
            part = tmp / f"chunk-{i:06d}.bin"
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
            part.unlink()
    ends = np.cumsum(np.concatenate(lengths)) if tasks else np.zeros(0, np.int64)
    if not len(ends):
        raise ConfigError(f"data.dataset = {src.name!r}: no non-empty document (every text "
                          f"is empty; check data.text_field)")
    np.save(tmp / "doc_ends.npy", ends.astype(np.int64))
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu_started
    meta = {"version": FORMAT_VERSION, "source": src.name, "files": [str(f) for f in src.files],
            "tokens": int(ends[-1]) if len(ends) else 0, "documents": len(ends),
            "dtype": spec.dtype.name, "tokenizer": spec.fingerprint, "eos": spec.eos_id,
            "text_field": spec.text_field, "bytes": total, "seconds": round(seconds, 3),
            "mb_per_s": round(total / 1e6 / max(seconds, 1e-9), 2), "workers": workers,
            "threads": threads, "encoder": encoder, "cpu_seconds": round(cpu, 3),
            "mb_per_cpu_s": round(total / 1e6 / max(cpu, 1e-9), 2)}
    print(f"[simplefsdp] tokenized {src.name}: {meta['documents']} documents, "
          f"{meta['tokens']} tokens ({meta['dtype']}) in {seconds:.1f} s "
          f"({meta['mb_per_s']} MB/s, {workers} {'threads' if threads else 'processes'}) -> "
          f"{tmp.parent}",
          file=sys.stderr, flush=True)
    return meta


def _cpu_seconds() -> float:
    """CPU time of this process's threads and of its finished (joined) children: the
    tokenizing work whatever else the machine runs."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _remove_dead_builds(final: Path) -> None:
    """Delete temporary folders of builds of this cache whose process is gone."""
    for tmp in final.parent.glob(f"{final.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
