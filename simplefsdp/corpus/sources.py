"""Which files a ``data.dataset`` names, and their documents, read one at a time.

``data.dataset`` holds one source or several, comma-separated (a mixture, weighted by
``data.weights``). A source is ``"shakespeare"`` (the corpus shipped in
``simplefsdp/data/``), a file, a folder (its ``.txt`` / ``.jsonl`` / ``.json`` /
``.parquet`` files, recursively, in name order) or a glob pattern (``data/*.jsonl``).

A document is a whole ``.txt`` file, a ``.jsonl`` line or a parquet row (its text in
``data.text_field``); empty and null texts are left out. Every document has a
*cursor* ``(file index, place in the file)`` from which reading can restart: the byte
offset of a ``.jsonl`` line, the row of a parquet file, 0 for a ``.txt`` file. Nothing
here loads a file whole except a ``.txt`` document itself.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .text import SHAKESPEARE, shipped_corpus

SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Source:
    """One entry of ``data.dataset``: its spelling and the files it names, in order."""

    name: str
    files: tuple[Path, ...]

    @property
    def num_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def split_sources(dataset: str) -> list[str]:
    """The comma-separated entries of ``data.dataset``."""
    names = [n.strip() for n in dataset.split(",")]
    if not all(names):
        raise ConfigError(f"data.dataset = {dataset!r} has an empty entry; separate sources "
                          f"with single commas")
    return names


def resolve(name: str) -> Source:
    """The files of one source; a clear error (naming ``data.dataset``) for a missing
    path, a glob or folder matching no data file, an unknown extension or an empty file."""
    if name == SHAKESPEARE:
        return Source(name, (shipped_corpus(),))
    path = Path(name).expanduser()
    if any(c in name for c in _GLOB_CHARS):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True)
                       if Path(p).is_file() and Path(p).suffix in SUFFIXES)
        what = "the glob pattern matches"
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        what = "the folder holds"
    elif path.is_file():
        if path.suffix not in SUFFIXES:
            raise ConfigError(f"data.dataset = {name!r}: unsupported file type "
                              f"{path.suffix!r}; use .txt, .jsonl (.json lines) or .parquet")
        files = [path]
        what = ""
    else:
        raise ConfigError(f"data.dataset = {name!r}: no such file, folder or glob match "
                          f"(use '{SHAKESPEARE}', a path, or a pattern such as 'data/*.jsonl')")
    if not files:
        raise ConfigError(f"data.dataset = {name!r}: {what} no .txt, .jsonl, .json or "
                          f".parquet file")
    for f in files:
        if f.stat().st_size == 0:
            raise ConfigError(f"data.dataset = {name!r}: {f} is empty; remove it or fill it")
    return Source(name, tuple(f.resolve() for f in files))


def resolve_all(dataset: str, weights: list[float]) -> list[Source]:
    """Every source of ``data.dataset``, checked against ``data.weights``."""
    names = split_sources(dataset)
    if weights and len(weights) != len(names):
        raise ConfigError(f"data.weights has {len(weights)} entries but data.dataset names "
                          f"{len(names)} sources ({', '.join(names)}); give one weight per "
                          f"source, or none")
    if any(w <= 0 for w in weights):
        raise ConfigError(f"data.weights = {weights}: every weight must be > 0")
    if len(names) > 1 and not weights:
        raise ConfigError(f"data.dataset names {len(names)} sources: set data.weights, one "
                          f"sampling weight per source (e.g. [{', '.join('1' for _ in names)}])")
    return [resolve(n) for n in names]


# ---------------------------------------------------------------------------------------
# Reading documents.
# ---------------------------------------------------------------------------------------
def _text(row, field: str, file: Path, where: str) -> str | None:
    if not isinstance(row, dict) or field not in row:
        keys = list(row) if isinstance(row, dict) else type(row).__name__
        raise ConfigError(f"{file} ({where}): no {field!r} field (it has {keys}); set "
                          f"data.text_field")
    text = row[field]
    if text is not None and not isinstance(text, str):
        raise ConfigError(f"{file} ({where}): field {field!r} is {type(text).__name__}, not "
                          f"text; set data.text_field to the text column")
    return text or None


def _read_txt(file: Path) -> str:
    try:
        return file.read_text("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.dataset: {file} is not UTF-8 text (byte {e.start} cannot be "
                          f"decoded; a binary file?); give a .txt file") from None


def jsonl_lines(file: Path, start: int, end: int | None = None
                ) -> Iterator[tuple[int, bytes]]:
    """``(byte offset, line)`` of the lines starting in ``[start, end)``; ``start`` must be
    a line start."""
    with open(file, "rb") as f:
        f.seek(start)
        offset = start
        while end is None or offset < end:
            line = f.readline()
            if not line:
                return
            yield offset, line
            offset += len(line)


def parse_jsonl(file: Path, offset: int, line: bytes, field: str) -> str | None:
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} (byte {offset}): not a JSON line ({e.msg})") from None
    return _text(row, field, file, f"byte {offset}")


def parquet_rows(file: Path, field: str, start: int = 0, stop: int | None = None
                 ) -> Iterator[tuple[int, str | None]]:
    """``(row, text)`` of rows ``[start, stop)``, read a record batch at a time."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(file)
    if field not in pf.schema_arrow.names:
        raise ConfigError(f"{file}: no {field!r} column (it has {pf.schema_arrow.names}); set "
                          f"data.text_field")
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        texts = batch.column(0).to_pylist()
        if row + len(texts) <= start:
            row += len(texts)
            continue
        for text in texts:
            if row >= start and (stop is None or row < stop):
                yield row, _text({field: text}, field, file, f"row {row}")
            row += 1
        if stop is not None and row >= stop:
            return


def documents(files: tuple[Path, ...], field: str, cursor: tuple[int, int] = (0, 0),
              select=None) -> Iterator[tuple[tuple[int, int], str | None]]:
    """``(cursor, text)`` of every document unit from ``cursor`` on, in order; ``text`` is
    None for an empty unit (kept, so that unit numbering does not depend on content) and
    for a unit that ``select(cursor)`` turns down (then not even parsed)."""
    take = select or (lambda _: True)
    first_file, place = cursor
    for index in range(first_file, len(files)):
        file, start = files[index], place if index == first_file else 0
        if file.suffix == ".txt":
            if start == 0:
                yield (index, 0), (_read_txt(file) or None) if take((index, 0)) else None
        elif file.suffix == ".parquet":
            for row, text in parquet_rows(file, field, start):
                yield (index, row), text if take((index, row)) else None
        else:
            for offset, line in jsonl_lines(file, start):
                yield (index, offset), (parse_jsonl(file, offset, line, field)
                                        if take((index, offset)) else None)
