"""Documents of local ``.txt``, ``.jsonl`` and ``.parquet`` files (or a folder of them)
joined with EOS into one in-memory token stream.

The trainer reads the same documents from a memory-mapped cache
(``simplefsdp.corpus``); this small in-memory form is for inspecting a corpus and for
checking the trainer against it. A ``.txt`` file is one document; a ``.jsonl`` line or
a parquet row is one document, its text in the ``text_field`` column.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..corpus.sources import documents, resolve
from ..corpus.text import TextDataset
from . import HFError


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """Every non-empty document's text, file by file, in order."""
    docs = [text for _, text in documents(resolve(str(path)).files, text_field) if text]
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
