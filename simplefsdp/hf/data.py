"""Documents from local ``.txt``, ``.jsonl`` and ``.parquet`` files (or a folder of them),
read with Hugging Face ``datasets``, joined with EOS and packed into one token stream.

The stream is cut into fixed windows by the trainer's ``BatchLoader``: the same
per-rank slicing and exact resume (a sample counter) as the plain text corpus.
A ``.txt`` file is one document; a ``.jsonl`` line or a parquet row is one document,
its text in the ``data.text_field`` column. Files of a folder are read in name order.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ..train.data import TextDataset
from . import HFError, require

_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def data_files(path: str | Path) -> list[Path]:
    """The data files ``path`` names: itself, or a folder's supported files by name."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS and p.is_file())
        if not files:
            raise HFError(f"data.dataset = {str(path)!r}: the folder holds no .txt, .jsonl "
                          f"or .parquet file")
        return files
    if not path.is_file():
        raise HFError(f"data.dataset = {str(path)!r}: no such file or folder")
    if path.suffix not in _BUILDERS:
        raise HFError(f"data.dataset = {str(path)!r}: unsupported file type {path.suffix!r}; "
                      f"use .txt, .jsonl or .parquet")
    return [path]


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """Every document's text, file by file, in order (local files only)."""
    require("datasets")
    import datasets

    datasets.disable_progress_bars()
    docs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="simplefsdp-datasets-") as cache:
        for file in data_files(path):
            builder = _BUILDERS[file.suffix]
            kwargs = {"sample_by": "document"} if builder == "text" else {}
            try:
                table = datasets.load_dataset(builder, data_files=str(file), split="train",
                                              cache_dir=cache, keep_in_memory=True, **kwargs)
            except Exception as e:  # noqa: BLE001 - datasets raises many kinds on bad files
                raise HFError(f"{file}: datasets cannot read it as {builder}: {e}") from None
            field = "text" if builder == "text" else text_field
            if field not in table.column_names:
                raise HFError(f"{file}: no {field!r} field (it has {table.column_names}); set "
                              f"data.text_field")
            docs.extend(t for t in table[field] if t)
    if not docs:
        raise HFError(f"data.dataset = {str(path)!r}: no non-empty document")
    return docs


def pack(docs: list[str], tokenizer) -> torch.Tensor:
    """All documents' tokens in one int32 stream, each document followed by EOS."""
    eos = getattr(tokenizer, "eos_id", None)
    encode_batch = getattr(tokenizer, "encode_batch", None)
    ids = encode_batch(docs) if encode_batch else [tokenizer.encode(d) for d in docs]
    stream: list[int] = []
    for doc in ids:
        stream.extend(doc)
        if eos is not None:
            stream.append(eos)
    return torch.tensor(stream, dtype=torch.int32)


class DocumentDataset(TextDataset):
    """``TextDataset`` over documents joined with EOS: the same train/val split and the
    same resumable per-rank ``loader(...)``."""

    def __init__(self, path: str | Path, tokenizer, text_field: str = "text",
                 val_fraction: float = 0.05):
        super().__init__(str(path), tokenizer, val_fraction,
                         tokens=pack(read_documents(path, text_field), tokenizer))
